// GoogleTest suite: the ops through the public C++ header, on CPU and (when built and present)
// CUDA; backward from C++; Meta shape inference; errors; and every op's kernel registrations.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <customops/customops.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace {

std::vector<c10::Device> devices() {
  std::vector<c10::Device> d{c10::kCPU};
  if (customops::has_cuda() && at::hasCUDA()) d.emplace_back(c10::kCUDA, 0);
  return d;
}

// Every operator name the dispatcher holds in the customops namespace: the library's whole API,
// read from the library itself, so a new op is checked without being listed here.
std::vector<c10::OperatorName> library_ops() {
  std::vector<c10::OperatorName> ops;
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.getNamespace() == std::string_view("customops")) ops.push_back(name);
  }
  return ops;
}

TEST(Registration, EveryOpHasEveryKernel) {
  const std::vector<c10::OperatorName> ops = library_ops();
  // A list read wrong (another namespace, the library not loaded) must fail, not check nothing.
  ASSERT_FALSE(ops.empty());
  std::set<std::string> names;
  for (const auto& name : ops) names.insert(c10::toString(name));
  for (const char* known : {"customops::muladd", "customops::muladd.out", "customops::rms_norm", "customops::attention",
                            "customops::_attention_backward", "customops::merge_attention"}) {
    EXPECT_EQ(names.count(known), 1u) << known << " is not among the dispatcher's customops ops";
  }
  for (const auto& name : ops) {
    auto op = c10::Dispatcher::singleton().findSchema(name);
    // A kernel registered under a name that has no schema (a misspelt m.impl) shows up here.
    ASSERT_TRUE(op.has_value()) << name << " has kernels but no schema";
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
      // A composite of other ops: every key takes it apart, so it has no kernel of its own there.
      for (auto key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::Meta,
                       c10::DispatchKey::Autograd}) {
        EXPECT_FALSE(op->hasKernelForDispatchKey(key)) << name << " is CompositeImplicitAutograd but has a " << key
                                                       << " kernel";
      }
      continue;
    }
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

TEST(LlmOps, ForwardMatchesAtenOnEveryDevice) {
  for (auto device : devices()) {
    auto opts = at::TensorOptions().device(device).dtype(at::kFloat);
    at::Tensor x = at::randn({6, 40}, opts), w = at::rand({40}, opts) + 0.5;
    at::Tensor ref = x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * w;
    EXPECT_TRUE(at::allclose(customops::rms_norm(x, w), ref, 1e-5, 1e-5)) << device;
    auto [y, rstd] = customops::rms_norm_with_rstd(x, std::nullopt);
    EXPECT_EQ(rstd.sizes(), at::IntArrayRef({6}));
    EXPECT_TRUE(at::allclose(customops::silu(x), at::silu(x), 1e-5, 1e-5));
    // gate and up as the two halves of one fused gate-up tensor (strided views)
    at::Tensor gu = at::randn({6, 80}, opts);
    auto halves = gu.chunk(2, -1);
    EXPECT_TRUE(at::allclose(customops::silu_mul(halves[0], halves[1]), at::silu(halves[0]) * halves[1], 1e-5, 1e-5));
    EXPECT_TRUE(at::allclose(customops::swiglu(gu), at::silu(halves[0]) * halves[1], 1e-5, 1e-5));
    EXPECT_TRUE(at::allclose(customops::scale_clamp(x, 2.0, -1.0, 1.0), at::clamp(x * 2.0, -1.0, 1.0)));
  }
}

