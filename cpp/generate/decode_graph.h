// Internal: a decode step of customops::CausalLM captured once in a CUDA graph and replayed
// (cuda/decode_graph.cu; CUDA builds only). A decode step is hundreds of small kernels whose
// launches, not their work, bound its time; one graph launch replaces them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <vector>

namespace customops {

class DecodeGraph {
 public:
  // Runs step() once on a side stream of device (a real step: first() holds its outputs; and the
  // warm-up that lets cuBLAS and the package set up that stream outside the capture), then
  // captures it there. step must read its inputs from tensors that outlive the graph: a replay
  // reads them where they are, as the caller refilled them.
  DecodeGraph(c10::Device device, const std::function<std::vector<at::Tensor>()>& step);
  ~DecodeGraph();
  DecodeGraph(const DecodeGraph&) = delete;
  DecodeGraph& operator=(const DecodeGraph&) = delete;

  // The outputs of the run before the capture.
  const std::vector<at::Tensor>& first() const;
  // Runs the captured step on the current stream; its outputs are overwritten by the next replay.
  const std::vector<at::Tensor>& replay();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace customops
