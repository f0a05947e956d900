// Google Benchmark: the fused CPU kernel alone against ATen's composition (SDPA), in one binary.
//
//   build/py/causal_attention_bench --benchmark_filter=Forward
//
// Arguments: T, padded (0: causal only; 1: lengths uniform in [T/2, T]). B = 4, H = 12, hd = 64,
// float32. Counters: causal GFLOP/s (forward 2*B*H*T^2*hd, backward 2.5x that).
//
// BM_TileProducts: one forward tile's two products on one thread, BLAS against the micro-kernel.
// BM_ForwardTile: one forward tile's products and softmax on one thread, float32 against bfloat16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <limits>
#include <optional>
#include <vector>

#include "attention/blas.h"
#include "cpu/tile_ops.h"
#include "causal_attention/attention.h"

namespace {

constexpr int64_t kB = 4, kH = 12, kHd = 64;

struct Inputs {
  at::Tensor qkv;
  std::optional<at::Tensor> mask;
};

Inputs make_inputs(int64_t T, bool padded) {
  at::manual_seed(0);
  Inputs in{at::randn({kB, T, 3 * kH * kHd}), std::nullopt};
  if (padded) {
    const auto lengths = at::randint(T / 2, T + 1, {kB, 1});
    in.mask = at::arange(T).unsqueeze(0) < lengths;
  }
  return in;
}

void set_flops(benchmark::State& state, int64_t T, double passes) {
  const double flops = 2.0 * kB * kH * T * T * kHd * passes;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_FusedForward(benchmark::State& state) {
  const auto in = make_inputs(state.range(0), state.range(1) != 0);
  for (auto _ : state) {
    benchmark::DoNotOptimize(causal_attention::kernels::attention_forward_cpu(in.qkv, in.mask, kH));
  }
  set_flops(state, state.range(0), 1.0);
}

void BM_FusedBackward(benchmark::State& state) {
  const auto in = make_inputs(state.range(0), state.range(1) != 0);
  const auto [out, lse] = causal_attention::kernels::attention_forward_cpu(in.qkv, in.mask, kH);
  const auto grad_out = at::randn_like(out);
  for (auto _ : state) {
    benchmark::DoNotOptimize(causal_attention::kernels::attention_backward_cpu(grad_out, in.qkv, in.mask, out, lse, kH));
  }
  set_flops(state, state.range(0), 2.5);
}

void BM_AtenSdpaForward(benchmark::State& state) {
  const auto in = make_inputs(state.range(0), state.range(1) != 0);
  for (auto _ : state) {
    benchmark::DoNotOptimize(causal_attention::kernels::attention_composite(in.qkv, in.mask, kH));
  }
  set_flops(state, state.range(0), 1.0);
}

// A forward tile's float32 operands from qkv's layout (kTileKeys rows of 3 * 768 floats): K^T and V packed
// in panels for tile_ops' panel_gemm, as the forward packs them once per call.
constexpr int64_t kTileRows = 128, kTileKeys = 256, kTileDim = 768, kTileLd = 3 * kTileDim;

struct FloatTilePanels {
  std::vector<float> k = std::vector<float>(kTileKeys * kHd), v = std::vector<float>(kTileKeys * kHd);
  explicit FloatTilePanels(const float* q) {
    const auto& ops = causal_attention::tile::tile_ops<float>();
    ops.pack_panels(q + kTileDim, 1, kTileLd, kHd, kTileKeys, k.data());
    ops.pack_panels(q + 2 * kTileDim, kTileLd, 1, kTileKeys, kHd, v.data());
  }
};

// S = Q K^T (kTileRows x kTileKeys x hd), then P V with P = S, on the float32 micro-kernel.
void float_tile_products(const float* q, const FloatTilePanels& panels, float* s, float* pv) {
  namespace tile = causal_attention::tile;
  const auto& ops = tile::tile_ops<float>();
  ops.panel_gemm(kTileRows, kTileKeys, kHd, tile::kScoreSumBlock, q, kTileLd, 1, panels.k.data(), tile::kPanel,
                 kHd * tile::kPanel, false, s, kTileKeys);
  ops.panel_gemm(kTileRows, kHd, kTileKeys, 0, s, kTileKeys, 1, panels.v.data(), tile::kPanel,
                 kTileKeys * tile::kPanel, false, pv, kHd);
}

// One forward tile's products from qkv's layout (rows 3 * 768 floats apart): S = Q K^T (128 x 256 x 64),
// then P V (128 x 64 x 256). Argument 0: BLAS (blas.h, MKL where found), reading K and V in place, as the
// kernel did before the micro-kernel; 1: tile_ops' panel_gemm over panels of K^T and V packed outside
// the loop, as the forward packs them once per call (skipped where the CPU has no micro-kernel).
void BM_TileProducts(benchmark::State& state) {
  const bool micro = state.range(0) != 0;
  if (micro && causal_attention::tile::tile_ops<float>().panel_gemm == nullptr) {
    state.SkipWithError("no micro-kernel on this CPU (AVX2 + FMA)");
    return;
  }
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  at::manual_seed(0);
  const auto qkv = at::randn({kTileKeys, kTileLd});
  const float* q = qkv.const_data_ptr<float>();
  const float* k = q + kTileDim;
  const float* v = q + 2 * kTileDim;
  std::vector<float> s(kTileRows * kTileKeys), pv(kTileRows * kHd);
  const std::optional<FloatTilePanels> panels = micro ? std::optional<FloatTilePanels>(q) : std::nullopt;
  for (auto _ : state) {
    if (micro) {
      float_tile_products(q, *panels, s.data(), pv.data());
    } else {
      causal_attention::blas::gemm(false, true, kTileRows, kTileKeys, kHd, 1.0f, q, kTileLd, k, kTileLd, 0.0f, s.data(),
                                   kTileKeys);
      causal_attention::blas::gemm(false, false, kTileRows, kHd, kTileKeys, 1.0f, s.data(), kTileKeys, v, kTileLd, 0.0f,
                                   pv.data(), kHd);
    }
    benchmark::DoNotOptimize(pv.data());
  }
  at::set_num_threads(threads);
  state.counters["GFLOP/s"] =
      benchmark::Counter(4.0 * kTileRows * kTileKeys * kHd * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_TileProducts)->Arg(0)->Arg(1)->ArgName("micro_kernel")->UseRealTime();

// The score product S = Q K^T of one forward tile (128 x 256 x 64) on the float32 micro-kernel, the head
// summed in one chain (argument 0) or in blocks of that many values (tile::kScoreSumBlock: what the
// kernels do), to show what the shorter chains cost.
void BM_ScoreProduct(benchmark::State& state) {
  namespace tile = causal_attention::tile;
  const auto& ops = tile::tile_ops<float>();
  if (ops.panel_gemm == nullptr) {
    state.SkipWithError("no micro-kernel on this CPU (AVX2 + FMA)");
    return;
  }
  const int64_t sum_block = state.range(0);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  at::manual_seed(0);
  const auto qkv = at::randn({kTileKeys, kTileLd});
  const float* q = qkv.const_data_ptr<float>();
  const FloatTilePanels panels(q);
  std::vector<float> s(kTileRows * kTileKeys);
  for (auto _ : state) {
    ops.panel_gemm(kTileRows, kTileKeys, kHd, sum_block, q, kTileLd, 1, panels.k.data(), tile::kPanel,
                   kHd * tile::kPanel, false, s.data(), kTileKeys);
    benchmark::DoNotOptimize(s.data());
  }
  at::set_num_threads(threads);
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * kTileRows * kTileKeys * kHd * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ScoreProduct)->Arg(0)->Arg(causal_attention::tile::kScoreSumBlock)->ArgName("sum_block")->UseRealTime();

// One forward tile (128 queries x 256 keys, head_dim 64) on one thread, part by part, in float32
// (panel_gemm) and bfloat16 (pair_gemm, where the CPU has AVX512-BF16): argument dtype (0 float32,
// 1 bfloat16), part (0: the two products S = Q K^T and P V over packed K and V; 1: the online softmax
// that turns S into P: softmax_tile in place for float32, softmax_tile_rounded into bfloat16 pairs).
// The products run twice as fast in bfloat16 (one zmm vdpbf16ps does 32 multiply-adds, one vfmadd
// 16); the softmax's float32 exponentials cost both dtypes the same. Their sum bounds how much
// faster a bfloat16 forward can be than a float32 one on the same CPU.
void BM_ForwardTile(benchmark::State& state) {
  namespace tile = causal_attention::tile;
  const bool bf16 = state.range(0) != 0;
  const bool softmax = state.range(1) != 0;
  const auto& fops = tile::tile_ops<float>();
  const auto& bops = tile::tile_ops<c10::BFloat16>();
  if (bf16 ? bops.pair_gemm == nullptr : fops.panel_gemm == nullptr) {
    state.SkipWithError(bf16 ? "no AVX512-BF16 pair micro-kernel on this CPU" : "no micro-kernel on this CPU");
    return;
  }
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  at::manual_seed(0);
  const auto qkv = at::randn({kTileKeys, kTileLd});
  const auto qkv16 = qkv.to(at::kBFloat16);
  const float* q = qkv.const_data_ptr<float>();
  const c10::BFloat16* q16 = qkv16.const_data_ptr<c10::BFloat16>();
  std::vector<float> s(kTileRows * kTileKeys), pv(kTileRows * kHd), m(kTileRows), l(kTileRows), alpha(kTileRows);
  std::vector<c10::BFloat16> k_pairs(kTileKeys * kHd), v_pairs(kTileKeys * kHd), p_pairs(kTileRows * kTileKeys);
  const std::optional<FloatTilePanels> panels = bf16 ? std::nullopt : std::optional<FloatTilePanels>(q);
  // The scores the softmax reads (and float32's P V reads as its P).
  const auto products = [&] {
    if (bf16) {
      bops.pair_gemm(kTileRows, kTileKeys, kHd / 2, q16, kTileLd, 2, k_pairs.data(), kHd * tile::kPanel, false,
                     s.data(), kTileKeys);
      bops.pair_gemm(kTileRows, kHd, kTileKeys / 2, p_pairs.data(), kTileKeys, 2, v_pairs.data(),
                     kTileKeys * tile::kPanel, false, pv.data(), kHd);
    } else {
      float_tile_products(q, *panels, s.data(), pv.data());
    }
  };
  if (bf16) {
    bops.pair_panels(q16 + kTileDim, 1, kTileLd, kHd, kTileKeys, k_pairs.data());
    bops.pair_panels(q16 + 2 * kTileDim, kTileLd, 1, kTileKeys, kHd, v_pairs.data());
  }
  products();
  const float scale = 0.125f;
  for (auto _ : state) {
    if (softmax) {  // the scores' values do not change the work (float32's in-place P is scored again)
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      if (bf16) {
        bops.softmax_tile_rounded(s.data(), kTileKeys, kTileRows, kTileKeys, scale, tile::kNoCausal, nullptr, m.data(),
                                  l.data(), alpha.data(), p_pairs.data(), kTileKeys);
      } else {
        fops.softmax_tile(s.data(), kTileKeys, kTileRows, kTileKeys, scale, tile::kNoCausal, nullptr, m.data(),
                          l.data(), alpha.data(), nullptr);
      }
      benchmark::DoNotOptimize(l.data());
    } else {
      products();
      benchmark::DoNotOptimize(pv.data());
    }
  }
  at::set_num_threads(threads);
  if (!softmax) {
    state.counters["GFLOP/s"] =
        benchmark::Counter(4.0 * kTileRows * kTileKeys * kHd * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  }
}
BENCHMARK(BM_ForwardTile)
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->ArgNames({"bf16", "softmax"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void shapes(benchmark::internal::Benchmark* b) {
  for (const int64_t T : {256, 512, 1024, 2048}) {
    for (const int64_t padded : {0, 1}) {
      b->Args({T, padded});
    }
  }
  b->ArgNames({"T", "padded"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(BM_FusedForward)->Apply(shapes);
BENCHMARK(BM_FusedBackward)->Apply(shapes);
BENCHMARK(BM_AtenSdpaForward)->Apply(shapes);

}  // namespace

BENCHMARK_MAIN();
