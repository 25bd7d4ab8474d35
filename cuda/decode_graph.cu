// customops::DecodeGraph (cpp/generate/decode_graph.h): torch's CUDAGraph around one run of a
// causal-LM package. The package runs with run_single_threaded (no events or locks of its own, which
// capture forbids), and every kernel it launches is loaded by the run before the capture, on the
// capture's stream: the capture only records.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "generate/decode_graph.h"
#include "ops/checks.h"

namespace customops {

struct DecodeGraph::Impl {
  at::cuda::CUDAGraph graph;
  std::vector<at::Tensor> first, outputs;
};

DecodeGraph::DecodeGraph(c10::Device device, const std::function<std::vector<at::Tensor>()>& step)
    : impl_(new Impl) {
  const c10::cuda::CUDAGuard guard(device);
  // Capture needs a stream other than the default one, and the work queued so far finished (the
  // capture stream does not wait for other streams).
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
  const c10::cuda::CUDAStreamGuard on(stream);
  impl_->first = step();
  impl_->graph.capture_begin();
  try {
    impl_->outputs = step();
  } catch (...) {
    // End the capture before the error goes on, so the stream is usable; the graph is dropped.
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream.stream(), &g);
    if (g != nullptr) cudaGraphDestroy(g);
    (void)cudaGetLastError();
    throw;
  }
  impl_->graph.capture_end();
  stream.synchronize();
}

DecodeGraph::~DecodeGraph() = default;

const std::vector<at::Tensor>& DecodeGraph::first() const { return impl_->first; }

const std::vector<at::Tensor>& DecodeGraph::replay() {
  impl_->graph.replay();
  return impl_->outputs;
}

bool checks::cuda_stream_capturing() {
  return at::cuda::currentStreamCaptureStatusMayInitCtx() != at::cuda::CaptureStatus::None;
}

}  // namespace customops
