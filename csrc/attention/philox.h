// Attention-weight dropout's random bits: Philox4x32-10 (Salmon et al., "Parallel random numbers:
// as easy as 1, 2, 3", SC 2011), a counter-based generator: the bits are a pure function of
// (key, counter), so any tile, thread or pass (forward, backward) regenerates the same ones.
//
// The keep decision of attention weight (b, h, i, j) (batch, head, query, key):
//   key     = the 64-bit seed (low word, high word)
//   counter = (j, i / 4, low word of bh, high word of bh),  bh = b * H + h
//   bits    = word i % 4 of Philox4x32-10(key, counter)
//   keep    = bits * 2^-32 >= p,  i.e. bits >= ceil(p * 2^32)
// It depends on neither T nor the tiling; one call gives four consecutive query rows of a column,
// so a tile's loop over its columns vectorises.
#pragma once

#include <cmath>
#include <cstdint>

namespace causal_attention::philox {

inline constexpr uint32_t kM0 = 0xD2511F53u;
inline constexpr uint32_t kM1 = 0xCD9E8D57u;
inline constexpr uint32_t kW0 = 0x9E3779B9u;  // golden ratio
inline constexpr uint32_t kW1 = 0xBB67AE85u;  // sqrt(3) - 1

// The four output words of Philox4x32-10 for counter (c0, c1, c2, c3) and key (k0, k1).
inline void philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                          uint32_t out[4]) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32);
    const uint32_t lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32);
    const uint32_t lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// The dropout of one attention: the seed (Philox key), and the keep threshold and scale from p.
struct Dropout {
  Dropout(double p, uint64_t seed_in) : seed(seed_in) {
    const double t = std::ceil(p * 4294967296.0);  // exact: p * 2^32 is a scaling by a power of 2
    if (p <= 0) {
      threshold = 0;
      keep_scale = 1;
    } else if (t > 4294967295.0) {  // 1 - 2^-32 < p < 1: bits >= 2^32 never holds, nothing is kept
      threshold = 0;
      keep_scale = 0;
    } else {
      threshold = static_cast<uint32_t>(t);
      keep_scale = 1.0 / (1.0 - p);
    }
  }

  uint64_t seed;
  uint32_t threshold;  // keep iff bits >= threshold
  double keep_scale;   // 1 / (1 - p), the factor of a kept weight (0 when nothing is kept)
};

// Whether attention weight (bh, i, j) is kept (the scalar definition; the tiles vectorise it).
inline bool keep(const Dropout& d, uint64_t bh, uint64_t i, uint64_t j) {
  uint32_t out[4];
  philox4x32_10(static_cast<uint32_t>(j), static_cast<uint32_t>(i >> 2), static_cast<uint32_t>(bh),
                static_cast<uint32_t>(bh >> 32), static_cast<uint32_t>(d.seed), static_cast<uint32_t>(d.seed >> 32), out);
  return d.keep_scale != 0 && out[i & 3] >= d.threshold;
}

}  // namespace causal_attention::philox
