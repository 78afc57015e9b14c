// fusekit: what this build contains (info), whether every operator is right on this machine
// (check), and how fast it is next to the copy bandwidth measured in the same run (bench).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "check.h"
#include "common/timer.h"
#include "fusekit/error.h"
#include "fusekit/runtime.h"
#include "ops.h"
#include "report.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fusekit::tools {

namespace {

constexpr int kExitFailed = 1;  // check: a case failed
constexpr int kExitError = 2;   // bad usage or a fusekit::Error (no device, a CUDA error, ...)

// "cpu", "cuda" or "cuda:N"; empty: cuda:0 when a CUDA device is usable, else the CPU.
Device resolve_device(const std::string& text) {
  const int count = cuda_device_count();
  if (text.empty()) return count > 0 ? Device::cuda(0) : Device::cpu();
  if (text == "cpu") return Device::cpu();
  int index = -1;
  if (text == "cuda") {
    index = 0;
  } else if (text.rfind("cuda:", 0) == 0 && text.size() > 5 &&
             text.find_first_not_of("0123456789", 5) == std::string::npos && text.size() < 12) {
    index = std::stoi(text.substr(5));
  }
  FUSEKIT_CHECK(index >= 0, "--device ", text, ": expected cpu, cuda or cuda:N");
  FUSEKIT_CHECK(build_info().with_cuda, "--device ", text, ": this fusekit was built without CUDA");
  FUSEKIT_CHECK(count > 0, "--device ", text, ": no CUDA device found");
  FUSEKIT_CHECK(index < count, "--device ", text, ": only ", count, " CUDA device(s) found");
  return Device::cuda(index);
}

std::string operator_list() {
  std::size_t width = 0;
  for (const Op& op : all_ops()) width = std::max(width, op.name.size());
  std::string list;
  for (const Op& op : all_ops()) list += fmt::format("  {:<{}}  {}\n", op.name, width, op.summary);
  return list;
}

double gib(std::size_t bytes) { return static_cast<double>(bytes) / double(1 << 30); }
double mib(std::size_t bytes) { return static_cast<double>(bytes) / double(1 << 20); }

int run_info() {
  const BuildInfo& build = build_info();
  fmt::print("fusekit {}\n", build.version);
  std::string backends = "CPU";
  if (build.with_cuda) {
    backends += fmt::format(", CUDA (architectures {})", build.cuda_architectures);
  }
  fmt::print("build:   {}\n", backends);
#ifdef _OPENMP
  fmt::print("OpenMP:  {}, up to {} threads\n", build.with_openmp ? "yes" : "no",
             omp_get_max_threads());
#else
  fmt::print("OpenMP:  {}\n", build.with_openmp ? "yes" : "no");
#endif
  fmt::print("cpu:     {}\n", device_name(Device::cpu()));
  const int count = cuda_device_count();
  if (count == 0) {
    fmt::print("cuda:    no CUDA device{}\n", build.with_cuda ? "" : " (built without CUDA)");
  }
  for (int i = 0; i < count; ++i) {
    const CudaDeviceInfo d = cuda_device_info(i);
    fmt::print("cuda:{}:  {}, compute capability {}.{}, {} SMs, {:.1f} GiB, L2 {:.0f} MiB\n", i,
               d.name, d.sm_major, d.sm_minor, d.multiprocessors, gib(d.global_memory_bytes),
               mib(d.l2_cache_bytes));
  }
  fmt::print("operators: ");
  for (std::size_t i = 0; i < all_ops().size(); ++i) {
    fmt::print("{}{}", i ? ", " : "", all_ops()[i].name);
  }
  fmt::print("\n");
  return 0;
}

struct CheckOptions {
  std::vector<std::string> ops;
  std::string device;
  std::uint64_t seed = 0;
  bool seed_given = false;
};

int run_check(const CheckOptions& options) {
  const std::vector<const Op*> ops = select_ops(options.ops);
  const Device device = resolve_device(options.device);
  std::uint64_t seed = options.seed;
  if (!options.seed_given) {
    std::random_device entropy;
    seed = (std::uint64_t{entropy()} << 32) | entropy();
  }
  fmt::print("fusekit check on {} ({}), seed {}\n", to_string(device), device_name(device), seed);
  if (device.kind == DeviceKind::CUDA) {
    fmt::print("errors (max abs, rel) against the float64 reference and the CPU backend\n");
  }
  CaseRunner runner(device);
  runner.print_header();
  for (const Op* op : ops) {
    if (runs_on(*op, device)) op->check({.device = device, .seed = seed, .runner = &runner});
  }
  fmt::print("{} passed, {} failed\n", runner.passed(), runner.failed());
  if (runner.failed() > 0) fmt::print("rerun with --seed {}\n", seed);
  return runner.failed() > 0 ? kExitFailed : 0;
}

struct BenchOptions {
  std::vector<std::string> ops;
  std::string device;
  std::string json;
  bool quick = false;
};

// The CPU is timed with few runs: rows take a tenth of a second or more there, and the whole
// CPU run should finish in about a minute.
detail::TimerOptions timer_options(Device device, bool quick) {
  if (device.kind == DeviceKind::CPU) {
    return quick ? detail::TimerOptions{.warmup = 1, .repeats = 3, .max_seconds = 0.5}
                 : detail::TimerOptions{.warmup = 1, .repeats = 5, .max_seconds = 1.0};
  }
  return quick ? detail::TimerOptions{.warmup = 3, .repeats = 20, .max_seconds = 0.5}
               : detail::TimerOptions{.warmup = 5, .repeats = 100, .max_seconds = 2.0};
}

int run_bench(const BenchOptions& options) {
  const std::vector<const Op*> ops = select_ops(options.ops);
  const Device device = resolve_device(options.device);
  if (!options.json.empty()) {
    // Fail now rather than after the whole run.
    FUSEKIT_CHECK(std::ofstream(options.json, std::ios::app).good(), "bench: cannot open ",
                  options.json, " for writing");
  }
  fmt::print("fusekit bench on {} ({})\n", to_string(device), device_name(device));
  std::fflush(stdout);
  const double copy = detail::measure_copy_bandwidth(device);
  fmt::print("copy bandwidth (read + write): {:.3f} TB/s\n", copy * 1e-12);

  std::vector<BenchRow> rows;
  BenchContext context{.device = device,
                       .quick = options.quick,
                       .timer = timer_options(device, options.quick),
                       .copy_bytes_per_s = copy,
                       .record = [&](BenchRow row) {
                         print_bench_row(row, copy);
                         rows.push_back(std::move(row));
                       }};
  for (const Op* op : ops) {
    if (runs_on(*op, device)) op->bench(context);
  }
  print_bench_table(rows, copy);
  if (!options.json.empty()) {
    write_bench_json(options.json, device, copy, rows);
    fmt::print("wrote {}\n", options.json);
  }
  return 0;
}

// Breaks `text` into lines of at most `width` characters at spaces (CLI11 prints footers as is).
std::string wrap(const std::string& text, std::size_t width = 96) {
  std::string out, line, word;
  std::istringstream words(text);
  while (words >> word) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += line + '\n';
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  return out + line;
}

std::string bench_footer() {
  std::string text =
      "Rows: bytes are each input read once plus each output written once; % copy is against "
      "the copy bandwidth measured at the start of the same run; TFLOP/s (rows of a matrix "
      "product) counts two per multiply-add. Inputs are random, made once "
      "per row. CUDA: CUDA events, L2 flushed before each run, median of up to 100 runs "
      "(20 with --quick). CPU: the rows marked 'not on the CPU' are skipped, and each row is 1 "
      "warm-up and the median of at most 5 runs (3 with --quick), so that the whole CPU run "
      "takes well under a minute.";
  std::string wrapped = wrap(text);
  for (const Op& op : all_ops()) wrapped += "\n\n" + wrap(std::string(op.bench_shapes));
  return wrapped;
}

}  // namespace

