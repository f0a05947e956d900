// The C++ module against torch::nn::MultiheadAttention, causality by autograd, padding, errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "causal_attention/attention.h"
#include "causal_attention/module.h"
#include "error_of.h"

namespace {

using causal_attention::CausalSelfAttention;

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// MultiheadAttention with the module's weights copied in; C++ MHA takes (T, B, E).
struct MhaTwin {
  torch::nn::MultiheadAttention mha{nullptr};

  explicit MhaTwin(CausalSelfAttention& attn) {
    mha = torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(attn->dim(), attn->n_heads()));
    mha->to(torch::kFloat64);
    torch::NoGradGuard no_grad;
    mha->in_proj_weight.copy_(attn->qkv->weight);
    mha->in_proj_bias.copy_(attn->qkv->bias);
    mha->out_proj->weight.copy_(attn->proj->weight);
    mha->out_proj->bias.copy_(attn->proj->bias);
  }

  // x (B, T, E), mask (B, T) True = real -> (B, T, E)
  torch::Tensor forward(const torch::Tensor& x, const std::optional<torch::Tensor>& mask) {
    const int64_t T = x.size(1);
    // The C++ MultiheadAttention adds attn_mask to the scores: -inf above the diagonal.
    const auto causal = torch::full({T, T}, -std::numeric_limits<double>::infinity(), torch::kFloat64).triu(1);
    const auto xt = x.transpose(0, 1);
    torch::Tensor kpm = mask.has_value() ? mask->logical_not() : torch::Tensor();
    auto [out, weights] = mha->forward(xt, xt, xt, kpm, /*need_weights=*/false, causal);
    return out.transpose(0, 1);
  }
};

struct Shape {
  int64_t B, T, H, hd;
};

class ParityTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ParityTest, MatchesMultiheadAttentionOutputsAndGradients) {
  const auto [B, T, H, hd] = GetParam();
  torch::manual_seed(1234 + B * 1000 + T * 10 + H);
  for (const bool padded : {false, true}) {
    CausalSelfAttention attn(H * hd, H);
    attn->to(torch::kFloat64);
    MhaTwin twin(attn);
    const auto x = torch::randn({B, T, H * hd}, torch::kFloat64);
    std::optional<torch::Tensor> mask;
    if (padded) {
      // Right padding: sequence b has length in [1, T].
      const auto lengths = torch::randint(1, T + 1, {B, 1});
      mask = torch::arange(T).unsqueeze(0) < lengths;
    }
    const auto x1 = x.clone().requires_grad_(true);
    const auto x2 = x.clone().requires_grad_(true);
    const auto y1 = attn->forward(x1, mask);
    const auto y2 = twin.forward(x2, mask);
    EXPECT_LE(max_abs_diff(y1, y2), 1e-10) << "padded=" << padded;
    const auto g = torch::randn_like(y1);
    (y1 * g).sum().backward();
    (y2 * g).sum().backward();
    EXPECT_LE(max_abs_diff(x1.grad(), x2.grad()), 1e-10);
    EXPECT_LE(max_abs_diff(attn->qkv->weight.grad(), twin.mha->in_proj_weight.grad()), 1e-10);
    EXPECT_LE(max_abs_diff(attn->qkv->bias.grad(), twin.mha->in_proj_bias.grad()), 1e-10);
    EXPECT_LE(max_abs_diff(attn->proj->weight.grad(), twin.mha->out_proj->weight.grad()), 1e-10);
    EXPECT_LE(max_abs_diff(attn->proj->bias.grad(), twin.mha->out_proj->bias.grad()), 1e-10);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ParityTest,
                         ::testing::Values(Shape{1, 1, 1, 8}, Shape{2, 7, 3, 16}, Shape{3, 64, 4, 48},
                                           Shape{2, 113, 2, 80}, Shape{4, 33, 12, 4}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           const Shape& s = info.param;
                           return "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_H" + std::to_string(s.H) +
                                  "_hd" + std::to_string(s.hd);
                         });

TEST(Causality, GradientOfOutputTIsExactlyZeroForLaterInputs) {
  torch::manual_seed(7);
  const int64_t B = 2, T = 9, H = 3, hd = 8;
  CausalSelfAttention attn(H * hd, H);
  attn->to(torch::kFloat64);
  for (const bool padded : {false, true}) {
    std::optional<torch::Tensor> mask;
    if (padded) {
      mask = torch::arange(T).unsqueeze(0) < torch::tensor({{T}, {int64_t{5}}});
    }
    for (int64_t t = 0; t < T; ++t) {
      const auto x = torch::randn({B, T, H * hd}, torch::kFloat64).requires_grad_(true);
      const auto y = attn->forward(x, mask);
      y.select(1, t).sum().backward();
      const auto g = x.grad();
      EXPECT_TRUE(g.slice(1, t + 1).eq(0).all().item<bool>()) << "t=" << t;
      EXPECT_GT(g.slice(1, 0, t + 1).abs().sum().item<double>(), 0.0) << "t=" << t;
    }
  }
}

TEST(Padding, RealOutputsDoNotDependOnPaddedInputs) {
  torch::manual_seed(11);
  const int64_t B = 3, T = 12, H = 2, hd = 8;
  CausalSelfAttention attn(H * hd, H);
  attn->to(torch::kFloat64);
  const auto lengths = torch::tensor({{12}, {5}, {1}});
  const auto mask = torch::arange(T).unsqueeze(0) < lengths;  // (B, T)
  const auto x = torch::randn({B, T, H * hd}, torch::kFloat64);
  const auto noise = torch::randn_like(x) * mask.logical_not().unsqueeze(-1);
  torch::NoGradGuard no_grad;
  const auto y1 = attn->forward(x, mask);
  const auto y2 = attn->forward(x + 100 * noise, mask);
  const auto real = mask.unsqueeze(-1).expand_as(y1);
  EXPECT_TRUE(torch::equal(y1.masked_select(real), y2.masked_select(real)));
  EXPECT_FALSE(torch::equal(y1, y2));  // the padded positions themselves did change
}

TEST(Padding, IntegerMaskMeansTheSameAsBool) {
  torch::manual_seed(3);
  CausalSelfAttention attn(16, 4);
  const auto x = torch::randn({2, 6, 16});
  const auto mask = torch::tensor({{1, 1, 1, 1, 0, 0}, {1, 1, 1, 1, 1, 1}});
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(attn->forward(x, mask), attn->forward(x, mask.to(torch::kBool))));
}

