// Google Benchmark: the fused CPU kernel alone against ATen's composition (SDPA), in one binary.
//
//   build/py/causal_attention_bench --benchmark_filter=Forward
//
// Arguments: T, padded (0: causal only; 1: lengths uniform in [T/2, T]). B = 4, H = 12, hd = 64,
// float32. Counters: causal GFLOP/s (forward 2*B*H*T^2*hd, backward 2.5x that).
//
// BM_TileProducts: one forward tile's two products on one thread, BLAS against the micro-kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <vector>

#include "attention/blas.h"
#include "attention/tile_ops.h"
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

// One forward tile's products from qkv's layout (rows 3 * 768 floats apart): S = Q K^T (128 x 256 x 64),
// then P V (128 x 64 x 256). Argument 0: BLAS (blas.h, MKL where found), reading K and V in place, as the
// kernel did before the micro-kernel; 1: tile_ops' panel_gemm over panels of K^T and V packed outside
// the loop, as the forward packs them once per call (skipped where the CPU has no micro-kernel).
void BM_TileProducts(benchmark::State& state) {
  namespace tile = causal_attention::tile;
  constexpr int64_t kRows = 128, kKeys = 256, kDim = 768, kLd = 3 * kDim;
  const auto& ops = tile::tile_ops<float>();
  const bool micro = state.range(0) != 0;
  if (micro && ops.panel_gemm == nullptr) {
    state.SkipWithError("no micro-kernel on this CPU (AVX2 + FMA)");
    return;
  }
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  at::manual_seed(0);
  const auto qkv = at::randn({kKeys, kLd});
  const float* q = qkv.const_data_ptr<float>();
  const float* k = q + kDim;
  const float* v = q + 2 * kDim;
  std::vector<float> s(kRows * kKeys), pv(kRows * kHd), k_panels(kKeys * kHd), v_panels(kKeys * kHd);
  if (micro) {
    ops.pack_panels(k, 1, kLd, kHd, kKeys, k_panels.data());
    ops.pack_panels(v, kLd, 1, kKeys, kHd, v_panels.data());
  }
  for (auto _ : state) {
    if (micro) {
      ops.panel_gemm(kRows, kKeys, kHd, q, kLd, 1, k_panels.data(), tile::kPanel, kHd * tile::kPanel, false, s.data(),
                     kKeys);
      ops.panel_gemm(kRows, kHd, kKeys, s.data(), kKeys, 1, v_panels.data(), tile::kPanel, kKeys * tile::kPanel, false,
                     pv.data(), kHd);
    } else {
      causal_attention::blas::gemm(false, true, kRows, kKeys, kHd, 1.0f, q, kLd, k, kLd, 0.0f, s.data(), kKeys);
      causal_attention::blas::gemm(false, false, kRows, kHd, kKeys, 1.0f, s.data(), kKeys, v, kLd, 0.0f, pv.data(), kHd);
    }
    benchmark::DoNotOptimize(pv.data());
  }
  at::set_num_threads(threads);
  state.counters["GFLOP/s"] =
      benchmark::Counter(4.0 * kRows * kKeys * kHd * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_TileProducts)->Arg(0)->Arg(1)->ArgName("micro_kernel")->UseRealTime();

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
