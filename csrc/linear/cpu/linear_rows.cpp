// The few-rows linear kernel of a decode step (tile_ops.h: linear_rows, linear_rows_pairs): the weight
// streamed from memory once while every input row passes over it.
#include "cpu/bf16_pairs.h"
#include "cpu/families.h"
#include "cpu/vec.h"

#include <utility>

namespace causal_attention::tile::CPU_CAPABILITY {
namespace {

// Keeps v in a register (AVX-512, whose 32 registers hold the linear block's x vectors and
// accumulators). Without it GCC folds a vector loaded once and used RO times into each fused
// multiply-add's memory operand, and some CPUs run such FMAs at half the rate. (With AVX2's 16
// registers the x vectors would spill: there the memory operands stay.)
template <typename acc_t>
inline void keep_in_register([[maybe_unused]] Vec<acc_t>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    __m512 r = v;
    __asm__("" : "+v"(r));
    v = r;
  }
#endif
}

// s[i * RO + r] = x[i] . w[r] for RM rows of x (acc_t) and RO rows of w, each dot product summed
// as dot_rows sums it (lane-wise in k order, then across lanes, then the scalar tail): RM x RO
// accumulators in registers. Each step loads the RM x vectors once, then each weight vector once
// and feeds it to RM fused multiply-adds. Meanwhile `lines` cache lines from pf are prefetched
// into L2, spread evenly over the pass. The scalar tail is an explicit fused multiply-add where the
// build has one (else a multiply and an add): GCC contracts a * b + c only where it vectorises
// (-ffp-contract=fast), which differs between RM x RO shapes, and FewRowsProduct promises the same
// bits whichever block computes an output.
template <int RM, int RO, typename scalar_t, typename acc_t>
inline void linear_block(const acc_t* x, const scalar_t* w, int64_t in, acc_t* s, const char* pf, int64_t lines) {
  acc_t sum[RM][RO] = {};
  int64_t d = 0;
  int64_t line = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t> || kReduced<scalar_t>) {
    constexpr int64_t W = Vec<acc_t>::size();
    const int64_t steps = in / W;
    if (steps > 0) {
      Vec<acc_t> acc[RM][RO];
      for (int i = 0; i < RM; ++i) {
        for (int r = 0; r < RO; ++r) {
          acc[i][r] = Vec<acc_t>(0);
        }
      }
      int64_t owed = 0;  // Bresenham: `lines` prefetches over `steps` steps
      for (int64_t step = 0; step < steps; ++step, d += W) {
        for (owed += lines; owed >= steps; owed -= steps, ++line) {
          __builtin_prefetch(pf + 64 * line, 0, 2);  // prefetcht1: into L2
        }
        Vec<acc_t> xv[RM];
        for (int i = 0; i < RM; ++i) {
          xv[i] = Vec<acc_t>::loadu(x + i * in + d);
          keep_in_register(xv[i]);
        }
        for (int r = 0; r < RO; ++r) {
          const Vec<acc_t> wv = load_acc<acc_t>(w + r * in + d);
          for (int i = 0; i < RM; ++i) {
            acc[i][r] = at::vec::fmadd(xv[i], wv, acc[i][r]);
          }
        }
      }
      for (int i = 0; i < RM; ++i) {
        for (int r = 0; r < RO; ++r) {
          sum[i][r] = at::vec::vec_reduce_all<acc_t>(std::plus<Vec<acc_t>>(), acc[i][r]);
        }
      }
    }
  }
  for (; line < lines; ++line) {
    __builtin_prefetch(pf + 64 * line, 0, 2);
  }
  // The scalar tail: rounded the same way in every block shape (see above).
  for (; d < in; ++d) {
    for (int i = 0; i < RM; ++i) {
      for (int r = 0; r < RO; ++r) {
#if defined(__FMA__)
        sum[i][r] = std::fma(x[i * in + d], static_cast<acc_t>(w[r * in + d]), sum[i][r]);
#else
        sum[i][r] += x[i * in + d] * static_cast<acc_t>(w[r * in + d]);
#endif
      }
    }
  }
  for (int i = 0; i < RM; ++i) {
    for (int r = 0; r < RO; ++r) {
      s[i * RO + r] = sum[i][r];
    }
  }
}

