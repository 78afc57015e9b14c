#include "check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "fusekit/error.h"

namespace fusekit::tools {

namespace {

using testing::DeviceTensor;
using testing::HostTensor;

// The largest errors over a case's outputs.
struct WorstError {
  double max_abs = 0, rel = 0;
  void add(const testing::Comparison& c) {
    max_abs = std::max(max_abs, c.max_abs_error);
    rel = std::max(rel, c.rel_error);
  }
};

std::vector<unsigned char> raw_bytes(const DeviceTensor& t) {
  std::vector<unsigned char> bytes(t.buffer.bytes());
  if (!bytes.empty()) t.buffer.copy_to_host(bytes.data(), bytes.size());
  return bytes;
}

// Outputs come from empty_poisoned: every byte 0xff. After the call, bytes of the allocation that
// belong to no element of the view (padding, the misalignment offset) must still be 0xff.
std::string poison_damage(const DeviceTensor& t) {
  const std::vector<unsigned char> bytes = raw_bytes(t);
  std::vector<bool> in_view(bytes.size(), false);
  const TensorView& v = t.view;
  if (v.numel() > 0) {
    const auto esize = static_cast<std::int64_t>(element_size(v.dtype));
    const std::int64_t base =
        static_cast<const char*>(v.data) - static_cast<const char*>(t.buffer.data());
    std::vector<std::int64_t> idx(v.ndim, 0);
    for (std::int64_t flat = 0; flat < v.numel(); ++flat) {
      std::int64_t off = base;
      for (int d = 0; d < v.ndim; ++d) off += idx[d] * v.strides[d] * esize;
      std::fill_n(in_view.begin() + off, esize, true);
      for (int d = v.ndim - 1; d >= 0 && ++idx[d] == v.shape[d]; --d) idx[d] = 0;
    }
  }
  std::int64_t damaged = 0, first = -1;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (!in_view[i] && bytes[i] != 0xff) {
      if (damaged++ == 0) first = static_cast<std::int64_t>(i);
    }
  }
  if (damaged == 0) return {};
  return fmt::format("{} byte(s) outside the view were written, the first at byte {} of {}",
                     damaged, first, bytes.size());
}

// Two results within `a` and `b` of one reference lie within a + b of each other.
testing::Tolerance sum(const testing::Tolerance& a, const testing::Tolerance& b) {
  return {.atol = a.atol + b.atol, .rtol = a.rtol + b.rtol, .rel = a.rel + b.rel};
}

std::string errors_text(const WorstError& e) {
  return fmt::format("{:<8.2e} {:<8.2e}", e.max_abs, e.rel);
}

}  // namespace

testing::Tolerance elementwise_tolerance(DType dtype) {
  switch (dtype) {
    case DType::Float32: return {.atol = 1e-5, .rtol = 1e-5, .rel = 1e-5};
    case DType::BFloat16: return {.atol = 1e-3, .rtol = 1e-2, .rel = 5e-3};
    case DType::Float16: return {.atol = 1e-4, .rtol = 2e-3, .rel = 1e-3};
    default: throw Error(detail::concat("check: no tolerance for dtype ", to_string(dtype)));
  }
}

testing::Tolerance reduction_tolerance(std::int64_t length) {
  const double scale = std::sqrt(static_cast<double>(std::max<std::int64_t>(length, 1)));
  return {.atol = 1e-5 * scale, .rtol = 1e-5, .rel = 1e-5};
}

void CaseRunner::print_header() const {
  // Errors against the float64 reference, then (CUDA) against the CPU backend: max abs, rel.
  fmt::print("{:<21} {:<8} {:<20} {:<24} {:<8} {:<7} {:<8} {:<8} {}result\n", "op", "pass",
             "shape", "layout", "dtype", "device", "f64 abs", "f64 rel",
             device_.kind == DeviceKind::CUDA ? "cpu abs  cpu rel  " : "");
}

void CaseRunner::run(const CaseInfo& info, const RunOnDevice& run_on,
                     const std::vector<ExpectedOutput>& expected) {
  const bool cuda = device_.kind == DeviceKind::CUDA;
  WorstError vs_reference, vs_cpu;  // the largest errors over the case's outputs
  std::vector<std::string> failures;
  try {
    const std::vector<DeviceTensor> got = run_on(device_);
    const std::vector<DeviceTensor> again = run_on(device_);
    std::vector<DeviceTensor> on_cpu;
    if (cuda) on_cpu = run_on(Device::cpu());
    FUSEKIT_CHECK(got.size() == expected.size() && again.size() == expected.size() &&
                      (!cuda || on_cpu.size() == expected.size()),
                  "check: ", info.op, " returned ", got.size(), " outputs, expected ",
                  expected.size());
    for (std::size_t k = 0; k < expected.size(); ++k) {
      const ExpectedOutput& e = expected[k];
      const HostTensor values = testing::download(got[k].view);
      const HostTensor* const terms = e.terms ? &*e.terms : nullptr;
      const testing::Comparison c = testing::compare(values, e.reference, e.tolerance, terms);
      vs_reference.add(c);
      if (!c.ok) failures.push_back(fmt::format("{} vs float64: {}", e.name, c.message));
      if (cuda) {
        const testing::Comparison cc =
            testing::compare(values, testing::download(on_cpu[k].view),
                             sum(e.tolerance, e.cpu_tolerance.value_or(e.tolerance)), terms);
        vs_cpu.add(cc);
        if (!cc.ok) failures.push_back(fmt::format("{} vs cpu backend: {}", e.name, cc.message));
      }
      if (const std::string damage = poison_damage(got[k]); !damage.empty()) {
        failures.push_back(fmt::format("{}: {}", e.name, damage));
      }
      if (raw_bytes(got[k]) != raw_bytes(again[k])) {
        failures.push_back(fmt::format("{}: two runs on the same inputs differ", e.name));
      }
    }
  } catch (const Error& error) {
    failures.push_back(fmt::format("error: {}", error.what()));
  }

  const bool ok = failures.empty();
  (ok ? passed_ : failed_) += 1;
  const std::string cpu_errors = cuda ? errors_text(vs_cpu) + " " : std::string();
  fmt::print("{:<21} {:<8} {:<20} {:<24} {:<8} {:<7} {} {}{}\n", info.op, info.pass, info.shape,
             info.layout, to_string(info.dtype), to_string(device_), errors_text(vs_reference),
             cpu_errors, ok ? "ok" : "FAIL");
  for (const std::string& f : failures) fmt::print("    {}\n", f);
  std::fflush(stdout);
}

}  // namespace fusekit::tools
