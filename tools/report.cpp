#include "report.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "fusekit/error.h"
#include "fusekit/runtime.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fusekit::tools {

namespace {

int cpu_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#endif
}

// The processor's model from /proc/cpuinfo where there is one (Linux), else empty.
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) break;
    const auto begin = line.find_first_not_of(" \t", colon + 1);
    return begin == std::string::npos ? std::string() : line.substr(begin);
  }
  return {};
}

double percent_of(double bytes_per_s, double ceiling) {
  return ceiling > 0 ? 100.0 * bytes_per_s / ceiling : 0;
}

}  // namespace

std::string device_name(Device device) {
  if (device.kind == DeviceKind::CUDA) return cuda_device_info(device.index).name;
  const std::string model = cpu_model();
  return fmt::format("{}{} threads", model.empty() ? "" : model + ", ", cpu_threads());
}

std::string utc_timestamp() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

void print_bench_row(const BenchRow& row, double copy_bytes_per_s) {
  const std::string flops =
      row.flops > 0 ? fmt::format(", {:.2f} TFLOP/s", row.flops_per_s() * 1e-12) : "";
  fmt::print("{} {} {} {} on {}: median {:.1f} us over {} runs, {:.1f} GB/s, {:.0f}% of copy{}\n",
             row.op, row.pass, row.shape, to_string(row.dtype), to_string(row.device),
             row.median_us, row.runs, row.bytes_per_s() * 1e-9,
             percent_of(row.bytes_per_s(), copy_bytes_per_s), flops);
  std::fflush(stdout);
}

void print_bench_table(const std::vector<BenchRow>& rows, double copy_bytes_per_s) {
  fmt::print("\n{:<21} {:<8} {:<24} {:<8} {:<7} {:>11} {:>9} {:>7} {:>9}\n", "op", "pass",
             "shape", "dtype", "device", "median us", "GB/s", "% copy", "TFLOP/s");
  for (const BenchRow& row : rows) {
    const std::string flops =
        row.flops > 0 ? fmt::format("{:.2f}", row.flops_per_s() * 1e-12) : "-";
    fmt::print("{:<21} {:<8} {:<24} {:<8} {:<7} {:>11.1f} {:>9.1f} {:>7.1f} {:>9}\n", row.op,
               row.pass, row.shape, to_string(row.dtype), to_string(row.device), row.median_us,
               row.bytes_per_s() * 1e-9, percent_of(row.bytes_per_s(), copy_bytes_per_s), flops);
  }
  fmt::print("copy bandwidth (read + write): {:.3f} TB/s\n", copy_bytes_per_s * 1e-12);
  std::fflush(stdout);
}

void write_bench_json(const std::string& path, Device device, double copy_bytes_per_s,
                      const std::vector<BenchRow>& rows) {
  const BuildInfo& build = build_info();
  nlohmann::ordered_json doc;  // keys in the order written
  doc["device"] = {{"id", to_string(device)}, {"name", device_name(device)}};
  doc["date"] = utc_timestamp();
  doc["build"] = {{"version", build.version},
                  {"cuda", build.with_cuda},
                  {"cuda_architectures", build.cuda_architectures},
                  {"openmp", build.with_openmp}};
  doc["copy_bandwidth_bytes_per_s"] = copy_bytes_per_s;
  doc["rows"] = nlohmann::ordered_json::array();
  for (const BenchRow& row : rows) {
    nlohmann::ordered_json r = {
        {"op", row.op},
        {"pass", row.pass},
        {"shape", row.shape},
        {"dtype", to_string(row.dtype)},
        {"device", to_string(row.device)},
        {"median_us", row.median_us},
        {"min_us", row.min_us},
        {"runs", row.runs},
        {"bytes", row.bytes},
        {"bytes_per_s", row.bytes_per_s()},
        {"fraction_of_copy", copy_bytes_per_s > 0 ? row.bytes_per_s() / copy_bytes_per_s : 0.0}};
    if (row.flops > 0) {  // only rows whose arithmetic counts
      r["flops"] = row.flops;
      r["flops_per_s"] = row.flops_per_s();
    }
    doc["rows"].push_back(std::move(r));
  }
  std::ofstream out(path);
  FUSEKIT_CHECK(out.good(), "bench: cannot open ", path, " for writing");
  out << doc.dump(2) << '\n';
  out.close();
  FUSEKIT_CHECK(out.good(), "bench: writing ", path, " failed");
}

}  // namespace fusekit::tools