int run_cli(int argc, char** argv) {
  CLI::App app{"fusekit: fused deep-learning operators, CPU and CUDA", "fusekit"};
  app.set_version_flag("--version", build_info().version);
  app.require_subcommand(1);
  app.footer("Exit status: 0 success, 1 a check failed, 2 an error (printed as\n"
             "'fusekit: error: ...').");
  const std::string device_help =
      "cpu, cuda or cuda:N (default: cuda:0 when a CUDA device is usable, else cpu)";

  CLI::App* info = app.add_subcommand("info", "Version, build (CPU/CUDA, architectures, OpenMP) "
                                              "and the devices found");

  CheckOptions check_options;
  CLI::App* check = app.add_subcommand(
      "check", "Compare every operator (or those named) with float64 references on random inputs");
  check->add_option("ops", check_options.ops, "Operators to check (default: all)");
  check->add_option("--device", check_options.device, device_help);
  check->add_option("--seed", check_options.seed,
                    "Seed of the inputs (default: a random one, printed)");
  check->footer(wrap("Each operator runs at several shapes (including zero and one row and odd "
                     "sizes), in float32, bfloat16 and float16, with misaligned and "
                     "non-contiguous layouts, forward and backward, into outputs filled with NaN. "
                     "On the CPU the results are compared with a float64 reference; on CUDA "
                     "with the CPU backend on the same inputs and with the float64 reference. A "
                     "case also fails when it writes outside its outputs or two runs differ.") +
                "\n\nOperators:\n" + operator_list());

  BenchOptions bench_options;
  CLI::App* bench = app.add_subcommand(
      "bench", "Time every operator (or those named) against the copy bandwidth of the device");
  bench->add_option("ops", bench_options.ops, "Operators to time (default: all)");
  bench->add_option("--device", bench_options.device, device_help);
  bench->add_option("--json", bench_options.json, "Also write the rows, device and build to FILE")
      ->type_name("FILE");
  bench->add_flag("--quick", bench_options.quick, "A few rows with fewer runs");
  bench->footer(bench_footer());

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    fmt::print(stderr, "fusekit: error: {}\nRun 'fusekit --help' for usage.\n", e.what());
    return kExitError;
  }
  check_options.seed_given = check->count("--seed") > 0;

  try {
    if (info->parsed()) return run_info();
    if (check->parsed()) return run_check(check_options);
    if (bench->parsed()) return run_bench(bench_options);
    throw Error("no subcommand");  // require_subcommand(1) makes this unreachable
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "fusekit: error: {}\n", e.what());
    return kExitError;
  }
}

}  // namespace fusekit::tools

int main(int argc, char** argv) { return fusekit::tools::run_cli(argc, argv); }