// Input rows per pass over a block of weight rows: 8 where there are 32 vector registers (8 x
// vectors + 8 x 3 accumulators, all but one in registers; the weight is then read once for up to 8
// rows), 4 with AVX2's 16 and in the DEFAULT build (where 8 rows spill).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kLinearRows = 8;
#else
constexpr int kLinearRows = 4;
#endif

// The block kernel of linear_rows: fused multiply-adds on x widened to acc_t (linear_block, every
// build); the AVX512 build also has pairs of bfloat16 (PairBlock) for CPUs with AVX512-BF16.
struct FmaBlock {
  template <int RM, int RO, typename scalar_t, typename acc_t>
  static void run(const acc_t* x, const scalar_t* w, int64_t in, acc_t* s, const char* pf, int64_t lines) {
    linear_block<RM, RO>(x, w, in, s, pf, lines);
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// One step of pair_linear_block: the 32 values from d of RM x rows and RO weight rows (those outside
// `mask` read as 0) into the accumulators.
template <int RM, int RO>
CA_BF16_TARGET inline void pair_linear_step(const c10::BFloat16* x, const c10::BFloat16* w, int64_t in, int64_t d,
                                            __mmask32 mask, __m512 (&acc)[RM][RO]) {
  __m512i xv[RM];
#pragma GCC unroll 8
  for (int i = 0; i < RM; ++i) {
    xv[i] = _mm512_maskz_loadu_epi16(mask, x + i * in + d);
    __asm__("" : "+v"(xv[i]));  // in a register: see keep_in_register
  }
#pragma GCC unroll 8
  for (int r = 0; r < RO; ++r) {
    const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + r * in + d);
#pragma GCC unroll 8
    for (int i = 0; i < RM; ++i) {
      acc[i][r] = _mm512_dpbf16_ps(acc[i][r], (__m512bh)xv[i], (__m512bh)wv);
    }
  }
}

// out[i][r]: float32 lanes that add up to x[i] . w[r], for RM rows of x and RO rows of w, all
// bfloat16: 32 values (16 pairs) a step, each vdpbf16ps adding a pair's two products (exact in float32)
// to a lane's sum, the last step's values past `in` loaded as 0. Half the instructions of widening the
// weights for float32 fused multiply-adds, which would leave a decode step compute bound. (8 x 3: the 8
// x vectors, 24 accumulators and a weight vector are one more than the 32 registers, so GCC keeps one
// accumulator on the stack.) Meanwhile `lines` cache lines from pf are prefetched
// into L2, spread evenly over the pass.
template <int RM, int RO>
CA_BF16_TARGET void pair_linear_block(const c10::BFloat16* x, const c10::BFloat16* w, int64_t in,
                                      __m512 (&out)[RM][RO], const char* pf, int64_t lines) {
  constexpr int64_t kStep = 32;
  __m512 acc[RM][RO];  // local, so that they stay in registers (out is memory)
#pragma GCC unroll 8
  for (int i = 0; i < RM; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < RO; ++r) {
      acc[i][r] = _mm512_setzero_ps();
    }
  }
  const int64_t steps = (in + kStep - 1) / kStep;
  int64_t line = 0;
  int64_t owed = 0;  // Bresenham: `lines` prefetches over `steps` steps
  for (int64_t d = 0; d < in; d += kStep) {
    for (owed += lines; owed >= steps; owed -= steps, ++line) {
      __builtin_prefetch(pf + 64 * line, 0, 2);  // prefetcht1: into L2
    }
    const __mmask32 mask = d + kStep <= in ? ~__mmask32(0) : (__mmask32(1) << (in - d)) - 1;  // 0 < in - d < 32
    pair_linear_step<RM, RO>(x, w, in, d, mask, acc);
  }
  for (; line < lines; ++line) {
    __builtin_prefetch(pf + 64 * line, 0, 2);
  }
#pragma GCC unroll 8
  for (int i = 0; i < RM; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < RO; ++r) {
      out[i][r] = acc[i][r];
    }
  }
}

