// The fused CPU kernel against the ATen composition (float64), with and without masks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "causal_attention/attention.h"

namespace {

namespace kernels = causal_attention::kernels;

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

struct Case {
  int64_t B, T, H, hd;
  int mask_kind;  // 0: none, 1: right padding, 2: holes and a sequence with no real key
};

std::optional<torch::Tensor> make_mask(const Case& c) {
  if (c.mask_kind == 0) {
    return std::nullopt;
  }
  auto mask = torch::arange(c.T).unsqueeze(0) < torch::randint(1, c.T + 1, {c.B, 1});
  if (c.mask_kind == 2) {
    mask = torch::ones({c.B, c.T}, torch::kBool);
    mask.narrow(1, std::min<int64_t>(c.T, 3), std::max<int64_t>(0, std::min<int64_t>(c.T - 3, 200))).fill_(false);
    mask[0].fill_(false);
  }
  return mask;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const char* masks[] = {"causal", "right", "holes"};
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_H" + std::to_string(c.H) + "_hd" +
         std::to_string(c.hd) + "_" + masks[c.mask_kind];
}

class KernelTest : public ::testing::TestWithParam<Case> {};

TEST_P(KernelTest, ForwardAndBackwardMatchComposition) {
  const Case c = GetParam();
  torch::manual_seed(42 + c.T);
  const auto mask = make_mask(c);
  const auto qkv = torch::randn({c.B, c.T, 3 * c.H * c.hd}, torch::kFloat64);
  const auto [out, lse] = kernels::attention_forward_cpu(qkv, mask, c.H);
  ASSERT_EQ(lse.sizes(), torch::IntArrayRef({c.B, c.H, c.T}));

  const auto qkv_ref = qkv.clone().requires_grad_(true);
  const auto out_ref = kernels::attention_composite(qkv_ref, mask, c.H);
  EXPECT_LE(max_abs_diff(out, out_ref), 1e-12);

  const auto grad_out = torch::randn_like(out);
  const auto grad = kernels::attention_backward_cpu(grad_out, qkv, mask, out, lse, c.H);
  out_ref.backward(grad_out);
  EXPECT_LE(max_abs_diff(grad, qkv_ref.grad()), 1e-11);
  EXPECT_FALSE(grad.isnan().any().item<bool>());
}

INSTANTIATE_TEST_SUITE_P(Shapes, KernelTest,
                         ::testing::Values(Case{1, 1, 1, 8, 0}, Case{2, 127, 2, 16, 1}, Case{2, 129, 3, 20, 2},
                                           Case{1, 257, 2, 64, 1}, Case{2, 300, 1, 80, 2}, Case{3, 64, 4, 4, 0}),
                         case_name);

TEST(Kernel, BFloat16MatchesFloat64OnTheSameInputs) {
  torch::manual_seed(9);
  const int64_t B = 2, T = 300, H = 2, hd = 64;
  const auto qkv = (torch::randn({B, T, 3 * H * hd}) * 2).to(torch::kBFloat16);
  const auto mask = torch::arange(T).unsqueeze(0) < torch::tensor({{int64_t{300}}, {int64_t{170}}});
  const auto [out, lse] = kernels::attention_forward_cpu(qkv, mask, H);
  const auto qkv64 = qkv.to(torch::kFloat64).requires_grad_(true);
  const auto exact = kernels::attention_composite(qkv64, mask, H);
  const double scale = exact.abs().max().item<double>();
  EXPECT_LE(max_abs_diff(out.to(torch::kFloat64), exact) / scale, 2e-2);  // bfloat16 rounding of the output
  const auto grad_out = torch::randn_like(exact);
  const auto grad = kernels::attention_backward_cpu(grad_out.to(torch::kBFloat16), qkv, mask, out, lse, H);
  exact.backward(grad_out);
  EXPECT_LE(max_abs_diff(grad.to(torch::kFloat64), qkv64.grad()) / qkv64.grad().abs().max().item<double>(), 3e-2);
}

TEST(Kernel, DeterministicAcrossRuns) {
  torch::manual_seed(1);
  const auto qkv = torch::randn({2, 300, 3 * 4 * 32});
  const auto mask = torch::arange(300).unsqueeze(0) < torch::tensor({{int64_t{300}}, {int64_t{123}}});
  const auto [out1, lse1] = kernels::attention_forward_cpu(qkv, mask, 4);
  const auto [out2, lse2] = kernels::attention_forward_cpu(qkv, mask, 4);
  EXPECT_TRUE(torch::equal(out1, out2));
  const auto g = torch::randn_like(out1);
  EXPECT_TRUE(torch::equal(kernels::attention_backward_cpu(g, qkv, mask, out1, lse1, 4),
                           kernels::attention_backward_cpu(g, qkv, mask, out2, lse2, 4)));
}

TEST(Kernel, ChoosesTheInstructionSetATenChose) {
  // The tile routines follow ATen's own choice (cpuinfo capped by ATEN_CPU_CAPABILITY), so that the
  // two never disagree on what the CPU can run.
  const std::string aten = at::get_cpu_capability();
  const std::string expected = aten == "AVX512" ? "AVX512" : aten == "AVX2" ? "AVX2" : "DEFAULT";
  EXPECT_EQ(std::string(kernels::cpu_capability()), expected);
}

TEST(Kernel, SaysWhatRunsItsTileProducts) {
  // bfloat16 on AMX tiles or vdpbf16ps pairs where the AVX512 build runs and the CPU has AVX512-BF16;
  // else on the float32 micro-kernel of the ISA (AVX2, AVX512) or BLAS; float64 always on BLAS.
  const std::string isa = kernels::cpu_capability();
  const std::string micro = isa == "DEFAULT" ? "BLAS" : isa + " float32 micro-kernel";
  EXPECT_EQ(kernels::tile_products(at::kFloat), micro);
  EXPECT_EQ(kernels::tile_products(at::kHalf), micro);
  EXPECT_EQ(kernels::tile_products(at::kDouble), "BLAS");
  const std::string bf16 = kernels::tile_products(at::kBFloat16);
  if (isa == "AVX512" && __builtin_cpu_supports("avx512bf16")) {
    EXPECT_TRUE(bf16 == "AMX-BF16 tiles" || bf16 == "AVX512-BF16 pairs") << bf16;
    if (!__builtin_cpu_supports("amx-bf16")) {
      EXPECT_EQ(bf16, "AVX512-BF16 pairs");
    }
  } else {
    EXPECT_EQ(bf16, micro);
  }
  EXPECT_THROW(kernels::tile_products(at::kInt), c10::ValueError);
}

TEST(Kernel, HalfPrecisionProductsAccumulateInFloat32) {
  // q = k = 0, v = 300: every weight of row t is 1/(t+1) and the output is exactly 300. A P V tile
  // product summed in float16 overflowed (inf from query 218 on).
  for (const auto dtype : {torch::kHalf, torch::kBFloat16}) {
    const int64_t T = 512, H = 2, hd = 32;
    auto qkv = torch::zeros({1, T, 3 * H * hd}, dtype);
    qkv.narrow(2, 2 * H * hd, H * hd).fill_(300);
    const auto [out, lse] = kernels::attention_forward_cpu(qkv, std::nullopt, H);
    EXPECT_TRUE(torch::equal(out, torch::full_like(out, 300))) << dtype;
    const auto grad = kernels::attention_backward_cpu(torch::ones_like(out), qkv, std::nullopt, out, lse, H);
    EXPECT_TRUE(torch::isfinite(grad).all().item<bool>()) << dtype;
    // dV of key j = sum_{t >= j} 1 / (t + 1): at most H(512) ~ 6.8, exactly representable in float32.
    const auto qkv64 = qkv.to(torch::kFloat64).requires_grad_(true);
    kernels::attention_math(qkv64, std::nullopt, H).sum().backward();
    const double eps = dtype == torch::kHalf ? 9.77e-4 : 7.81e-3;  // the dtype's machine epsilon
    EXPECT_LE(max_abs_diff(grad.to(torch::kFloat64), qkv64.grad()), 2 * eps * 6.8);
  }
}

TEST(Kernel, DecodeIsBitwiseIndependentOfTheThreadCount) {
  torch::manual_seed(5);
  const int64_t B = 1, H = 2, hd = 64, L = 3000, t = 2;
  const auto qkv = torch::randn({B, t, 3 * H * hd});
  const auto k = torch::randn({B, H, L, hd});
  const auto v = torch::randn({B, H, L, hd});
  const auto start = torch::tensor({int64_t{2800}});
  const auto end = start + t;
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = kernels::decode_attention_cpu(qkv, k, v, start, end, H);
  at::set_num_threads(3);
  const auto three = kernels::decode_attention_cpu(qkv, k, v, start, end, H);
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(one, three));
}

