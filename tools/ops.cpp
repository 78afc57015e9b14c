#include "ops.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "fusekit/error.h"

namespace fusekit::tools {

// Registering an operator: declare its <op>_op(), defined in tools/ops/<op>.cpp, and list it.
Op mhc_post_op();
Op layernorm_linear_gelu_op();
Op trimul_op();
Op causal_attention_op();
Op cheri_block_op();

std::span<const Op> all_ops() {
  static const Op ops[] = {
      mhc_post_op(),
      layernorm_linear_gelu_op(),
      trimul_op(),
      causal_attention_op(),
      cheri_block_op(),
  };
  return ops;
}

std::mt19937_64 case_rng(std::uint64_t seed, std::uint32_t pass, std::size_t index) {
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32), pass,
                    static_cast<std::uint32_t>(index)};
  return std::mt19937_64(seq);
}

testing::HostTensor bench_input(std::vector<std::int64_t> shape, std::uint64_t seed) {
  testing::HostTensor t(std::move(shape));
  const auto count = static_cast<std::int64_t>(t.values.size());
  double* values = t.values.data();
  const double scale = std::sqrt(3.0) / double(std::uint64_t{1} << 52);  // [-sqrt 3, sqrt 3)
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < count; ++i) {
    // splitmix64 of the index: independent of the thread count.
    std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    values[i] = (static_cast<double>(z >> 11) - double(std::uint64_t{1} << 52)) * scale;
  }
  return t;
}

std::vector<const Op*> select_ops(const std::vector<std::string>& names) {
  std::vector<const Op*> selected;
  for (const Op& op : all_ops()) {
    if (names.empty() || std::find(names.begin(), names.end(), op.name) != names.end()) {
      selected.push_back(&op);
    }
  }
  for (const std::string& name : names) {
    const bool known = std::any_of(all_ops().begin(), all_ops().end(),
                                   [&](const Op& op) { return op.name == name; });
    if (known) continue;
    std::string list;
    for (const Op& op : all_ops()) list += (list.empty() ? "" : ", ") + std::string(op.name);
    throw Error(detail::concat("unknown operator '", name, "'; known operators: ", list));
  }
  return selected;
}

bool runs_on(const Op& op, Device device) {
  if (device.kind != DeviceKind::CUDA || op.has_cuda_backend) return true;
  fmt::print("{}: skipped on {}: no CUDA backend yet\n", op.name, to_string(device));
  return false;
}

}  // namespace fusekit::tools