// linear_rows' block kernel on bfloat16 pairs (x as the input's bfloat16 rows).
// (The lanes are added here, outside the AVX512-BF16 target, where GCC 12 does not warn inside the
// shuffle intrinsics of at::vec's reduction.)
struct PairBlock {
  template <int RM, int RO>
  static void run(const c10::BFloat16* x, const c10::BFloat16* w, int64_t in, float* s, const char* pf,
                  int64_t lines) {
    __m512 acc[RM][RO];
    pair_linear_block<RM, RO>(x, w, in, acc, pf, lines);
    for (int i = 0; i < RM; ++i) {
      for (int r = 0; r < RO; ++r) {
        s[i * RO + r] = at::vec::vec_reduce_all<float>(std::plus<Vec<float>>(), Vec<float>(acc[i][r]));
      }
    }
  }
};
#endif

// The RO weight rows at w against every row of x, in blocks of kLinearRows, then 4, 2 and 1 rows (each
// by Block::run); the pf_lines cache lines from pf are prefetched over the blocks, in proportion to
// their rows.
template <int RO, typename Block, typename x_t, typename scalar_t, typename y_t,
          typename acc_t = at::opmath_type<scalar_t>>
void linear_rows_block(const x_t* x, int64_t rows, int64_t in, const scalar_t* w, const scalar_t* bias, int64_t o,
                       y_t* y, int64_t ld_y, const char* pf, int64_t pf_lines) {
  acc_t s[kLinearRows * RO];
  int64_t done = 0;  // lines prefetched so far
  const auto run = [&](auto rm, int64_t m) {
    constexpr int RM = decltype(rm)::value;
    const int64_t lines = pf_lines * (m + RM) / rows - done;
    Block::template run<RM, RO>(x + m * in, w, in, s, pf + 64 * done, lines);
    done += lines;
    for (int i = 0; i < RM; ++i) {
      for (int r = 0; r < RO; ++r) {
        const acc_t b = bias == nullptr ? acc_t(0) : static_cast<acc_t>(bias[o + r]);
        y[(m + i) * ld_y + o + r] = static_cast<y_t>(s[i * RO + r] + b);
      }
    }
  };
  int64_t m = 0;
  if constexpr (RO <= 3) {  // (6 weight rows take at most 4 input rows: linear_rows)
    for (; m + kLinearRows <= rows; m += kLinearRows) {
      run(std::integral_constant<int, kLinearRows>{}, m);
    }
  }
  if constexpr (kLinearRows > 4 || RO > 3) {
    for (; m + 4 <= rows; m += 4) {
      run(std::integral_constant<int, 4>{}, m);
    }
  }
  for (; m + 2 <= rows; m += 2) {
    run(std::integral_constant<int, 2>{}, m);
  }
  for (; m < rows; ++m) {
    run(std::integral_constant<int, 1>{}, m);
  }
}

