// What `fusekit bench` prints and writes: one row per timed case, the closing table, the JSON file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/timer.h"
#include "fusekit/tensor.h"

namespace fusekit::tools {

struct BenchRow {
  std::string op;     // "mhc_post"
  std::string pass;   // "forward" or "backward"
  std::string shape;  // "N4096 H7168 hc4"
  DType dtype = DType::Float32;
  Device device;
  double median_us = 0, min_us = 0;
  int runs = 0;
  double bytes = 0;  // each input read once plus each output written once
  double flops = 0;  // 2 per multiply-add of a matrix product; 0 where arithmetic does not count

  /// Takes the median, the fastest run and the run count of a timing.
  void set_timing(const detail::Timing& t) {
    median_us = t.median_us;
    min_us = t.min_us;
    runs = t.runs;
  }
  double bytes_per_s() const { return median_us > 0 ? bytes / (median_us * 1e-6) : 0; }
  double flops_per_s() const { return median_us > 0 ? flops / (median_us * 1e-6) : 0; }
};

/// "NVIDIA H100 80GB HBM3" for a CUDA device; the processor's model and thread count on the CPU.
std::string device_name(Device device);
/// Now, in UTC: "2025-01-31T12:00:00Z".
std::string utc_timestamp();

/// One line as a row is measured.
void print_bench_row(const BenchRow& row, double copy_bytes_per_s);
/// The closing table of every row.
void print_bench_table(const std::vector<BenchRow>& rows, double copy_bytes_per_s);
/// {device, date, build, copy_bandwidth_bytes_per_s, rows[]}; throws an Error when it cannot write.
void write_bench_json(const std::string& path, Device device, double copy_bytes_per_s,
                      const std::vector<BenchRow>& rows);

}  // namespace fusekit::tools