TEST(Padding, RowWithNoAllowedKeyGivesProjBiasAndZeroGradients) {
  torch::manual_seed(5);
  CausalSelfAttention attn(16, 2);
  attn->to(torch::kFloat64);
  const auto x = torch::randn({1, 5, 16}, torch::kFloat64).requires_grad_(true);
  const auto mask = torch::tensor({{false, false, true, true, false}});  // left padding
  const auto y = attn->forward(x, mask);
  EXPECT_FALSE(y.isnan().any().item<bool>());
  for (int64_t t = 0; t < 2; ++t) {
    EXPECT_TRUE(torch::allclose(y[0][t], attn->proj->bias, 0.0, 1e-15)) << "t=" << t;
  }
  y.sum().backward();
  EXPECT_FALSE(x.grad().isnan().any().item<bool>());
  EXPECT_FALSE(attn->qkv->weight.grad().isnan().any().item<bool>());
}

TEST(Errors, DimNotDivisibleByHeadsNamesBoth) {
  const auto msg = error_of([] { CausalSelfAttention(10, 3); });
  EXPECT_NE(msg.find("dim (got 10)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("n_heads (got 3)"), std::string::npos) << msg;
  EXPECT_THROW(CausalSelfAttention(10, 3), c10::ValueError);
}

TEST(Errors, BadInputsNameTheArgument) {
  CausalSelfAttention attn(16, 4);
  const auto x = torch::randn({2, 5, 16});
  EXPECT_THROW(attn->forward(torch::randn({5, 16})), c10::ValueError);
  EXPECT_NE(error_of([&] { attn->forward(torch::randn({5, 16})); }).find("x must be 3-D"), std::string::npos);
  EXPECT_NE(error_of([&] { attn->forward(torch::randn({2, 5, 8})); }).find("last dimension dim=16"),
            std::string::npos);
  EXPECT_THROW(attn->forward(x, torch::ones({2, 5})), c10::TypeError);  // float mask
  EXPECT_NE(error_of([&] { attn->forward(x, torch::ones({2, 5})); }).find("key_padding_mask must be bool"),
            std::string::npos);
  EXPECT_THROW(attn->forward(x, torch::ones({2, 4}, torch::kBool)), c10::ValueError);
  EXPECT_NE(error_of([&] { attn->forward(x, torch::ones({5, 2}, torch::kBool)); })
                .find("key_padding_mask must have shape (B, T) = (2, 5)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { attn->forward(x, torch::full({2, 5}, 2, torch::kLong)); }).find("only 0"),
            std::string::npos);
}

TEST(Errors, OpChecksQkv) {
  EXPECT_THROW(causal_attention::attention(torch::randn({2, 5, 10}), std::nullopt, 4), c10::ValueError);
  EXPECT_THROW(causal_attention::attention(torch::randn({5, 12}), std::nullopt, 4), c10::ValueError);
}

}  // namespace

namespace {

TEST(KVCache, PrefillThenDecodeEqualsFullForward) {
  torch::manual_seed(21);
  const int64_t B = 3, T = 20, H = 2, hd = 8;
  CausalSelfAttention attn(H * hd, H);
  attn->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({B, T, H * hd}, torch::kFloat64);
  const auto full = attn->forward(x);  // every sequence of length T
  const auto prompts = torch::tensor({int64_t{12}, int64_t{3}, int64_t{1}});
  const int64_t P = 12;
  auto cache = attn->make_cache(B, 2 * T);
  const auto mask = torch::arange(P).unsqueeze(0) < prompts.unsqueeze(1);
  const auto prefill = attn->forward(x.narrow(1, 0, P), mask, cache);
  EXPECT_TRUE(torch::equal(cache.lengths, prompts));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = prompts[b].item<int64_t>();
    EXPECT_LE(max_abs_diff(prefill[b].narrow(0, 0, p), full[b].narrow(0, 0, p)), 1e-10);
  }
  auto positions = prompts.clone();
  for (int step = 0; step < 7; ++step) {
    const auto idx = positions.clamp_max(T - 1);
    const auto step_x = x.index({torch::arange(B), idx}).unsqueeze(1);  // (B, 1, dim)
    const auto y = attn->forward(step_x, std::nullopt, cache).squeeze(1);
    const auto expected = full.index({torch::arange(B), idx});
    EXPECT_LE(max_abs_diff(y, expected), 1e-10) << "step " << step;
    positions += 1;
  }
  EXPECT_TRUE(torch::equal(cache.lengths, positions));
  cache.reset();
  EXPECT_EQ(cache.lengths.sum().item<int64_t>(), 0);
}

TEST(KVCache, ALongPromptIntoTheCacheIsTheUncachedForwardBitForBit) {
  // More than 16 new queries take the tiled forward over the cache: right-padded prompts, GQA, each dtype.
  torch::manual_seed(22);
  const int64_t B = 3, T = 113, H = 4, Hkv = 2, hd = 48;
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kHalf, torch::kFloat64}) {
    CausalSelfAttention attn(causal_attention::CausalSelfAttentionOptions(H * hd, H).n_kv_heads(Hkv));
    attn->to(dtype);
    torch::NoGradGuard no_grad;
    const auto x = torch::randn({B, T, H * hd}).to(dtype);
    const auto mask = torch::arange(T).unsqueeze(0) < torch::tensor({T, int64_t{40}, int64_t{1}}).unsqueeze(1);
    auto cache = attn->make_cache(B, T + 30);
    EXPECT_TRUE(torch::equal(attn->forward(x, mask, cache), attn->forward(x, mask))) << dtype;
    EXPECT_TRUE(torch::equal(cache.lengths, mask.sum(1)));
  }
}

