// The registry of `fusekit check` and `fusekit bench`: per operator a name, its correctness cases
// and its benchmark rows. Each operator's cases live in tools/ops/<op>.cpp (built when the operator
// is in FUSEKIT_OPS); registering one more is a declaration and a list entry in tools/ops.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "check.h"
#include "common/timer.h"
#include "fusekit/tensor.h"
#include "report.h"
#include "testing/host_tensor.h"

namespace fusekit::tools {

struct CheckContext {
  Device device;
  std::uint64_t seed = 0;
  CaseRunner* runner = nullptr;  // runs one case and prints its line
};

struct BenchContext {
  Device device;
  bool quick = false;
  detail::TimerOptions timer;
  double copy_bytes_per_s = 0;          // the ceiling measured at the start of the run
  std::function<void(BenchRow)> record;  // prints the row and keeps it for the table and JSON
};

/// Runs `bench_case(cases[i], seed)` for every row this run times: under --quick only the rows
/// marked quick, on the CPU only those marked on_cpu. A row's inputs take seeds from 16 i upwards.
template <class Case, class BenchCase>
void bench_each(const BenchContext& ctx, const std::vector<Case>& cases, BenchCase bench_case) {
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    if ((ctx.quick && !c.quick) || (ctx.device.kind == DeviceKind::CPU && !c.on_cpu)) continue;
    bench_case(c, std::uint64_t{16} * i);
  }
}

struct Op {
  std::string_view name;
  std::string_view summary;
  std::string_view bench_shapes;  // the rows `fusekit bench` times, for --help
  std::function<void(const CheckContext&)> check;
  std::function<void(const BenchContext&)> bench;
  /// false while the operator has only its CPU backend: check and bench then skip it on a CUDA
  /// device, with a note, instead of failing on the backend's not-implemented error.
  bool has_cuda_backend = true;
};

/// Every registered operator, in the order check and bench run them.
std::span<const Op> all_ops();

/// The generator of check case `index` of `pass`: each case draws from its own, so that its inputs
/// depend only on the seed and the case, not on which operators or cases ran before it.
std::mt19937_64 case_rng(std::uint64_t seed, std::uint32_t pass, std::size_t index);

/// Runs `check_case(ctx, cases[i], rng)` for every case, each with case_rng(ctx.seed, pass, i).
template <class Case, class CheckCase>
void check_each(const CheckContext& ctx, const std::vector<Case>& cases, CheckCase check_case,
                std::uint32_t pass = 0) {
  for (std::size_t i = 0; i < cases.size(); ++i) {
    std::mt19937_64 rng = case_rng(ctx.seed, pass, i);
    check_case(ctx, cases[i], rng);
  }
}

/// Inputs for benchmarks: uniform values of unit variance, never all zeros, a pure function of
/// `seed` and filled in parallel, so that large tensors take little of the run.
testing::HostTensor bench_input(std::vector<std::int64_t> shape, std::uint64_t seed);

/// The operators named in `names` (all of them when empty); an Error lists the known names
/// when one is unknown.
std::vector<const Op*> select_ops(const std::vector<std::string>& names);

/// Whether `op` runs on `device`; when it does not, prints a note saying why it is skipped.
bool runs_on(const Op& op, Device device);

}  // namespace fusekit::tools
