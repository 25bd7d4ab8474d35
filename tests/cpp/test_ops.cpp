// GoogleTest suite: the ops through the public C++ header, on CPU and (when built and present)
// CUDA; backward from C++; Meta shape inference; errors; and every op's kernel registrations.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <customops/customops.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <string>
#include <vector>

namespace {

std::vector<c10::Device> devices() {
  std::vector<c10::Device> d{c10::kCPU};
  if (customops::has_cuda() && at::hasCUDA()) d.emplace_back(c10::kCUDA, 0);
  return d;
}

// Every (operator, overload) of the library; registration checks loop over it.
const std::vector<std::pair<std::string, std::string>> kOps = {
    {"customops::muladd", ""},
    {"customops::muladd", "out"},
    {"customops::mul", ""},
};

TEST(Registration, EveryOpHasEveryKernel) {
  for (const auto& [name, overload] : kOps) {
    auto op = c10::Dispatcher::singleton().findSchema({name, overload});
    ASSERT_TRUE(op.has_value()) << name << "." << overload;
    EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) << name;
    EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::Meta)) << name;
    EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::Autograd)) << name;
    if (customops::has_cuda()) {
      EXPECT_TRUE(op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) << name;
    }
  }
}

TEST(MulAdd, MatchesReferenceOnEveryDeviceAndDtype) {
  for (auto device : devices()) {
    for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
      auto opts = at::TensorOptions().device(device).dtype(dtype);
      at::Tensor a = at::randn({33, 17}, opts), b = at::randn({33, 17}, opts);
      at::Tensor ref = (a.to(at::kDouble) * b.to(at::kDouble) + 0.5).to(dtype);
      double tol = (dtype == at::kFloat || dtype == at::kDouble) ? 1e-5 : 1e-2;
      EXPECT_TRUE(at::allclose(customops::muladd(a, b, 0.5), ref, tol, tol)) << device << " " << dtype;
      EXPECT_TRUE(at::allclose(customops::mul(a, b), (a.to(at::kDouble) * b.to(at::kDouble)).to(dtype), tol, tol));
      at::Tensor out = at::empty_like(a);
      customops::muladd_out(a, b, 0.5, out);
      EXPECT_TRUE(at::allclose(out, ref, tol, tol));
      // Non-contiguous inputs: transposed views.
      EXPECT_TRUE(at::allclose(customops::muladd(a.t(), b.t(), 0.5), ref.t(), tol, tol));
    }
  }
}

TEST(MulAdd, BackwardFromCpp) {
  for (auto device : devices()) {
    auto opts = at::TensorOptions().device(device).dtype(at::kDouble);
    at::Tensor a = at::randn({8, 3}, opts).requires_grad_(true), b = at::randn({8, 3}, opts).requires_grad_(true);
    at::Tensor y = customops::muladd(a, b, 1.0).sum();
    auto grads = torch::autograd::grad({y}, {a, b});
    EXPECT_TRUE(at::allclose(grads[0], b.detach()));
    EXPECT_TRUE(at::allclose(grads[1], a.detach()));
  }
}

TEST(MulAdd, MetaShapeInference) {
  auto opts = at::TensorOptions().device(c10::kMeta).dtype(at::kHalf);
  at::Tensor a = at::empty({7, 0, 3}, opts), b = at::empty({7, 0, 3}, opts);
  at::Tensor y = customops::muladd(a, b, 1.0);
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.sizes(), a.sizes());
  EXPECT_EQ(y.scalar_type(), at::kHalf);
}

TEST(MulAdd, BadInputsRaiseNamedErrors) {
  at::Tensor a = at::randn({4, 4});
  auto expect_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected an error containing: " << needle;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { customops::muladd(a, at::randn({4, 5}), 1.0); }, "customops::muladd: expected b to have the shape");
  expect_error([&] { customops::muladd(a, a.to(at::kDouble), 1.0); }, "customops::muladd: expected b to have the dtype");
  expect_error([&] { customops::mul(a.to(at::kLong), a.to(at::kLong)); }, "customops::mul: a has dtype Long");
  at::Tensor buf = at::randn({20});
  at::Tensor x = buf.narrow(0, 0, 16).view({4, 4}), out = buf.narrow(0, 2, 16).view({4, 4});
  expect_error([&] { customops::muladd_out(x, x, 1.0, out); }, "customops::muladd.out: out overlaps a partially");
}

}  // namespace