TEST(KVCache, LargeCpuBuffersAreZeroedOnWholeHugePages) {
  // As Python's make_cache: of 2 MB or more, the keys and values start at a 2 MB boundary (the
  // memory advised to take huge pages, kernels::cache_zeros); smaller, torch's zeros. Both steps
  // write them as any tensor; a resize keeps the data (the storage's allocator is asked again).
  CausalSelfAttention attn(256, 4);
  auto cache = attn->make_cache(4, 2055);  // 8.4 MB each
  for (const auto* buffer : {&cache.k, &cache.v}) {
    EXPECT_EQ(buffer->sizes(), (std::vector<int64_t>{4, 4, 2055, 64}));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data_ptr()) % (uintptr_t{2} << 20), 0u);
    EXPECT_EQ(buffer->count_nonzero().item<int64_t>(), 0);
  }
  {
    torch::NoGradGuard no_grad;
    attn->forward(torch::randn({4, 3, 256}), std::nullopt, cache);
  }
  EXPECT_GT(cache.k.narrow(2, 0, 3).count_nonzero().item<int64_t>(), 0);
  EXPECT_EQ(cache.k.narrow(2, 3, 2052).count_nonzero().item<int64_t>(), 0);
  const auto before = cache.k.clone();
  cache.k.resize_({2 * before.numel()});
  EXPECT_TRUE(torch::equal(cache.k.narrow(0, 0, before.numel()).view(before.sizes()), before));
  const auto small = attn->make_cache(1, 2);
  EXPECT_EQ(small.k.count_nonzero().item<int64_t>(), 0);
  EXPECT_THROW(causal_attention::kernels::cache_zeros({2, -1}, torch::kFloat), c10::ValueError);
}

