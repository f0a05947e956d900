// The fused decode step (kernels::decode_layer_cpu) against the four ops it fuses, run one after the
// other: few_rows_linear_cpu (qkv), kv_cache_write_cpu, decode_attention_cpu, few_rows_linear_cpu
// (proj). Output and caches bit for bit the same, in float64, float32, bfloat16 and half, with and
// without biases, on ragged caches with padded new tokens, at 1, 2 and 3 threads (each pass splits its
// weight rows and work items between the threads in its own way, and the bits must not move); the
// lengths advance by the real new tokens. Its errors name the
// argument and leave the cache and the lengths as they were.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <tuple>

#include <ATen/autocast_mode.h>
#include <c10/core/InferenceMode.h>

#include "causal_attention/attention.h"
#include "causal_attention/module.h"
#include "error_of.h"

namespace {

namespace kernels = causal_attention::kernels;

struct Case {
  int64_t B, t, H, hd, ctx;
};

std::optional<at::Tensor> maybe(const at::Tensor& t, bool with) { return with ? std::optional<at::Tensor>(t) : std::nullopt; }

// Restores the thread count when the test ends, however it ends.
class ThreadsGuard {
 public:
  ThreadsGuard() : threads_(at::get_num_threads()) {}
  ThreadsGuard(const ThreadsGuard&) = delete;
  ThreadsGuard& operator=(const ThreadsGuard&) = delete;
  ~ThreadsGuard() { at::set_num_threads(threads_); }