// linear_rows with kOut weight rows per block; the rows of the block about kAheadBytes ahead are
// prefetched into L2 meanwhile, so that memory streams while the FMAs work (into L1, the prefetches
// evict the rows in use); past about 48 KB ahead, further gains nothing.
template <int kOut, typename scalar_t, typename Block, typename x_t, typename y_t>
void linear_rows_by(const x_t* x, int64_t rows, int64_t in, const scalar_t* w, const scalar_t* bias, int64_t o0,
                    int64_t o1, y_t* y, int64_t ld_y) {
  constexpr int64_t kAheadBytes = 48 * 1024;
  const int64_t block_bytes = kOut * in * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t ahead = std::max<int64_t>(2, (kAheadBytes + block_bytes - 1) / std::max<int64_t>(block_bytes, 1));
  // The cache lines of w's rows [first, first + count) within [o0, o1): from the line of their
  // first byte to the line of their last; none when the range is empty.
  const auto lines_of = [&](int64_t first, int64_t count) -> std::pair<const char*, int64_t> {
    const int64_t last = std::min(first + count, o1);
    if (first >= last || in == 0) {  // (in == 0: rows of no bytes)
      return {nullptr, 0};
    }
    const auto begin = reinterpret_cast<uintptr_t>(w + first * in) & ~uintptr_t(63);
    const auto end = (reinterpret_cast<uintptr_t>(w + last * in) - 1) & ~uintptr_t(63);
    return {reinterpret_cast<const char*>(begin), static_cast<int64_t>((end - begin) / 64 + 1)};
  };
  const auto [first_lines, n_first] = lines_of(o0, ahead * kOut);
  for (int64_t line = 0; line < n_first; ++line) {
    __builtin_prefetch(first_lines + 64 * line, 0, 2);
  }
  int64_t o = o0;
  for (; o + kOut <= o1; o += kOut) {
    const auto [pf, lines] = lines_of(o + ahead * kOut, kOut);
    linear_rows_block<kOut, Block>(x, rows, in, w + o * in, bias, o, y, ld_y, pf, lines);
  }
  for (; o < o1; ++o) {
    linear_rows_block<1, Block>(x, rows, in, w + o * in, bias, o, y, ld_y, nullptr, 0);
  }
}

// linear_rows of tile_ops.h with Block's kernel on x's rows (acc_t for FmaBlock, bfloat16 for PairBlock),
// into y_t (scalar_t, or acc_t for the *_acc entries). Weight rows per block: 3, or 6 for 3 or 4 rows
// with fused multiply-adds on AVX-512, where 4 x 6 accumulators fit the registers beside the x vectors:
// each x vector loaded then feeds 6 multiply-adds rather than 3 (at 4 rows the pass was compute bound,
// where fewer rows stream at memory's rate and bfloat16 pairs do twice the work an instruction).
template <typename scalar_t, typename Block = FmaBlock, typename x_t = at::opmath_type<scalar_t>,
          typename y_t = scalar_t>
void linear_rows(const x_t* x, int64_t rows, int64_t in, const scalar_t* w, const scalar_t* bias, int64_t o0,
                 int64_t o1, y_t* y, int64_t ld_y) {
  constexpr bool kWide = std::is_same_v<Block, FmaBlock> && kLinearRows > 4;
  if (kWide && rows > 2 && rows <= 4) {
    linear_rows_by<6, scalar_t, Block>(x, rows, in, w, bias, o0, o1, y, ld_y);
  } else {
    linear_rows_by<3, scalar_t, Block>(x, rows, in, w, bias, o0, o1, y, ld_y);
  }
}

}  // namespace

template <typename scalar_t>
void set_linear_rows_ops(TileOps<scalar_t>& ops) {
  using acc_t = at::opmath_type<scalar_t>;
  ops.linear_rows = &linear_rows<scalar_t>;
  ops.linear_rows_acc = &linear_rows<scalar_t, FmaBlock, acc_t, acc_t>;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (has_avx512_bf16()) {
      ops.linear_rows_pairs = &linear_rows<c10::BFloat16, PairBlock, c10::BFloat16>;
      ops.linear_rows_pairs_acc = &linear_rows<c10::BFloat16, PairBlock, c10::BFloat16, float>;
    }
  }
#endif
}
CA_INSTANTIATE_TILE_FAMILY(set_linear_rows_ops)

}  // namespace causal_attention::tile::CPU_CAPABILITY