TEST(Kernel, RejectsBadInputs) {
  const auto qkv = torch::randn({2, 5, 12});
  EXPECT_THROW(kernels::attention_forward_cpu(qkv, torch::ones({2, 4}, torch::kBool), 2), c10::ValueError);
  EXPECT_THROW(kernels::attention_forward_cpu(qkv, torch::ones({2, 5}, torch::kFloat), 2), c10::ValueError);
  EXPECT_THROW(kernels::attention_forward_cpu(torch::randn({2, 5, 10}), std::nullopt, 2), c10::ValueError);
  const auto [out, lse] = kernels::attention_forward_cpu(qkv, std::nullopt, 2);
  EXPECT_THROW(kernels::attention_backward_cpu(out.narrow(1, 0, 4), qkv, std::nullopt, out, lse, 2),
               c10::ValueError);
}

}  // namespace

namespace {

TEST(Kernel, FewRowsLinearMatchesLinear) {
  torch::manual_seed(11);
  for (const int64_t rows : {1, 3, 8, 13}) {
    for (const auto& [in, out] : {std::pair<int64_t, int64_t>{768, 2304}, {33, 65}, {7, 5}}) {
      const auto x = torch::randn({rows, in}, torch::kFloat64);
      const auto w = torch::randn({out, in}, torch::kFloat64);
      const auto b = torch::randn({out}, torch::kFloat64);
      EXPECT_LE(max_abs_diff(kernels::few_rows_linear_cpu(x, w, b), torch::nn::functional::linear(x, w, b)), 1e-12);
      EXPECT_LE(max_abs_diff(kernels::few_rows_linear_cpu(x, w, std::nullopt), torch::mm(x, w.t())), 1e-12);
      // float32: the operands rounded once, sums of `in` products in float32 (relative ~1e-6 here).
      const auto x32 = x.to(torch::kFloat32), w32 = w.to(torch::kFloat32), b32 = b.to(torch::kFloat32);
      const auto y32 = kernels::few_rows_linear_cpu(x32, w32, b32).to(torch::kFloat64);
      const auto ref32 = torch::nn::functional::linear(x32.to(torch::kFloat64), w32.to(torch::kFloat64),
                                                       b32.to(torch::kFloat64));
      EXPECT_LE(max_abs_diff(y32, ref32) / ref32.abs().max().item<double>(), 1e-5);
    }
  }
  // bfloat16 sums in float32: 4096 products 1 * 1 and one 1 * 0.5 (a bfloat16 sum stalls at 256).
  auto w = torch::ones({3, 4097}, torch::kBFloat16);
  w.select(1, 4096).fill_(0.5);
  EXPECT_TRUE(torch::equal(kernels::few_rows_linear_cpu(torch::ones({2, 4097}, torch::kBFloat16), w, std::nullopt),
                           torch::full({2, 3}, 4096.5, torch::kBFloat16)));
  EXPECT_THROW(kernels::few_rows_linear_cpu(torch::randn({2, 4}), torch::randn({3, 5}), std::nullopt), c10::ValueError);
}

}  // namespace

