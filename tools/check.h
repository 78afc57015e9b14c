// The case runner of `fusekit check`: runs one operator case on the chosen device into poisoned
// outputs, compares with the float64 reference (and, on CUDA, with the CPU backend on the same
// inputs, within the sum of both backends' bounds), checks that nothing outside the outputs'
// views was written and that two runs give the same bytes, and prints one line per case.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fusekit/tensor.h"
#include "testing/host_tensor.h"

namespace fusekit::tools {

/// Outputs computed element-wise: a few float32 products and sums, one rounding to `dtype`.
/// float32 ~1e-5; bfloat16 and float16 within about one unit in the last place.
testing::Tolerance elementwise_tolerance(DType dtype);
/// float32 sums over `length` products (the reductions of a backward pass), compared with float64.
/// The absolute part scales with sqrt(length), the size of a sum of random terms.
testing::Tolerance reduction_tolerance(std::int64_t length);

struct ExpectedOutput {
  std::string name;               // "grad_x"
  testing::HostTensor reference;  // float64
  testing::Tolerance tolerance;   // of the device's result against the reference
  /// The CPU backend's own bound against the reference, where it is tighter than `tolerance` (a
  /// CUDA path in lower precision); empty: `tolerance`. On CUDA the result is also compared with
  /// the CPU backend's, within the sum of the two bounds.
  std::optional<testing::Tolerance> cpu_tolerance = {};
  /// Where the output sums terms that may cancel: the same formula over its inputs' absolute
  /// values. The norm bounds are then relative to it (testing::compare), since the sums' rounding
  /// errors follow the terms, not the result.
  std::optional<testing::HostTensor> terms = {};
};

struct CaseInfo {
  std::string op;      // "mhc_post"
  std::string pass;    // "forward" or "backward"
  std::string shape;   // "N7 H127 hc3"
  std::string layout;  // "contiguous", "misaligned", ..., then any options: "weight^T erf"
  DType dtype = DType::Float32;
};

/// Uploads the case's inputs to `device`, runs the operator there into outputs made with
/// testing::empty_poisoned, and returns those outputs in the order of the expected outputs.
using RunOnDevice = std::function<std::vector<testing::DeviceTensor>(Device device)>;

class CaseRunner {
 public:
  explicit CaseRunner(Device device) : device_(device) {}

  /// Prints the column header of the case lines.
  void print_header() const;
  /// Runs, compares and prints one case. An Error thrown by the operator fails the case.
  void run(const CaseInfo& info, const RunOnDevice& run_on,
           const std::vector<ExpectedOutput>& expected);

  Device device() const { return device_; }
  int passed() const { return passed_; }
  int failed() const { return failed_; }

 private:
  Device device_;
  int passed_ = 0;
  int failed_ = 0;
};

}  // namespace fusekit::tools