// fused_linear from C++: each prologue against the ops it fuses, with one row (CUDA's
// matrix-vector kernel) and with many (the unfused path).
TEST(LlmOps, FusedLinearMatchesTheOpsItFuses) {
  for (auto device : devices()) {
    auto opts = at::TensorOptions().device(device).dtype(at::kFloat);
    for (int64_t rows : {1, 12}) {
      at::Tensor x = at::randn({rows, 64}, opts), w = at::randn({24, 64}, opts) / 8, b = at::randn({24}, opts);
      at::Tensor res = at::randn({rows, 24}, opts), nw = at::rand({64}, opts) + 0.5;
      EXPECT_TRUE(at::allclose(customops::fused_linear(x, w, b, res), at::linear(x, w, b) + res, 1e-4, 1e-4)) << device;
      EXPECT_TRUE(at::allclose(customops::fused_linear(x, w, std::nullopt, std::nullopt, "rms_norm", nw, 1e-5),
                               at::linear(customops::rms_norm(x, nw, 1e-5), w), 1e-4, 1e-4))
          << device;
      at::Tensor w_down = at::randn({24, 32}, opts) / 6;
      EXPECT_TRUE(at::allclose(customops::fused_linear(x, w_down, std::nullopt, res, "swiglu", std::nullopt, 1e-6,
                                                       /*constant_weight=*/true),
                               at::linear(customops::swiglu(x), w_down) + res, 1e-4, 1e-4))
          << device;
    }
  }
}

TEST(LlmOps, AttentionFromCppMergesSplitKeys) {
  for (auto device : devices()) {
    auto opts = at::TensorOptions().device(device).dtype(at::kDouble);
    at::Tensor q = at::randn({2, 4, 5, 8}, opts), k = at::randn({2, 2, 9, 8}, opts), v = at::randn({2, 2, 9, 8}, opts);
    auto [out, lse] = customops::attention(q, k, v);
    at::Tensor kk = k.repeat_interleave(2, 1), vv = v.repeat_interleave(2, 1);
    at::Tensor ref = at::softmax(at::matmul(q, kk.transpose(-2, -1)) / std::sqrt(8.0), -1).matmul(vv);
    // float64 through MKL now and then differs from the reference by up to about 2e-9 (seen on the
    // GPU machine's 16 cores, and here about 1 run in 80, 5 in 80 with MKL_CBWR=COMPATIBLE, never
    // with one MKL or OpenMP thread): 1e-8 holds it, and a wrong merge is off by far more. The
    // largest difference goes into the message.
    auto diff = [](const at::Tensor& x, const at::Tensor& y) { return (x - y).abs().max().item<double>(); };
    EXPECT_TRUE(at::allclose(out, ref, 1e-8, 1e-8)) << device << " out vs reference: " << diff(out, ref);
    auto a = customops::attention(q, k.narrow(2, 0, 4), v.narrow(2, 0, 4));
    auto b = customops::attention(q, k.narrow(2, 4, 5), v.narrow(2, 4, 5));
    auto [m_out, m_lse] = customops::merge_attention(std::get<0>(a), std::get<1>(a), std::get<0>(b), std::get<1>(b));
    EXPECT_TRUE(at::allclose(m_out, out, 1e-8, 1e-8)) << device << " merged out: " << diff(m_out, out);
    EXPECT_TRUE(at::allclose(m_lse, lse, 1e-8, 1e-8)) << device << " merged lse: " << diff(m_lse, lse);
  }
}

// rope_cache_write from C++: the rotated q of rope, the caches as cache_write of rope's k leaves
// them (a decode step's layout: q, k, v views of one fused qkv projection; bf16 on CUDA takes the
// one-kernel path).
TEST(LlmOps, RopeCacheWriteIsRopeThenCacheWrite) {
  for (auto device : devices()) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      auto opts = at::TensorOptions().device(device).dtype(dtype);
      at::Tensor qkv = at::randn({2, 1, 8, 64}, opts);  // [B, T, Hq + 2 Hkv, D]: Hq 4, Hkv 2
      at::Tensor q = qkv.narrow(2, 0, 4).transpose(1, 2), k = qkv.narrow(2, 4, 2).transpose(1, 2),
                 v = qkv.narrow(2, 6, 2).transpose(1, 2);
      at::Tensor angle = at::rand({2, 1, 32}, opts.dtype(at::kFloat)) * 6.0;
      angle = at::cat({angle, angle}, -1);
      at::Tensor cos = angle.cos().to(dtype), sin = angle.sin().to(dtype);
      at::Tensor start = at::tensor({3, 0}, opts.dtype(at::kLong));
      at::Tensor kc = at::randn({2, 2, 8, 64}, opts), vc = at::randn({2, 2, 8, 64}, opts);
      at::Tensor kc_ref = kc.clone(), vc_ref = vc.clone();
      at::Tensor q_out = customops::rope_cache_write(kc, vc, q, k, v, cos, sin, start);
      auto [q_ref, k_ref] = customops::rope(q, k, cos, sin);
      customops::cache_write(kc_ref, vc_ref, k_ref, v, start);
      // the same float32 rotation, rounded once (a contraction into a different fma may differ by an ulp)
      const double tol = dtype == at::kFloat ? 1e-6 : 1e-2;
      EXPECT_TRUE(at::allclose(q_out, q_ref, tol, tol)) << device << " " << dtype;
      EXPECT_TRUE(at::allclose(kc, kc_ref, tol, tol)) << device << " " << dtype;
      EXPECT_TRUE(at::equal(vc, vc_ref)) << device << " " << dtype;
    }
  }
}

