// The engine's tile sizes and tuning thresholds: private, so that retuning them never changes the
// installed API. The figures behind them: docs/performance.md.
#pragma once

#include <cstdint>

namespace causal_attention::kernels {

// The fused CPU kernel's tiles: block_q queries against block_k keys.
inline constexpr int64_t kBlockQ = 128;     // forward
inline constexpr int64_t kBlockK = 256;     // forward
inline constexpr int64_t kBwdBlockQ = 128;  // backward
inline constexpr int64_t kBwdBlockK = 128;  // backward
// The forward packs the key panels of this many bytes of (batch, key/value head)s at a time, then runs
// their query blocks (a wave), with at least this many query blocks per thread in a wave.
inline constexpr int64_t kWavePanelBytes = int64_t{2} << 20;
inline constexpr int64_t kWaveItemsPerThread = 8;
// Tiles on the causal diagonal go in slices of this many query rows, each with only the keys its
// rows can see, to waste less of the masked triangle.
inline constexpr int64_t kDiagonalRows = 64;
// Inside such a slice the forward's two products go in groups of this many rows (a multiple of the
// micro-kernels' register blocks), each only over the keys its last row sees.
inline constexpr int64_t kDiagonalGroupRows = 12;

// Decode attention.
inline constexpr int64_t kDecodeChunk = 256;  // keys: the unit of a context's split, the least per streamed call
// Bytes of keys and values per decode_chunk call of a few queries: each call passes over its keys,
// then over its values, and fewer, longer calls switch between the two streams less often.
inline constexpr int64_t kDecodeStreamBytes = 512 * 1024;
inline constexpr int64_t kDecodeFewRows = 16;  // up to this many new queries: row-wise streaming, not tiles
inline constexpr int64_t kDecodeItems = 64;    // few new queries: split contexts until B * H * splits reaches this

}  // namespace causal_attention::kernels

namespace causal_attention {

// Up to this many rows (a decode step), without autograd, a linear layer streams its weight once
// (kernels::few_rows_linear_cpu); past it BLAS is faster.
inline constexpr int64_t kFewRows = 8;

}  // namespace causal_attention
