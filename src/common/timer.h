// The one timer of fusekit's benchmarks: warm-up, then the median of many timed runs, with
// CUDA events on a GPU (optionally flushing L2 before each run) and a steady clock on the CPU.
#pragma once

#include <functional>
#include <vector>

#include "fusekit/tensor.h"

namespace fusekit::detail {

struct TimerOptions {
  int warmup = 5;
  int repeats = 50;
  double max_seconds = 2.0;  // stop repeating (after at least 3 runs) once this much time is spent
  bool flush_l2 = true;      // on CUDA: overwrite a buffer larger than L2 before each run
};

struct Timing {
  double median_us = 0;
  double min_us = 0;
  int runs = 0;
};

/// Times `fn`, which must enqueue its work on `stream` (CUDA) or run it (CPU).
Timing time_it(Device device, Stream stream, const std::function<void()>& fn,
               const TimerOptions& options = {});

/// Copy bandwidth of `device` in bytes per second, counting bytes read plus bytes written:
/// a large device-to-device copy on CUDA, a parallel memcpy on the CPU.
double measure_copy_bandwidth(Device device);

}  // namespace fusekit::detail