// The kernel's transparent huge page size (hpage_pmd_size), else 2 MB.
uintptr_t huge_page_bytes() {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
  uintptr_t bytes = 0;
  return file >> bytes && bytes > 0 ? bytes : uintptr_t{2} << 20;
}

// Whether the mapping of this process that holds address is advised to take huge pages (its
// VmFlags in /proc/self/smaps hold "hg").
bool advised_huge(uintptr_t address) {
  std::ifstream smaps("/proc/self/smaps");
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    std::istringstream words(line);
    std::string head;
    words >> head;
    if (const auto dash = head.find('-'); dash != std::string::npos && head.back() != ':') {
      const auto lo = std::stoull(head.substr(0, dash), nullptr, 16), hi = std::stoull(head.substr(dash + 1), nullptr, 16);
      inside = lo <= address && address < hi;
    } else if (inside && head == "VmFlags:") {
      for (std::string flag; words >> flag;) {
        if (flag == "hg") {
          return true;
        }
      }
      return false;
    }
  }
  return false;
}

TEST(KVCache, MakeCacheMovesTheWeightsOntoHugePagesInPlace) {
  // make_cache advises the whole huge pages inside the layer's weights, and only those, and moves
  // them in place (kernels::advise_huge_pages): the same address, the same values (whether the
  // kernel then moved them depends on its version and free memory, not on the code: what it reports
  // is whole pages inside the storage).
  namespace kernels = causal_attention::kernels;
  CausalSelfAttention attn(768, 12);  // qkv weight 6.75 MB in float32
  auto weight = attn->qkv->weight;
  const auto before = weight.detach().clone();
#if defined(__linux__)
  const uintptr_t huge = huge_page_bytes();
  const auto bytes = static_cast<uintptr_t>(weight.nbytes());
  // The weight on a fresh mapping of the test's own (advice outlives the memory it was given on),
  // 4 KB past a huge-page boundary.
  const size_t span = bytes + 2 * huge;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(raw, MAP_FAILED);
  const uintptr_t address = ((reinterpret_cast<uintptr_t>(raw) + huge - 1) & ~(huge - 1)) + 4096;
  {
    torch::NoGradGuard no_grad;
    weight.set_data(torch::from_blob(reinterpret_cast<void*>(address), weight.sizes(), torch::kFloat).copy_(before));
  }
  const uintptr_t begin = address - 4096 + huge;
  const uintptr_t whole = (address + bytes - begin) / huge * huge;
  ASSERT_GE(whole, huge);
  EXPECT_FALSE(advised_huge(begin));
  attn->make_cache(1, 4);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(attn->qkv->weight.data_ptr()), address);
  EXPECT_TRUE(torch::equal(attn->qkv->weight, before));
  EXPECT_TRUE(advised_huge(begin)) << "make_cache did not advise the weight's whole huge pages";
  EXPECT_FALSE(advised_huge(address));
  EXPECT_FALSE(advised_huge(begin + whole));
  const int64_t moved = kernels::advise_huge_pages(attn->qkv->weight);
  EXPECT_GE(moved, 0);
  EXPECT_EQ(static_cast<uintptr_t>(moved) % huge, 0u);
  EXPECT_LE(static_cast<uintptr_t>(moved), whole);
  weight.set_data(before);  // off the mapping before it goes
  munmap(raw, span);
#endif
  EXPECT_EQ(kernels::advise_huge_pages(torch::ones({16, 16})), 0);  // no whole page inside
  EXPECT_EQ(kernels::advise_huge_pages(torch::zeros({1 << 20, 4}).to_sparse()), 0);  // no storage
  EXPECT_THROW(kernels::advise_huge_pages(torch::empty({4}, torch::kMeta)), c10::ValueError);
}