TEST(LlmOps, CrossEntropyFromCpp) {
  for (auto device : devices()) {
    auto opts = at::TensorOptions().device(device).dtype(at::kDouble);
    at::Tensor h = at::randn({6, 4}, opts), w = at::randn({9, 4}, opts);
    at::Tensor t = at::randint(0, 9, {6}, opts.dtype(at::kLong));
    at::Tensor logits = at::mm(h, w.t());
    auto [loss, lse] = customops::cross_entropy(logits, t);
    EXPECT_TRUE(at::allclose(lse, at::logsumexp(logits, -1), 1e-10, 1e-10)) << device;
    EXPECT_TRUE(at::allclose(loss, lse - logits.gather(1, t.unsqueeze(1)).squeeze(1), 1e-10, 1e-10)) << device;
    // Default tiles, and tiles of 4 rows x 2 classes (two chunks of rows, five pieces of the vocabulary).
    EXPECT_TRUE(at::allclose(customops::linear_cross_entropy(h, w, t), loss.mean(), 1e-10, 1e-10)) << device;
    EXPECT_TRUE(at::allclose(customops::linear_cross_entropy(h, w, t, std::nullopt, -100, 0.0, "sum", 4, 2), loss.sum(),
                             1e-10, 1e-10))
        << device;
  }
}

TEST(LlmOps, RmsNormBackwardFromCpp) {
  for (auto device : devices()) {
    auto opts = at::TensorOptions().device(device).dtype(at::kDouble);
    at::Tensor x = at::randn({5, 16}, opts).requires_grad_(true);
    at::Tensor w = (at::rand({16}, opts) + 0.5).requires_grad_(true);
    auto grads = torch::autograd::grad({customops::rms_norm(x, w).pow(2).sum()}, {x, w});
    at::Tensor x2 = x.detach().clone().requires_grad_(true), w2 = w.detach().clone().requires_grad_(true);
    at::Tensor ref = x2 * at::rsqrt(x2.pow(2).mean(-1, true) + 1e-6) * w2;
    auto want = torch::autograd::grad({ref.pow(2).sum()}, {x2, w2});
    EXPECT_TRUE(at::allclose(grads[0], want[0], 1e-8, 1e-8)) << device;
    EXPECT_TRUE(at::allclose(grads[1], want[1], 1e-8, 1e-8)) << device;
  }
}

TEST(LlmOps, BadInputsRaiseNamedErrors) {
  at::Tensor x = at::randn({4, 8});
  try {
    customops::rms_norm(x, at::ones({7}));
    ADD_FAILURE() << "no error for a weight of the wrong size";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("customops::rms_norm: expected weight of shape [8]"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(customops::scale_clamp(x, 1.0, 2.0, -2.0), c10::Error);
  EXPECT_THROW(customops::silu(x.to(at::kInt)), c10::Error);
  EXPECT_THROW(customops::swiglu(at::randn({4, 7})), c10::Error);
  EXPECT_THROW(customops::fused_linear(x, at::randn({4, 8}), std::nullopt, std::nullopt, "gelu"), c10::Error);
}

}  // namespace
