// Google Benchmark: the fused CPU kernel alone against ATen's composition (SDPA), in one binary.
//
//   build/py/causal_attention_bench --benchmark_filter=Forward
//
// Arguments: T, padded (0: causal only; 1: lengths uniform in [T/2, T]). B = 4, H = 12, hd = 64,
// float32. Counters: causal GFLOP/s (forward 2*B*H*T^2*hd, backward 2.5x that).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

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