TEST(KVCache, OverflowAndMisuseAreClearErrors) {
  CausalSelfAttention attn(16, 2);
  auto cache = attn->make_cache(2, 4);
  {
    torch::NoGradGuard no_grad;
    attn->forward(torch::randn({2, 3, 16}), std::nullopt, cache);
    const auto msg = error_of([&] { attn->forward(torch::randn({2, 2, 16}), std::nullopt, cache); });
    EXPECT_NE(msg.find("KV cache overflow"), std::string::npos) << msg;
    const auto left = torch::tensor({{false, true}, {true, true}});
    auto fresh = attn->make_cache(2, 4);
    EXPECT_NE(error_of([&] { attn->forward(torch::randn({2, 2, 16}), left, fresh); }).find("right padding"),
              std::string::npos);
  }
  auto fresh = attn->make_cache(2, 4);
  EXPECT_NE(error_of([&] { attn->forward(torch::randn({2, 1, 16}), std::nullopt, fresh); }).find("for inference"),
            std::string::npos);
}

TEST(KVCache, GuardCoversEveryParameterAndTheInput) {
  // BitFit-style: qkv.weight frozen, qkv.bias trainable. The guard used to look at qkv.weight only.
  CausalSelfAttention attn(16, 2);
  for (auto& p : attn->parameters()) {
    p.requires_grad_(false);
  }
  attn->qkv->bias.requires_grad_(true);
  auto cache = attn->make_cache(1, 4);
  const auto msg = error_of([&] { attn->forward(torch::randn({1, 1, 16}), std::nullopt, cache); });
  EXPECT_NE(msg.find("parameter qkv.bias requires grad"), std::string::npos) << msg;
  attn->qkv->bias.requires_grad_(false);
  const auto x = torch::randn({1, 1, 16}).requires_grad_(true);
  EXPECT_NE(error_of([&] { attn->forward(x, std::nullopt, cache); }).find("x requires grad"), std::string::npos);
  EXPECT_EQ(cache.lengths.item<int64_t>(), 0);
}

TEST(KVCache, CapacityIsJudgedPerSequenceByItsRealTokens) {
  torch::manual_seed(2);
  CausalSelfAttention attn(16, 2);
  auto cache = attn->make_cache(2, 4);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 4, 16});
  attn->forward(x, torch::tensor({{true, true, true, true}, {true, false, false, false}}), cache);
  const auto k0 = cache.k[0].clone();
  // Sequence 0 is full and gets no real token: it is left untouched; sequence 1 grows.
  attn->forward(x.narrow(1, 1, 1), torch::tensor({{false}, {true}}), cache);
  EXPECT_EQ(cache.lengths[0].item<int64_t>(), 4);
  EXPECT_EQ(cache.lengths[1].item<int64_t>(), 2);
  EXPECT_TRUE(torch::equal(cache.k[0], k0));
  const auto msg = error_of([&] { attn->forward(x.narrow(1, 0, 1), std::nullopt, cache); });
  EXPECT_NE(msg.find("sequence 0 holds 4 tokens and 1 more do not fit"), std::string::npos) << msg;
}

// Attention-weight dropout: the module in training equals the specification with the kernel's
// keep decisions (dropout_keep_mask of the seed the module draws from the default generator).
TEST(Dropout, TrainingMatchesReferenceWithTheSameKeepMask) {
  const int64_t B = 2, T = 37, H = 2, hd = 8;
  const double p = 0.3;
  torch::manual_seed(11);
  CausalSelfAttention attn(H * hd, H, p);
  attn->to(torch::kFloat64);
  EXPECT_DOUBLE_EQ(attn->dropout(), p);
  const auto x = torch::randn({B, T, H * hd}, torch::kFloat64);
  auto mask = torch::ones({B, T}, torch::kBool);
  mask.index_put_({1, torch::indexing::Slice(20, torch::indexing::None)}, false);
  for (const bool padded : {false, true}) {
    const std::optional<torch::Tensor> m = padded ? std::optional<torch::Tensor>(mask) : std::nullopt;
    const auto xa = x.clone().requires_grad_(true);
    torch::manual_seed(5);
    const auto out = attn->forward(xa, m);
    torch::manual_seed(5);
    const auto seed = causal_attention::draw_dropout_seed();  // the module's seed
    const auto keep = causal_attention::dropout_keep_mask(seed, B, H, T, p);
    const auto xb = x.clone().requires_grad_(true);
    const auto heads = causal_attention::kernels::attention_math(attn->qkv->forward(xb), m, H, p, keep);
    const auto ref = attn->proj->forward(heads);
    EXPECT_LT(max_abs_diff(out, ref), 1e-12);
    const auto g = torch::randn_like(out);
    out.backward(g);
    ref.backward(g);
    EXPECT_LT(max_abs_diff(xa.grad(), xb.grad()), 1e-12);
    // Dropout did something: the output differs from the module's eval output.
    attn->eval();
    EXPECT_GT(max_abs_diff(out, attn->forward(x, m)), 1e-3);
    attn->train();
  }
}