// Grouped-query attention (n_kv_heads): the forward equals multi-head attention on k and v repeated for
// every query head of a group, bit for bit; the backward's dQ equals it, and dK, dV of a key/value head
// are the sums over its query heads' (within float64 rounding).
TEST(KernelGqa, EqualsMultiHeadOnRepeatedKeysAndValues) {
  torch::manual_seed(7);
  const int64_t B = 2, T = 140, H = 6, Hkv = 2, hd = 16, group = H / Hkv;
  const auto qkv = torch::randn({B, T, (H + 2 * Hkv) * hd}, torch::kFloat64);
  const auto mask = torch::arange(T).unsqueeze(0) < torch::tensor({T, int64_t{90}}).unsqueeze(1);
  const auto parts = qkv.split({H * hd, Hkv * hd, Hkv * hd}, 2);
  const auto repeat = [&](const torch::Tensor& t) {
    return t.unflatten(2, {Hkv, hd}).repeat_interleave(group, 2).flatten(2);
  };
  const auto mha = torch::cat({parts[0], repeat(parts[1]), repeat(parts[2])}, 2);  // (B, T, 3 * H * hd)
  const auto [out, lse] = kernels::attention_forward_cpu(qkv, mask, H, 0.0, std::nullopt, Hkv);
  const auto [out_mha, lse_mha] = kernels::attention_forward_cpu(mha, mask, H);
  ASSERT_EQ(out.sizes(), torch::IntArrayRef({B, T, H * hd}));
  EXPECT_TRUE(torch::equal(out, out_mha));
  EXPECT_TRUE(torch::equal(lse, lse_mha));

  const auto grad_out = torch::randn_like(out);
  const auto grad = kernels::attention_backward_cpu(grad_out, qkv, mask, out, lse, H, 0.0, std::nullopt, Hkv);
  const auto grad_mha = kernels::attention_backward_cpu(grad_out, mha, mask, out_mha, lse_mha, H);
  ASSERT_EQ(grad.sizes(), qkv.sizes());
  const auto g = grad.split({H * hd, Hkv * hd, Hkv * hd}, 2);
  const auto gm = grad_mha.split({H * hd, H * hd, H * hd}, 2);
  const auto group_sum = [&](const torch::Tensor& t) { return t.unflatten(2, {Hkv, group, hd}).sum(3).flatten(2); };
  EXPECT_TRUE(torch::equal(g[0], gm[0]));
  EXPECT_LE(max_abs_diff(g[1], group_sum(gm[1])), 1e-12);
  EXPECT_LE(max_abs_diff(g[2], group_sum(gm[2])), 1e-12);
}

