// What the CUDA test suites share: skipping without a device, streams of their own, and checks
// of the CUDA runtime's state.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "fusekit/fusekit.h"
#include "test_support.h"

namespace fusekit_test {

// Waits for the device and fails on any error a kernel left behind.
inline void expect_device_ok() {
  const cudaError_t err = cudaDeviceSynchronize();
  EXPECT_EQ(err, cudaSuccess) << cudaGetErrorName(err) << ": " << cudaGetErrorString(err);
}

#define ASSERT_CUDA(call)                                                                   \
  do {                                                                                      \
    const cudaError_t err_ = (call);                                                        \
    ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorName(err_) << ", "         \
                                 << cudaGetErrorString(err_);                               \
  } while (0)

/// A test that needs a CUDA device and skips, saying so, without one.
template <typename Base = ::testing::Test>
class CudaTest : public Seeded<Base> {
 protected:
  void SetUp() override {
    if (fusekit::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

/// In a test that needs a second CUDA device: skips, saying so, where there is none.
#define SKIP_WITHOUT_TWO_DEVICES()                                                          \
  if (fusekit::cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices"

/// The error of operator `op` given a stream of cuda:0 for tensors on cuda:1.
inline std::string stream_of_first_device_error(const std::string& op) {
  return op + ": stream belongs to cuda:0 but the tensors are on cuda:1";
}

/// Captures what `enqueue` puts on `stream` (global mode) into `*graph`. A fusekit::Error thrown
/// while capturing ends the capture, leaves `*graph` null and fails the test (call through
/// ASSERT_NO_FATAL_FAILURE).
template <typename Enqueue>
void capture_graph(cudaStream_t stream, cudaGraph_t* graph, Enqueue&& enqueue) {
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    enqueue();
  } catch (const fusekit::Error& e) {
    cudaStreamEndCapture(stream, graph);
    if (*graph != nullptr) cudaGraphDestroy(*graph);
    *graph = nullptr;
    FAIL() << "capture failed: " << e.what();
  }
  ASSERT_CUDA(cudaStreamEndCapture(stream, graph));
}

/// The two allocations hold the same bytes, padding and poison included.
inline void expect_same_bytes(const DeviceTensor& got, const DeviceTensor& expected,
                              const std::string& what) {
  const std::vector<unsigned char> a = raw_bytes(got), b = raw_bytes(expected);
  ASSERT_EQ(a.size(), b.size()) << what;
  std::size_t differ = 0, first = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i] && differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << a.size()
                        << " bytes differ, the first at byte " << first;
}

/// Every byte of `t`'s allocation still holds the poison: nothing was written at all.
inline void expect_untouched(const DeviceTensor& t, const std::string& what) {
  std::size_t written = 0;
  for (unsigned char byte : raw_bytes(t)) written += byte != 0xff;
  EXPECT_EQ(written, 0u) << what << ": " << written << " bytes of " << t.view.describe()
                         << " were written";
}

/// The nodes of a captured graph: all, and by kind kernels and stream-ordered allocations and
/// frees.
struct GraphNodeCounts {
  int total = 0, kernels = 0, allocs = 0, frees = 0;
};

/// Counts the nodes of `graph` into `counts` (call through ASSERT_NO_FATAL_FAILURE).
inline void count_graph_nodes(cudaGraph_t graph, GraphNodeCounts& counts) {
  std::size_t count = 0;
  ASSERT_CUDA(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  ASSERT_CUDA(cudaGraphGetNodes(graph, nodes.data(), &count));
  counts.total = static_cast<int>(count);
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    ASSERT_CUDA(cudaGraphNodeGetType(node, &type));
    counts.kernels += type == cudaGraphNodeTypeKernel;
    counts.allocs += type == cudaGraphNodeTypeMemAlloc;
    counts.frees += type == cudaGraphNodeTypeMemFree;
  }
}

/// A stream made for one test.
class OwnStream {
 public:
  OwnStream() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess); }
  /// A stream of `device`; the current device stays as it was.
  explicit OwnStream(int device) {
    int current = 0;
    EXPECT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaSetDevice(current), cudaSuccess);
  }
  ~OwnStream() { cudaStreamDestroy(stream_); }
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
  cudaStream_t get() const { return stream_; }
  fusekit::Stream stream() const { return fusekit::Stream{stream_}; }

 private:
  cudaStream_t stream_ = nullptr;
};

/// For an operator `op` whose tensors are on cuda:1 while cuda:0 is current: `run(stream)` given a
/// stream of cuda:0 throws the error naming both devices and writes none of `outputs`; given a
/// stream of cuda:1 it runs, and has finished when this returns, for the caller to check its
/// results (call through ASSERT_NO_FATAL_FAILURE).
template <typename Run>
void run_on_the_second_device(const std::string& op,
                              std::initializer_list<const DeviceTensor*> outputs, Run&& run) {
  const OwnStream of_first;
  EXPECT_ERROR_CONTAINS(stream_of_first_device_error(op), [&] { run(of_first.stream()); });
  for (const DeviceTensor* t : outputs) expect_untouched(*t, t->view.describe());
  const OwnStream of_second(1);
  run(of_second.stream());
  ASSERT_CUDA(cudaStreamSynchronize(of_second.get()));
}

/// What `enqueue` puts on a stream, captured into a graph, instantiated at its first replay;
/// both are destroyed with this, whatever the test's assertions did.
class CapturedGraph {
 public:
  CapturedGraph() = default;
  ~CapturedGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  /// Captures `enqueue` on `stream` (see capture_graph; call through ASSERT_NO_FATAL_FAILURE).
  template <typename Enqueue>
  void capture(cudaStream_t stream, Enqueue&& enqueue) {
    stream_ = stream;
    capture_graph(stream, &graph_, std::forward<Enqueue>(enqueue));
  }

  /// The graph's nodes (call through ASSERT_NO_FATAL_FAILURE).
  void count_nodes(GraphNodeCounts& counts) const { count_graph_nodes(graph_, counts); }

  /// Poisons `outputs` first, so that the replay must write every element again, then launches
  /// the graph on the stream it was captured on and waits for it (call through
  /// ASSERT_NO_FATAL_FAILURE).
  void replay(std::initializer_list<DeviceTensor*> outputs = {}) {
    if (exec_ == nullptr) ASSERT_CUDA(cudaGraphInstantiate(&exec_, graph_, 0));
    for (DeviceTensor* t : outputs) t->buffer.fill_bytes(0xff);
    expect_device_ok();  // the poison (legacy stream) is in place: the stream does not wait
    ASSERT_CUDA(cudaGraphLaunch(exec_, stream_));
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
    expect_device_ok();
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace fusekit_test