TEST(Dropout, EvalModeAndZeroProbabilityAreExact) {
  torch::manual_seed(12);
  CausalSelfAttention with(16, 2, 0.5);
  CausalSelfAttention without(16, 2);
  {
    torch::NoGradGuard no_grad;
    for (const auto& pair : with->named_parameters()) {
      without->named_parameters()[pair.key()].copy_(pair.value());
    }
  }
  const auto x = torch::randn({2, 19, 16});
  with->eval();
  EXPECT_TRUE(torch::equal(with->forward(x), without->forward(x)));
  const auto qkv = without->qkv->forward(x);
  EXPECT_TRUE(torch::equal(causal_attention::attention(qkv, std::nullopt, 2, 0.0),
                           causal_attention::attention(qkv, std::nullopt, 2)));
}

TEST(Dropout, ProbabilityOutsideZeroOneIsAValueErrorNamingDropout) {
  for (const double p : {-0.1, 1.0, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    const auto msg = error_of([&] { CausalSelfAttention(16, 2, p); });
    EXPECT_NE(msg.find("dropout must be a probability in [0, 1)"), std::string::npos) << msg;
    EXPECT_THROW(CausalSelfAttention(16, 2, p), c10::ValueError);
  }
  const auto qkv = torch::randn({1, 4, 48});
  EXPECT_THROW(causal_attention::attention(qkv, std::nullopt, 2, 1.0), c10::ValueError);
}

TEST(Dropout, ReproducibleUnderManualSeed) {
  torch::manual_seed(13);
  CausalSelfAttention attn(16, 2, 0.2);
  const auto x = torch::randn({2, 40, 16});
  torch::manual_seed(3);
  const auto a = attn->forward(x);
  torch::manual_seed(3);
  const auto b = attn->forward(x);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE(torch::equal(a, attn->forward(x)));  // a new seed, another mask
}

// bias(false): qkv and proj without biases (Python's bias=False); the same as zero biases.
TEST(Bias, WithoutBiasEqualsZeroBiasesAndHoldsWeightsOnly) {
  torch::manual_seed(21);
  causal_attention::CausalSelfAttention plain(causal_attention::CausalSelfAttentionOptions(24, 3).bias(false));
  EXPECT_FALSE(plain->bias());
  EXPECT_EQ(plain->named_parameters().keys(), (std::vector<std::string>{"qkv.weight", "proj.weight"}));
  CausalSelfAttention zeroed(24, 3);
  EXPECT_TRUE(zeroed->bias());
  {
    torch::NoGradGuard no_grad;
    zeroed->qkv->weight.copy_(plain->qkv->weight);
    zeroed->proj->weight.copy_(plain->proj->weight);
    zeroed->qkv->bias.zero_();
    zeroed->proj->bias.zero_();
  }
  const auto x = torch::randn({3, 11, 24});
  const auto mask = torch::arange(11).unsqueeze(0) < torch::tensor({11, 5, 1}).unsqueeze(1);
  EXPECT_TRUE(torch::equal(plain->forward(x, mask), zeroed->forward(x, mask)));

  torch::NoGradGuard no_grad;  // the cache path too
  auto cache_a = plain->make_cache(3, 16);
  auto cache_b = zeroed->make_cache(3, 16);
  EXPECT_TRUE(torch::equal(plain->forward(x, mask, cache_a), zeroed->forward(x, mask, cache_b)));
  const auto step = torch::randn({3, 1, 24});
  EXPECT_TRUE(torch::equal(plain->forward(step, std::nullopt, cache_a), zeroed->forward(step, std::nullopt, cache_b)));

  // The options carry dropout too, and are checked like the positional constructor.
  causal_attention::CausalSelfAttention dropped(causal_attention::CausalSelfAttentionOptions(24, 3).dropout(0.25));
  EXPECT_EQ(dropped->dropout(), 0.25);
  EXPECT_THROW(causal_attention::CausalSelfAttention(causal_attention::CausalSelfAttentionOptions(24, 5).bias(false)),
               c10::ValueError);
}

}  // namespace