TEST(KernelGqa, BadHeadCountsAreNamed) {
  const auto qkv = torch::randn({1, 3, 8 * 16});
  EXPECT_THROW(
      {
        try {
          kernels::attention_forward_cpu(qkv, std::nullopt, 4, 0.0, std::nullopt, 3);
        } catch (const c10::ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("n_kv_heads must be positive and divide n_heads (4); got 3"),
                    std::string::npos);
          throw;
        }
      },
      c10::ValueError);
}

// The separate-heads entry (transformers' call) on views of one qkv buffer is the fused kernel bit for bit.
TEST(KernelHeads, ViewsOfOneBufferAreTheFusedKernel) {
  torch::manual_seed(11);
  const int64_t B = 2, T = 150, H = 4, Hkv = 2, hd = 16;
  const auto qkv = torch::randn({B, T, (H + 2 * Hkv) * hd}, torch::kFloat32);
  const auto mask = torch::rand({B, T}) < 0.7;
  const auto parts = qkv.split({H * hd, Hkv * hd, Hkv * hd}, 2);
  const auto heads = [&](const torch::Tensor& t) { return t.unflatten(2, {-1, hd}).transpose(1, 2); };
  const auto [out, lse] = kernels::attention_forward_cpu(qkv, mask, H, 0.0, std::nullopt, Hkv);
  const auto [out_h, lse_h] =
      kernels::attention_heads_forward_cpu(heads(parts[0]), heads(parts[1]), heads(parts[2]), mask);
  ASSERT_EQ(out_h.sizes(), torch::IntArrayRef({B, T, H, hd}));
  EXPECT_TRUE(torch::equal(out_h.flatten(2), out));
  EXPECT_TRUE(torch::equal(lse_h, lse));
  const auto grad_out = torch::randn_like(out);
  const auto grad = kernels::attention_backward_cpu(grad_out, qkv, mask, out, lse, H, 0.0, std::nullopt, Hkv);
  const auto [dq, dk, dv] = kernels::attention_heads_backward_cpu(grad_out.unflatten(2, {H, hd}), heads(parts[0]),
                                                                  heads(parts[1]), heads(parts[2]), mask, out_h, lse_h);
  const auto joined = torch::cat({dq.transpose(1, 2).flatten(2), dk.transpose(1, 2).flatten(2),
                                  dv.transpose(1, 2).flatten(2)}, 2);
  EXPECT_TRUE(torch::equal(joined, grad));
}

// A decode step against a longer past with a sliding window and softcap, held to the ATen math.
TEST(KernelHeads, QueriesEndingAPastWithWindowAndSoftcap) {
  torch::manual_seed(12);
  const int64_t B = 2, H = 4, Hkv = 1, Tq = 3, Tk = 40, hd = 8, window = 10;
  const double scale = 0.3, cap = 2.0;
  const auto q = torch::randn({B, H, Tq, hd}, torch::kFloat64);
  const auto k = torch::randn({B, Hkv, Tk, hd}, torch::kFloat64);
  const auto v = torch::randn({B, Hkv, Tk, hd}, torch::kFloat64);
  const auto mask = torch::rand({B, Tk}) < 0.8;
  const auto [out, lse] = kernels::attention_heads_forward_cpu(q, k, v, mask, scale, window, cap);
  auto scores = torch::matmul(q, k.expand({B, H, Tk, hd}).transpose(2, 3)) * scale;  // (B, H, Tq, Tk)
  scores = torch::tanh(scores / cap) * cap;
  const auto position = torch::arange(Tk - Tq, Tk).unsqueeze(1);
  const auto key = torch::arange(Tk).unsqueeze(0);
  const auto allowed = (key <= position).logical_and(position - key < window).unsqueeze(0).unsqueeze(0)
                           .logical_and(mask.unsqueeze(1).unsqueeze(1));
  auto weights = torch::softmax(scores.masked_fill(allowed.logical_not(), -INFINITY), -1);
  weights = torch::where(allowed.any(-1, true), weights, torch::zeros_like(weights));
  const auto expected = torch::matmul(weights, v.expand({B, H, Tk, hd})).transpose(1, 2);  // (B, Tq, H, hd)
  EXPECT_LE(max_abs_diff(out, expected), 1e-12);
}