 private:
  int threads_;
};

class DecodeLayerTest : public ::testing::TestWithParam<std::tuple<Case, torch::ScalarType>> {};

TEST_P(DecodeLayerTest, EqualsTheOpsOneAfterTheOtherBitForBit) {
  const auto [c, dtype] = GetParam();
  const int64_t dim = c.H * c.hd, max_len = c.ctx + c.t;
  const ThreadsGuard threads;
  for (const bool with_bias : {true, false}) {
    for (const int n : {1, 2, 3}) {
      torch::manual_seed(7 + n + 10 * with_bias);
      at::set_num_threads(n);
      const auto opt = torch::TensorOptions().dtype(dtype);
      const auto x = torch::randn({c.B, c.t, dim}, opt);
      const auto wqkv = torch::randn({3 * dim, dim}, opt) / std::sqrt(static_cast<double>(dim));
      const auto bqkv = torch::randn({3 * dim}, opt);
      const auto wproj = torch::randn({dim, dim}, opt) / std::sqrt(static_cast<double>(dim));
      const auto bproj = torch::randn({dim}, opt);
      const auto k0 = torch::randn({c.B, c.H, max_len, c.hd}, opt);
      const auto v0 = torch::randn({c.B, c.H, max_len, c.hd}, opt);
      // Ragged caches (one may be empty) and, with a mask, some new tokens padding (right padding).
      const auto start = torch::randint(0, c.ctx + 1, {c.B}, torch::kLong);
      std::optional<at::Tensor> mask;
      if (n != 2) {
        const auto n_real = torch::randint(0, c.t + 1, {c.B, 1}, torch::kLong);
        mask = torch::arange(c.t, torch::kLong).unsqueeze(0) < n_real;
      }
      const auto end = causal_attention::cache_end(start, mask, c.t, max_len);

      auto k1 = k0.clone(), v1 = v0.clone();
      const auto qkv = kernels::few_rows_linear_cpu(x, wqkv, maybe(bqkv, with_bias));
      kernels::kv_cache_write_cpu(qkv, k1, v1, start, end, c.H);
      const auto heads = kernels::decode_attention_cpu(qkv, k1, v1, start, end, c.H);
      const auto expected = kernels::few_rows_linear_cpu(heads, wproj, maybe(bproj, with_bias));

      auto k2 = k0.clone(), v2 = v0.clone();
      auto lengths = start.clone();
      const auto out = kernels::decode_layer_cpu(x, wqkv, maybe(bqkv, with_bias), wproj, maybe(bproj, with_bias), k2,
                                                 v2, lengths, mask, c.H);
      std::ostringstream where_stream;
      where_stream << c10::toString(dtype) << " threads=" << n << " bias=" << with_bias;
      const std::string where = where_stream.str();
      EXPECT_TRUE(torch::equal(out, expected)) << where << " max diff "
                                               << (out.to(torch::kFloat64) - expected.to(torch::kFloat64)).abs().max();
      EXPECT_TRUE(torch::equal(k2, k1)) << where;
      EXPECT_TRUE(torch::equal(v2, v1)) << where;
      EXPECT_TRUE(torch::equal(lengths, end)) << where << ": the lengths advance by the real new tokens";
      EXPECT_FALSE(torch::equal(k2, k0) && (end > start).any().item<bool>()) << where << ": no key was written";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeLayerTest,
    ::testing::Combine(::testing::Values(Case{4, 1, 12, 64, 1025}, Case{1, 1, 8, 8, 1}, Case{3, 2, 2, 48, 113},
                                         Case{2, 4, 1, 80, 7}, Case{5, 1, 6, 8, 300}, Case{8, 1, 3, 64, 0},
                                         // more than 16 new tokens (the decode op's tiles); head_dim 5
                                         // (no whole vector: the scalar tails)
                                         Case{1, 20, 2, 16, 50}, Case{1, 1, 3, 5, 40}),
                       ::testing::Values(torch::kFloat64, torch::kFloat32, torch::kBFloat16, torch::kHalf)),
    [](const ::testing::TestParamInfo<std::tuple<Case, torch::ScalarType>>& info) {
      const Case c = std::get<0>(info.param);
      std::ostringstream name;
      name << "B" << c.B << "_t" << c.t << "_H" << c.H << "_hd" << c.hd << "_ctx" << c.ctx << "_"
           << c10::toString(std::get<1>(info.param));
      return name.str();
    });

TEST(DecodeLayer, BadInputsNameTheArgumentAndChangeNothing) {
  const int64_t B = 2, t = 1, H = 2, hd = 8, dim = H * hd, max_len = 6;
  const auto x = torch::randn({B, t, dim});
  const auto wqkv = torch::randn({3 * dim, dim}), bqkv = torch::randn({3 * dim});
  const auto wproj = torch::randn({dim, dim}), bproj = torch::randn({dim});
  auto k = torch::zeros({B, H, max_len, hd}), v = torch::zeros({B, H, max_len, hd});
  auto lengths = torch::full({B}, 2, torch::kLong);
  const auto call = [&](const at::Tensor& x_, const at::Tensor& wqkv_, const at::Tensor& bqkv_,
                        const at::Tensor& wproj_, const at::Tensor& bproj_, at::Tensor& k_, at::Tensor& lengths_,
                        const std::optional<at::Tensor>& mask = std::nullopt) {
    return error_of([&] { kernels::decode_layer_cpu(x_, wqkv_, bqkv_, wproj_, bproj_, k_, v, lengths_, mask, H); });
  };
  const auto expect_has = [](const std::string& msg, const std::string& part) {
    EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' not in: " << msg;
  };
  expect_has(call(x, wqkv.t(), bqkv, wproj, bproj, k, lengths), "qkv_weight must have shape [48, 16]");
  expect_has(call(x, wqkv, bqkv.narrow(0, 0, dim), wproj, bproj, k, lengths), "qkv_bias must have shape [48]");
  expect_has(call(x, wqkv, bqkv, wproj.narrow(0, 0, 8), bproj, k, lengths), "proj_weight must have shape [16, 16]");
  expect_has(call(x, wqkv, bqkv, wproj, bproj.to(torch::kFloat64), k, lengths), "proj_bias dtype (Double)");
  expect_has(call(x.squeeze(1), wqkv, bqkv, wproj, bproj, k, lengths), "x must be 3-D");
  expect_has(call(torch::randn({B, t, 15}), wqkv, bqkv, wproj, bproj, k, lengths), "multiple of n_heads");
  auto wrong_cache = torch::zeros({B, H, max_len, hd + 1});
  expect_has(call(x, wqkv, bqkv, wproj, bproj, wrong_cache, lengths), "k_cache must have shape");
  auto int_lengths = lengths.to(torch::kInt);
  expect_has(call(x, wqkv, bqkv, wproj, bproj, k, int_lengths), "cache lengths must be an int64 tensor");
  const auto left_padded = torch::tensor({{false, true}, {true, true}});
  const auto x2 = torch::randn({B, 2, dim});
  expect_has(call(x2, wqkv, bqkv, wproj, bproj, k, lengths, left_padded), "must be right padding");
  auto full = torch::full({B}, max_len, torch::kLong);
  expect_has(call(x, wqkv, bqkv, wproj, bproj, k, full), "KV cache overflow");
  EXPECT_TRUE(torch::equal(k, torch::zeros_like(k))) << "a refused step wrote the cache";
  EXPECT_TRUE(torch::equal(lengths, torch::full({B}, 2, torch::kLong))) << "a refused step moved the lengths";
  EXPECT_TRUE(torch::equal(full, torch::full({B}, max_len, torch::kLong)));
  auto expanded = torch::full({1}, 2, torch::kLong).expand({B});
  expect_has(call(x, wqkv, bqkv, wproj, bproj, k, expanded), "lengths is written in place and must not be an expanded");
  EXPECT_TRUE(torch::equal(k, torch::zeros_like(k))) << "a refused step wrote the cache";
}

TEST(DecodeLayer, TheModuleFusesAFewRowsWithoutAutogradOnly) {
  causal_attention::CausalSelfAttention attn(32, 4);
  const auto x = torch::randn({2, 4, 32});
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(attn->decode_layer_applies(x));  // 8 rows
    EXPECT_FALSE(attn->decode_layer_applies(torch::randn({3, 3, 32})));  // 9 rows: BLAS
    EXPECT_FALSE(attn->decode_layer_applies(x.to(torch::kFloat64)));  // weights in another dtype
    at::autocast::set_autocast_enabled(at::kCPU, true);
    const bool under_autocast = attn->decode_layer_applies(x);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    EXPECT_FALSE(under_autocast);
  }
  EXPECT_FALSE(attn->decode_layer_applies(x));  // grad mode
  causal_attention::CausalSelfAttention no_bias(causal_attention::CausalSelfAttentionOptions(32, 4).bias(false));
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(no_bias->decode_layer_applies(x));
}

TEST(DecodeLayer, AnInferenceModeCacheIsSteppedInInferenceModeOnly) {
  causal_attention::CausalSelfAttention attn(16, 2);
  const auto x = torch::randn({2, 1, 16});
  auto cache = [&] {
    c10::InferenceMode inference;
    return attn->make_cache(2, 4);
  }();
  {
    torch::NoGradGuard no_grad;
    const auto msg = error_of([&] { attn->forward(x, std::nullopt, cache); });
    EXPECT_NE(msg.find("the KV cache was made under c10::InferenceMode"), std::string::npos) << msg;
  }
  EXPECT_EQ(cache.lengths.sum().item<int64_t>(), 0);
  EXPECT_EQ(cache.k.abs().sum().item<float>(), 0.0f);
  c10::InferenceMode inference;
  attn->forward(x, std::nullopt, cache);
  EXPECT_EQ(cache.lengths.sum().item<int64_t>(), 2);
}

TEST(DecodeLayer, TheModulesCachedStepIsTheFusedOp) {
  // A decode step of the module (a few rows, no autograd) gives the fused op's bits: it runs it.
  torch::manual_seed(3);
  causal_attention::CausalSelfAttention attn(32, 4);
  torch::NoGradGuard no_grad;
  auto cache = attn->make_cache(3, 20);
  attn->forward(torch::randn({3, 9, 32}), std::nullopt, cache);  // prefill: 27 rows, not fused
  const auto x = torch::randn({3, 1, 32});
  auto k = cache.k.clone(), v = cache.v.clone();
  auto lengths = cache.lengths.clone();
  const auto expected = kernels::decode_layer_cpu(x, attn->qkv->weight, attn->qkv->bias, attn->proj->weight,
                                                  attn->proj->bias, k, v, lengths, std::nullopt, 4);
  const auto out = attn->forward(x, std::nullopt, cache);
  EXPECT_TRUE(torch::equal(out, expected));
  EXPECT_TRUE(torch::equal(cache.k, k));
  EXPECT_TRUE(torch::equal(cache.lengths, lengths));
  EXPECT_EQ(cache.lengths.sum().item<int64_t>(), 30);
}

}  // namespace