namespace {
// The grouped-query layer written in ATen: q | k | v split, each key/value head repeated for its group.
torch::Tensor gqa_reference(CausalSelfAttention& attn, const torch::Tensor& x, const torch::Tensor& mask) {
  const int64_t H = attn->n_heads(), Hkv = attn->n_kv_heads(), hd = attn->head_dim();
  const int64_t B = x.size(0), T = x.size(1);
  const auto qkv = attn->qkv->forward(x);
  const auto parts = qkv.split({H * hd, Hkv * hd, Hkv * hd}, 2);
  const auto q = parts[0].unflatten(2, {H, hd}).transpose(1, 2);
  const auto k = parts[1].unflatten(2, {Hkv, hd}).transpose(1, 2).repeat_interleave(H / Hkv, 1);
  const auto v = parts[2].unflatten(2, {Hkv, hd}).transpose(1, 2).repeat_interleave(H / Hkv, 1);
  const auto allowed = torch::ones({T, T}, torch::kBool).tril().view({1, 1, T, T}).logical_and(mask.view({B, 1, 1, T}));
  const auto scores = torch::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(hd));
  auto weights = torch::softmax(scores.masked_fill(allowed.logical_not(), -INFINITY), -1);
  weights = torch::where(allowed.any(-1, true), weights, torch::zeros_like(weights));
  return attn->proj->forward(torch::matmul(weights, v).transpose(1, 2).reshape({B, T, H * hd}));
}
}  // namespace

// CausalSelfAttentionOptions(dim, n_heads).n_kv_heads(k): the grouped-query layer, as Python's.
TEST(GroupedQuery, ForwardBackwardAndCacheMatchTheReference) {
  torch::manual_seed(23);
  const int64_t B = 3, T = 17, H = 8, Hkv = 2, hd = 8;
  CausalSelfAttention attn(causal_attention::CausalSelfAttentionOptions(H * hd, H).n_kv_heads(Hkv));
  attn->to(torch::kFloat64);
  EXPECT_EQ(attn->qkv->weight.sizes(), torch::IntArrayRef({(H + 2 * Hkv) * hd, H * hd}));
  const auto x = torch::randn({B, T, H * hd}, torch::kFloat64).requires_grad_();
  const auto mask = torch::arange(T).unsqueeze(0) < torch::tensor({T, int64_t{11}, int64_t{4}}).unsqueeze(1);
  const auto y = attn->forward(x, mask);
  const auto ref = gqa_reference(attn, x, mask);
  EXPECT_LE(max_abs_diff(y.index({mask}), ref.index({mask})), 1e-12);
  const auto g = torch::randn_like(y);
  const auto grads = torch::autograd::grad({y}, {x, attn->qkv->weight}, {g});
  const auto ref_grads = torch::autograd::grad({ref}, {x, attn->qkv->weight}, {g});
  EXPECT_LE(max_abs_diff(grads[0], ref_grads[0]), 1e-12);
  EXPECT_LE(max_abs_diff(grads[1], ref_grads[1]), 1e-12);

  torch::NoGradGuard no_grad;
  auto cache = attn->make_cache(B, 2 * T);
  EXPECT_EQ(cache.k.sizes(), torch::IntArrayRef({B, Hkv, 2 * T, hd}));
  std::vector<torch::Tensor> steps{attn->forward(x.narrow(1, 0, 5), mask.narrow(1, 0, 5), cache)};
  for (int64_t t = 5; t < T; ++t) {
    steps.push_back(attn->forward(x.narrow(1, t, 1), mask.narrow(1, t, 1), cache));
  }
  EXPECT_LE(max_abs_diff(torch::cat(steps, 1).index({mask}), ref.index({mask})), 1e-12);
  EXPECT_TRUE(torch::equal(cache.lengths, mask.sum(1)));
}