// Attention sinks (gpt-oss): a logit per query head in every row's softmax, value 0. The tiled forward (a
// prefill) and the streaming route (one query against a past), their lse, and the sinks' gradient, held to
// the ATen math (the sink's logit concatenated to each row's scores) and its autograd.
TEST(KernelHeads, SinksJoinEachRowsSoftmax) {
  torch::manual_seed(13);
  const int64_t B = 2, H = 4, Hkv = 2, Tk = 70, hd = 16;
  const auto sinks = torch::tensor({-30.0, 0.5, -1.0, 40.0}, torch::kFloat64).requires_grad_();
  for (const int64_t Tq : {int64_t{1}, Tk}) {
    const auto q = torch::randn({B, H, Tq, hd}, torch::kFloat64);
    const auto k = torch::randn({B, Hkv, Tk, hd}, torch::kFloat64);
    const auto v = torch::randn({B, Hkv, Tk, hd}, torch::kFloat64);
    const auto mask = torch::rand({B, Tk}) < 0.8;
    const auto [out, lse] =
        kernels::attention_heads_forward_cpu(q, k, v, mask, std::nullopt, std::nullopt, std::nullopt, 0.0,
                                             std::nullopt, sinks.detach());
    const auto groups = [&](const torch::Tensor& t) { return t.repeat_interleave(H / Hkv, 1); };
    const auto scores = torch::matmul(q, groups(k).transpose(2, 3)) / std::sqrt(double(hd));  // (B, H, Tq, Tk)
    const auto position = torch::arange(Tk - Tq, Tk).unsqueeze(1);
    const auto allowed = (torch::arange(Tk).unsqueeze(0) <= position).unsqueeze(0).unsqueeze(0)
                             .logical_and(mask.unsqueeze(1).unsqueeze(1));
    const auto logits = torch::cat({scores.masked_fill(allowed.logical_not(), -INFINITY),
                                    sinks.view({1, H, 1, 1}).expand({B, H, Tq, 1})}, -1);
    const auto weights = torch::softmax(logits, -1).narrow(-1, 0, Tk);
    const auto expected = torch::matmul(weights, groups(v)).transpose(1, 2);  // (B, Tq, H, hd)
    EXPECT_LE(max_abs_diff(out, expected.detach()), 1e-12) << "Tq " << Tq;
    EXPECT_LE(max_abs_diff(lse, torch::logsumexp(logits, -1).detach()), 1e-12) << "Tq " << Tq;
    const auto grad_out = torch::randn_like(out);
    const auto expected_grad = torch::autograd::grad({expected}, {sinks}, {grad_out})[0];
    const auto grad = kernels::attention_sinks_backward(grad_out, out, lse, sinks.detach());
    EXPECT_LE(max_abs_diff(grad, expected_grad), 1e-12) << "Tq " << Tq;
    // A sink of -inf takes no weight: no sinks, bit for bit.
    const auto none = kernels::attention_heads_forward_cpu(q, k, v, mask);
    const auto minus_inf = kernels::attention_heads_forward_cpu(
        q, k, v, mask, std::nullopt, std::nullopt, std::nullopt, 0.0, std::nullopt, torch::full({H}, -INFINITY));
    EXPECT_TRUE(torch::equal(std::get<0>(none), std::get<0>(minus_inf)));
    EXPECT_TRUE(torch::equal(std::get<1>(none), std::get<1>(minus_inf)));
  }
  EXPECT_THROW(kernels::attention_heads_forward_cpu(torch::randn({1, 4, 3, 8}), torch::randn({1, 2, 5, 8}),
                                                    torch::randn({1, 2, 5, 8}), std::nullopt, std::nullopt,
                                                    std::nullopt, std::nullopt, 0.0, std::nullopt, torch::zeros({3})),
               c10::ValueError);
}

TEST(KernelHeads, BadArgumentsAreNamed) {
  const auto q = torch::randn({1, 4, 6, 8});
  const auto k = torch::randn({1, 2, 5, 8});
  EXPECT_THROW(
      {
        try {
          kernels::attention_heads_forward_cpu(q, k, k, std::nullopt);
        } catch (const c10::ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("q's length (6) must not exceed k's (5)"), std::string::npos);
          throw;
        }
      },
      c10::ValueError);
}