TEST(GroupedQuery, HeadCountsThatDoNotDivideAreNamed) {
  EXPECT_THROW(
      {
        try {
          CausalSelfAttention attn(causal_attention::CausalSelfAttentionOptions(64, 8).n_kv_heads(3));
        } catch (const c10::ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("n_kv_heads must be positive and divide n_heads (got 8); got 3"),
                    std::string::npos);
          throw;
        }
      },
      c10::ValueError);
}

// The options' dtype and init: the parameters in dtype, drawn as in float32 and converted; with
// Init::kSkip nothing is drawn from the generator, the same parameters are there, uninitialised.
TEST(Parameters, DtypeAndSkippedInitialisation) {
  using causal_attention::CausalSelfAttentionOptions;
  using causal_attention::Init;
  const auto options = CausalSelfAttentionOptions(64, 8).n_kv_heads(2);
  torch::manual_seed(21);
  CausalSelfAttention plain(options);
  torch::manual_seed(21);
  CausalSelfAttention half(CausalSelfAttentionOptions(options).dtype(torch::kBFloat16));
  for (const auto& p : plain->named_parameters()) {
    const auto h = half->named_parameters()[p.key()];  // (a copy: the dict is a temporary)
    EXPECT_EQ(h.scalar_type(), torch::kBFloat16) << p.key();
    EXPECT_TRUE(torch::equal(h, p.value().to(torch::kBFloat16))) << p.key();
  }

  torch::manual_seed(22);
  CausalSelfAttention skipped(CausalSelfAttentionOptions(options).dtype(torch::kHalf).init(Init::kSkip));
  const auto drawn_after = torch::randn({8});
  torch::manual_seed(22);
  EXPECT_TRUE(torch::equal(drawn_after, torch::randn({8}))) << "Init::kSkip drew from the generator";
  ASSERT_EQ(skipped->named_parameters().size(), plain->named_parameters().size());
  for (const auto& p : plain->named_parameters()) {
    const auto s = skipped->named_parameters()[p.key()];
    EXPECT_EQ(s.scalar_type(), torch::kHalf) << p.key();
    EXPECT_EQ(s.sizes(), p.value().sizes()) << p.key();
    EXPECT_TRUE(s.requires_grad()) << p.key();
  }
  std::ostringstream printed_plain, printed_skipped;  // the Linears' options: in and out features
  printed_plain << *plain;
  printed_skipped << *skipped;
  EXPECT_EQ(printed_skipped.str(), printed_plain.str());
  // Filled, it is the layer.
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : plain->named_parameters()) skipped->named_parameters()[p.key()].copy_(p.value());
  }
  const auto x = torch::randn({2, 5, 64});
  EXPECT_TRUE(torch::allclose(skipped->forward(x.to(torch::kHalf)).to(torch::kFloat), plain->forward(x), 1e-2, 1e-2));

  const auto message = error_of([&] { CausalSelfAttention(CausalSelfAttentionOptions(options).dtype(torch::kLong)); });
  EXPECT_NE(message.find("dtype must be a floating-point type; got Long"), std::string::npos) << message;
}

// Weights of a huge page or more get memory of their own from a huge-page boundary.
TEST(Parameters, SkippedInitialisationPutsLargeWeightsOnHugePageMemory) {
  namespace kernels = causal_attention::kernels;
  const auto weight = kernels::huge_page_empty({1024, 1024}, torch::kFloat);  // 4 MB
  EXPECT_EQ(weight.sizes(), torch::IntArrayRef({1024, 1024}));
#if defined(__linux__)
  EXPECT_EQ(reinterpret_cast<uintptr_t>(weight.data_ptr()) % (uintptr_t{2} << 20), 0u);
#endif
  EXPECT_EQ(kernels::huge_page_empty({3, 5}, torch::kHalf).sizes(), torch::IntArrayRef({3, 5}));
  EXPECT_NE(error_of([] { kernels::huge_page_empty({2, -1}, torch::kFloat); }).find("huge_page_empty: size must be"),
            std::string::npos);
  CausalSelfAttention attn(
      causal_attention::CausalSelfAttentionOptions(1024, 8).init(causal_attention::Init::kSkip));  // qkv: 12 MB
#if defined(__linux__)
  EXPECT_EQ(reinterpret_cast<uintptr_t>(attn->qkv->weight.data_ptr()) % (uintptr_t{2} << 20), 0u);
#endif
}
