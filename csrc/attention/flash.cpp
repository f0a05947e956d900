// The fused CPU attention kernel: flash-style tiling with an online softmax (forward) and a
// recomputing backward from the saved log-sum-exp. No T x T tensor is made and the key mask is
// never expanded beyond (B, T).
//
// Layout: q, k, v are read in place from qkv (B, T, 3 * dim) by strides; head h of q is columns
// h*hd:(h+1)*hd, of k dim + h*hd..., of v 2*dim + h*hd.... The output is written as (B, T, H, hd),
// which is (B, T, dim) for the output projection, with no transpose.
//
// Work skipped: key blocks above the diagonal, key blocks with no real key, and keys past the last
// real key of a sequence; key blocks that are all real need no element-wise mask.
//
// Attention-weight dropout (training): P_drop = P * keep / (1 - p), keep from philox.h, a pure
// function of (seed, b, h, i, j), so the backward regenerates the forward's decisions tile by tile.
// The forward drops the unnormalised weights after the running sum has counted them (the row sum
// is the softmax's, before dropout); the backward uses P_drop for dV and dP * keep / (1 - p) for dS.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "causal_attention/attention.h"
#include "philox.h"
#include "tensor_tiles.h"
#include "tile_ops.h"

namespace causal_attention::kernels {
namespace {

enum KeyBlockStatus : uint8_t { kNoneReal = 0, kAllReal = 1, kMixed = 2 };

// Per sequence: the status of each key block, and the end of its real keys (1 + last real index).
struct MaskSummary {
  MaskSummary(at::Tensor status_in, at::Tensor key_end_in, const std::optional<at::Tensor>& mask_in)
      : status_t(std::move(status_in)),
        key_end_t(std::move(key_end_in)),
        status(status_t.data_ptr<uint8_t>()),
        key_end(key_end_t.data_ptr<int64_t>()),
        mask(mask_in.has_value() ? mask_in->data_ptr<bool>() : nullptr) {}

  at::Tensor status_t;    // (B, n_key_blocks) uint8, owns status
  at::Tensor key_end_t;   // (B,) int64, owns key_end
  const uint8_t* status;  // KeyBlockStatus of (b, key block)
  const int64_t* key_end;
  const bool* mask;       // (B, T) contiguous, or nullptr: every key real
};

MaskSummary summarize(const std::optional<at::Tensor>& mask, int64_t B, int64_t T, int64_t block_k) {
  const int64_t nk = ceil_div(T, block_k);
  if (!mask.has_value()) {
    return {at::full({B, nk}, kAllReal, at::kByte), at::full({B}, T, at::kLong), mask};
  }
  const auto real = mask->to(at::kInt);                                        // (B, T)
  const auto padded = at::constant_pad_nd(real, {0, nk * block_k - T}, 0);     // (B, nk * bk)
  const auto count = padded.view({B, nk, block_k}).sum(2);                     // (B, nk)
  const auto block_len = at::full({nk}, block_k, at::kLong);
  block_len[nk - 1] = T - (nk - 1) * block_k;
  auto status = at::where(count.eq(0), kNoneReal, at::where(count.eq(block_len), kAllReal, kMixed));
  const auto positions = at::arange(1, T + 1, at::kLong).unsqueeze(0);           // (1, T)
  const auto key_end = (positions * mask->to(at::kLong)).amax(1);                // (B,)
  return {status.to(at::kByte).contiguous(), key_end.contiguous(), mask};
}

// bfloat16 / half inputs: every tile product is computed and accumulated in float32.
template <typename scalar_t>
constexpr bool kReduced = !std::is_same_v<scalar_t, at::opmath_type<scalar_t>>;

// s (rows, cols, acc_t) = a . b^T, from the acc_t operands, or straight from the bfloat16 inputs
// (a_in, b_in: rows read with leading dimensions ld_a, ld_b) with the AVX512-BF16 micro-kernel.
template <typename scalar_t>
void score_tile(at::Tensor s, const at::Tensor& a, const at::Tensor& b, const scalar_t* a_in, int64_t ld_a,
                const scalar_t* b_in, int64_t ld_b, uint32_t* pack) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (pack != nullptr) {
      tile::tile_ops<scalar_t>().bf16_scores(a_in, ld_a, b_in, ld_b, s.size(0), s.size(1), a.size(1),
                                             s.data_ptr<float>(), s.stride(0), pack);
      return;
    }
  }
  at::mm_out(s, a, b.t());
}

// Whether the AVX512-BF16 score micro-kernel runs (bfloat16 on a CPU that has it, even head_dim).
template <typename scalar_t>
bool use_bf16_scores(int64_t hd) {
  return tile::tile_ops<scalar_t>().bf16_scores != nullptr && hd % 2 == 0;
}

// Query blocks of one (batch, head) in an order that pairs short causal rows with long ones, so
// that contiguous ranges of work items hold balanced work.
int64_t balanced_block(int64_t r, int64_t n) { return (r % 2 == 0) ? r / 2 : n - 1 - r / 2; }

struct Geometry {
  int64_t B, T, H, dim, hd, nq, nk;  // nq, nk: query and key blocks of the pass
};

Geometry geometry(const at::Tensor& qkv, int64_t n_heads, int64_t block_q, int64_t block_k) {
  const int64_t dim = qkv.size(2) / 3;
  const int64_t T = qkv.size(1);
  return {qkv.size(0), T, n_heads, dim, dim / n_heads, ceil_div(T, block_q), ceil_div(T, block_k)};
}

// The dropout of a call: none (p = 0), or its probability and seed.
using OptionalDropout = std::optional<philox::Dropout>;

template <typename scalar_t>
void forward_impl(const at::Tensor& qkv, const std::optional<at::Tensor>& mask, const Geometry& g,
                  const OptionalDropout& drop, const at::Tensor& out, const at::Tensor& lse) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto& ops = tile::tile_ops<scalar_t>();   // conversions from and to the input type
  const auto& acc_ops = tile::tile_ops<acc_t>();  // the tiles, in acc_t
  const MaskSummary summary = summarize(mask, g.B, g.T, kBlockK);
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  acc_t* lse_ptr = lse.data_ptr<acc_t>();
  const acc_t scale = acc_t(1) / std::sqrt(static_cast<acc_t>(g.hd));
  const at::Tensor qkv_acc = widened(qkv);  // (B, T, 3 * dim) acc_t
  const bool dot_bf16 = use_bf16_scores<scalar_t>(g.hd);
  const scalar_t* qkv_in = qkv.data_ptr<scalar_t>();
  const int64_t ld = qkv.stride(1);

  at::parallel_for(0, g.B * g.H * g.nq, 1, [&](int64_t begin, int64_t end) {
    // Worker threads do not inherit the caller's dispatch state: the tile products below are
    // plain kernels, never recorded by autograd.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Per-chunk workspace, reused by every work item of the chunk.
    const auto acc_options = qkv_acc.options();
    const at::Tensor scores = at::empty({kBlockQ * kBlockK}, acc_options);
    const at::Tensor pv = at::empty({kBlockQ * g.hd}, acc_options);
    const at::Tensor pack = dot_bf16 ? at::empty({(g.hd / 2) * (kBlockK + 32)}, acc_options.dtype(at::kInt))
                                     : at::Tensor();
    uint32_t* pack_ptr = dot_bf16 ? reinterpret_cast<uint32_t*>(pack.data_ptr<int32_t>()) : nullptr;
    const at::Tensor state = at::empty({kBlockQ * g.hd + 3 * kBlockQ + kBlockK}, acc_options);
    acc_t* o_acc = state.data_ptr<acc_t>();  // (bq, hd) unnormalised output
    acc_t* m = o_acc + kBlockQ * g.hd;       // running row max
    acc_t* l = m + kBlockQ;                  // running row sum
    acc_t* alpha = l + kBlockQ;
    acc_t* buf = alpha + kBlockQ;

    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / g.nq;
      const int64_t b = bh / g.H;
      const int64_t h = bh % g.H;
      const int64_t qb = balanced_block(item % g.nq, g.nq);
      const int64_t q0 = qb * kBlockQ;
      const int64_t q1 = std::min(g.T, q0 + kBlockQ);
      const int64_t bq = q1 - q0;
      const auto seq = qkv_acc.select(0, b);                          // (T, 3 * dim)
      const auto q = seq.narrow(0, q0, bq).narrow(1, h * g.hd, g.hd);  // (bq, hd)
      const scalar_t* seq_in = qkv_in + b * qkv.stride(0);

      std::fill(o_acc, o_acc + bq * g.hd, acc_t(0));
      std::fill(m, m + bq, -std::numeric_limits<acc_t>::infinity());
      std::fill(l, l + bq, acc_t(0));

      const int64_t k_stop = std::min(q1, summary.key_end[b]);  // causal, and no key past the last real one
      for (int64_t kb = 0; kb * kBlockK < k_stop; ++kb) {
        const uint8_t st = summary.status[b * g.nk + kb];
        if (st == kNoneReal) {
          continue;
        }
        const int64_t k0 = kb * kBlockK;
        const int64_t bk = std::min(k_stop, k0 + kBlockK) - k0;
        const bool* key_mask = (st == kMixed) ? summary.mask + b * g.T + k0 : nullptr;
        // Rows r0..r1 of the query block against the first `cols` keys of the key block.
        const auto attend = [&](int64_t r0, int64_t r1, int64_t cols) {
          const int64_t rows = r1 - r0;
          const auto k = seq.narrow(0, k0, cols).narrow(1, g.dim + h * g.hd, g.hd);      // (cols, hd)
          const auto v = seq.narrow(0, k0, cols).narrow(1, 2 * g.dim + h * g.hd, g.hd);  // (cols, hd)
          const at::Tensor s = tile(scores, rows, cols);                                 // (rows, cols)
          const int64_t causal_offset = (k0 + cols - 1 > q0 + r0) ? q0 + r0 - k0 : tile::kNoCausal;
          score_tile<scalar_t>(s, q.narrow(0, r0, rows), k, seq_in + (q0 + r0) * ld + h * g.hd, ld,
                               seq_in + k0 * ld + g.dim + h * g.hd, ld, pack_ptr);
          acc_ops.softmax_tile(s.data_ptr<acc_t>(), cols, rows, cols, scale, causal_offset, key_mask, m + r0, l + r0,
                               alpha + r0, buf);
          if (drop.has_value()) {  // after the row sums: they are the softmax's, before dropout
            acc_ops.dropout(s.data_ptr<acc_t>(), nullptr, cols, rows, cols, *drop, static_cast<uint64_t>(bh), q0 + r0,
                            k0);
          }
          ops.round_to_input(s.data_ptr<acc_t>(), cols, rows, cols);  // P as an input-type operand (entries <= 1)
          at::Tensor pv_tile = tile(pv, rows, g.hd);                   // (rows, hd)
          at::mm_out(pv_tile, s, v);
          acc_ops.rescale_add(o_acc + r0 * g.hd, g.hd, pv_tile.data_ptr<acc_t>(), g.hd, rows, g.hd, alpha + r0);
        };
        if (k0 + bk - 1 <= q0) {  // below the diagonal: every row sees every key
          attend(0, bq, bk);
          continue;
        }
        // On the diagonal: rows in slices, each against the keys it can see.
        for (int64_t r0 = 0; r0 < bq; r0 += kDiagonalRows) {
          const int64_t r1 = std::min(bq, r0 + kDiagonalRows);
          const int64_t cols = std::min(bk, q0 + r1 - k0);
          if (cols > 0) {
            attend(r0, r1, cols);
          }
        }
      }
      ops.finalize(o_acc, g.hd, bq, g.hd, m, l, out_ptr + (b * g.T + q0) * g.dim + h * g.hd, g.dim,
                   lse_ptr + bh * g.T + q0);
    }
  });
}

template <typename scalar_t>
void backward_impl(const at::Tensor& grad_out, const at::Tensor& qkv, const std::optional<at::Tensor>& mask,
                   const at::Tensor& out, const at::Tensor& lse, const Geometry& g, const OptionalDropout& drop,
                   const at::Tensor& grad_qkv) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto& ops = tile::tile_ops<scalar_t>();   // conversions from and to the input type
  const auto& acc_ops = tile::tile_ops<acc_t>();  // the tiles, in acc_t
  const MaskSummary summary = summarize(mask, g.B, g.T, kBwdBlockK);
  const acc_t* lse_ptr = lse.data_ptr<acc_t>();
  const acc_t scale = acc_t(1) / std::sqrt(static_cast<acc_t>(g.hd));
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  // delta[b, t, h] = sum_d dO[b, t, h, d] * O[b, t, h, d]   (O with dropout: sum_j P dP_drop, still)
  const at::Tensor delta = (grad_out.to(acc_dtype) * out.to(acc_dtype)).view({g.B, g.T, g.H, g.hd}).sum(3).contiguous();
  const acc_t* delta_ptr = delta.data_ptr<acc_t>();
  const at::Tensor qkv_acc = widened(qkv);        // (B, T, 3 * dim) acc_t
  const at::Tensor dout_acc = widened(grad_out);  // (B, T, dim) acc_t
  const bool dot_bf16 = use_bf16_scores<scalar_t>(g.hd);
  const scalar_t* qkv_in = qkv.data_ptr<scalar_t>();
  const scalar_t* dout_in = grad_out.data_ptr<scalar_t>();
  scalar_t* grad_ptr = grad_qkv.data_ptr<scalar_t>();
  const int64_t ld = qkv.stride(1);
  const int64_t ld_grad = 3 * g.dim;

  at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in the forward
    const auto acc_options = qkv_acc.options();
    const at::Tensor p_ws = at::empty({kBwdBlockQ * kBwdBlockK}, acc_options);   // P
    const at::Tensor dp_ws = at::empty({kBwdBlockQ * kBwdBlockK}, acc_options);  // dP, then dS
    // bfloat16/half: P rounded to the input type for P^T dO (dS is computed from the unrounded P);
    // with dropout, P_drop.
    const bool p_copy = kReduced<scalar_t> || drop.has_value();
    const at::Tensor p_in_ws = p_copy ? at::empty({kBwdBlockQ * kBwdBlockK}, acc_options) : at::Tensor();
    const at::Tensor pack = dot_bf16 ? at::empty({(g.hd / 2) * (kBwdBlockK + 32)}, acc_options.dtype(at::kInt))
                                     : at::Tensor();
    uint32_t* pack_ptr = dot_bf16 ? reinterpret_cast<uint32_t*>(pack.data_ptr<int32_t>()) : nullptr;
    const at::Tensor acc = at::empty({(g.T + 2 * kBwdBlockK) * g.hd}, acc_options);
    acc_t* dq_acc = acc.data_ptr<acc_t>();     // (T, hd)
    acc_t* dk_acc = dq_acc + g.T * g.hd;       // (block_k, hd)
    acc_t* dv_acc = dk_acc + kBwdBlockK * g.hd;  // (block_k, hd)

    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / g.H;
      const int64_t h = bh % g.H;
      const auto seq = qkv_acc.select(0, b);    // (T, 3 * dim)
      const auto dout = dout_acc.select(0, b);  // (T, dim)
      const scalar_t* seq_in = qkv_in + b * qkv.stride(0);
      const scalar_t* dout_seq_in = dout_in + b * g.T * g.dim;
      std::fill(dq_acc, dq_acc + g.T * g.hd, acc_t(0));
      scalar_t* grad_seq = grad_ptr + b * g.T * ld_grad;

      // dK and dV of keys that no query may attend (padding) are zero.
      const auto zero_key_rows = [&](int64_t k0, int64_t k1) {
        for (int64_t t = k0; t < k1; ++t) {
          scalar_t* row = grad_seq + t * ld_grad + h * g.hd;
          std::fill(row + g.dim, row + g.dim + g.hd, scalar_t(0));
          std::fill(row + 2 * g.dim, row + 2 * g.dim + g.hd, scalar_t(0));
        }
      };
      zero_key_rows(summary.key_end[b], g.T);
      for (int64_t kb = 0; kb * kBwdBlockK < summary.key_end[b]; ++kb) {
        const uint8_t st = summary.status[b * g.nk + kb];
        const int64_t k0 = kb * kBwdBlockK;
        const int64_t bk = std::min(summary.key_end[b], k0 + kBwdBlockK) - k0;
        if (st == kNoneReal) {
          zero_key_rows(k0, k0 + bk);
          continue;
        }
        const auto k = seq.narrow(0, k0, bk).narrow(1, g.dim + h * g.hd, g.hd);      // (bk, hd)
        const auto v = seq.narrow(0, k0, bk).narrow(1, 2 * g.dim + h * g.hd, g.hd);  // (bk, hd)
        const bool* key_mask = (st == kMixed) ? summary.mask + b * g.T + k0 : nullptr;
        std::fill(dk_acc, dk_acc + bk * g.hd, acc_t(0));
        std::fill(dv_acc, dv_acc + bk * g.hd, acc_t(0));

        for (int64_t q0 = (k0 / kBwdBlockQ) * kBwdBlockQ; q0 < g.T; q0 += kBwdBlockQ) {
          const int64_t bq = std::min(g.T, q0 + kBwdBlockQ) - q0;
          // Query rows r0..r1 of the block against the first `cols` keys of the key block.
          const auto grad_tile = [&](int64_t r0, int64_t r1, int64_t cols) {
            const int64_t rows = r1 - r0;
            const auto q = seq.narrow(0, q0 + r0, rows).narrow(1, h * g.hd, g.hd);    // (rows, hd)
            const auto dO = dout.narrow(0, q0 + r0, rows).narrow(1, h * g.hd, g.hd);  // (rows, hd)
            const auto kc = k.narrow(0, 0, cols);                                       // (cols, hd)
            const auto vc = v.narrow(0, 0, cols);                                       // (cols, hd)
            const at::Tensor p = tile(p_ws, rows, cols);                                // (rows, cols)
            const at::Tensor dp = tile(dp_ws, rows, cols);                              // (rows, cols)
            const int64_t causal_offset = (k0 + cols - 1 > q0 + r0) ? q0 + r0 - k0 : tile::kNoCausal;
            const acc_t* lse_rows = lse_ptr + bh * g.T + q0 + r0;
            const acc_t* delta_rows = delta_ptr + (b * g.T + q0 + r0) * g.H + h;
            // P = exp(scale * q k^T - lse)
            score_tile<scalar_t>(p, q, kc, seq_in + (q0 + r0) * ld + h * g.hd, ld, seq_in + k0 * ld + g.dim + h * g.hd,
                                 ld, pack_ptr);
            acc_ops.probabilities(p.data_ptr<acc_t>(), cols, rows, cols, scale, causal_offset, key_mask, lse_rows);
            // dP = dO v^T
            score_tile<scalar_t>(dp, dO, vc, dout_seq_in + (q0 + r0) * g.dim + h * g.hd, g.dim,
                                 seq_in + k0 * ld + 2 * g.dim + h * g.hd, ld, pack_ptr);
            const at::Tensor p_in = p_copy ? tile(p_in_ws, rows, cols).copy_(p) : p;
            if (drop.has_value()) {  // P_drop = P * keep / (1 - p) and dP_drop = dP * keep / (1 - p)
              acc_ops.dropout(p_in.data_ptr<acc_t>(), dp.data_ptr<acc_t>(), cols, rows, cols, *drop,
                              static_cast<uint64_t>(bh), q0 + r0, k0);
            }
            if constexpr (kReduced<scalar_t>) {
              ops.round_to_input(p_in.data_ptr<acc_t>(), cols, rows, cols);
            }
            accumulate_product(dv_acc, g.hd, p_in.t(), dO);  // dV += P_drop^T dO
            // dS = scale * P (dP_drop - delta), rounded to the input type for the products that follow
            acc_ops.score_grad(dp.data_ptr<acc_t>(), p.data_ptr<acc_t>(), cols, rows, cols, scale, delta_rows, g.H);
            ops.round_to_input(dp.data_ptr<acc_t>(), cols, rows, cols);
            accumulate_product(dq_acc + (q0 + r0) * g.hd, g.hd, dp, kc);  // dQ += dS K
            accumulate_product(dk_acc, g.hd, dp.t(), q);                   // dK += dS^T Q
          };
          if (k0 + bk - 1 <= q0) {  // below the diagonal: every row sees every key
            grad_tile(0, bq, bk);
            continue;
          }
          for (int64_t r0 = 0; r0 < bq; r0 += kDiagonalRows) {  // on the diagonal, as in the forward
            const int64_t r1 = std::min(bq, r0 + kDiagonalRows);
            const int64_t cols = std::min(bk, q0 + r1 - k0);
            if (cols > 0) {
              grad_tile(r0, r1, cols);
            }
          }
        }
        ops.store(dk_acc, g.hd, bk, g.hd, grad_seq + k0 * ld_grad + g.dim + h * g.hd, ld_grad);
        ops.store(dv_acc, g.hd, bk, g.hd, grad_seq + k0 * ld_grad + 2 * g.dim + h * g.hd, ld_grad);
      }
      ops.store(dq_acc, g.hd, g.T, g.hd, grad_seq + h * g.hd, ld_grad);
    }
  });
}

void check_cpu_inputs(const at::Tensor& qkv, const std::optional<at::Tensor>& mask, int64_t n_heads) {
  check_qkv(qkv, n_heads);
  TORCH_CHECK_VALUE(qkv.device().is_cpu(), "the CPU attention kernel takes CPU tensors; got qkv on ",
                    qkv.device());
  if (mask.has_value()) {
    TORCH_CHECK_VALUE(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == qkv.size(0) &&
                          mask->size(1) == qkv.size(1),
                      "key_padding_mask must be a bool tensor of shape (B, T) = (", qkv.size(0), ", ",
                      qkv.size(1), "); got ", mask->scalar_type(), " of shape ", mask->sizes());
    TORCH_CHECK_VALUE(mask->device() == qkv.device(), "key_padding_mask must be on the same device as qkv (",
                      qkv.device(), "); got ", mask->device());
  }
}

// The dropout of a call from (dropout_p, seed): none when p = 0 (the exact path, bit for bit).
OptionalDropout dropout_of(double dropout_p, const std::optional<at::Tensor>& seed) {
  check_dropout(dropout_p);
  if (dropout_p == 0) {
    return std::nullopt;
  }
  TORCH_CHECK_VALUE(seed.has_value() && seed->defined(), "dropout_p = ", dropout_p,
                    " > 0 needs a seed (an int64 tensor with one element)");
  return philox::Dropout(dropout_p, static_cast<uint64_t>(seed_value(*seed)));
}

// The kernels read rows by stride; the last dimension must be dense.
at::Tensor dense_rows(const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

std::optional<at::Tensor> contiguous_mask(const std::optional<at::Tensor>& mask) {
  return mask.has_value() ? std::optional<at::Tensor>(mask->contiguous()) : std::nullopt;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& qkv_in,
                                                         const std::optional<at::Tensor>& mask_in,
                                                         int64_t n_heads, double dropout_p,
                                                         const std::optional<at::Tensor>& seed) {
  check_cpu_inputs(qkv_in, mask_in, n_heads);
  const auto drop = dropout_of(dropout_p, seed);
  const auto qkv = dense_rows(qkv_in);
  const auto mask = contiguous_mask(mask_in);
  const auto g = geometry(qkv, n_heads, kBlockQ, kBlockK);
  const auto acc_dtype = qkv.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto out = at::empty({g.B, g.T, g.dim}, qkv.options());
  auto lse = at::empty({g.B, g.H, g.T}, qkv.options().dtype(acc_dtype));
  if (out.numel() == 0) {
    return {out, lse};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "causal_attention_forward", [&] {
    forward_impl<scalar_t>(qkv, mask, g, drop, out, lse);
  });
  return {out, lse};
}

at::Tensor attention_backward_cpu(const at::Tensor& grad_out_in, const at::Tensor& qkv_in,
                                  const std::optional<at::Tensor>& mask_in, const at::Tensor& out,
                                  const at::Tensor& lse, int64_t n_heads, double dropout_p,
                                  const std::optional<at::Tensor>& seed) {
  check_cpu_inputs(qkv_in, mask_in, n_heads);
  const auto drop = dropout_of(dropout_p, seed);
  const auto qkv = dense_rows(qkv_in);
  const auto mask = contiguous_mask(mask_in);
  const auto g = geometry(qkv, n_heads, kBwdBlockQ, kBwdBlockK);
  TORCH_CHECK_VALUE(grad_out_in.sizes() == out.sizes() && out.sizes() == at::IntArrayRef({g.B, g.T, g.dim}),
                    "grad_out and out must have shape (B, T, dim) = (", g.B, ", ", g.T, ", ", g.dim, "); got ",
                    grad_out_in.sizes(), " and ", out.sizes());
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef({g.B, g.H, g.T}), "lse must have shape (B, H, T); got ",
                    lse.sizes());
  const auto grad_out = grad_out_in.to(qkv.scalar_type()).contiguous();
  auto grad_qkv = at::empty({g.B, g.T, 3 * g.dim}, qkv.options());  // every element is written
  if (grad_qkv.numel() == 0) {
    return grad_qkv;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "causal_attention_backward", [&] {
    backward_impl<scalar_t>(grad_out, qkv, mask, out.contiguous(), lse.contiguous(), g, drop, grad_qkv);
  });
  return grad_qkv;
}

at::Tensor dropout_keep_mask_cpu(const at::Tensor& seed, int64_t B, int64_t H, int64_t T, double dropout_p) {
  TORCH_CHECK_VALUE(B >= 0 && H >= 0 && T >= 0, "dropout_keep_mask: B, H, T must be >= 0; got ", B, ", ", H, ", ",
                    T);
  const auto drop = dropout_of(dropout_p, seed);
  auto keep = at::empty({B, H, T, T}, at::TensorOptions().dtype(at::kBool));
  if (!drop.has_value()) {
    return keep.fill_(true);
  }
  bool* keep_ptr = keep.data_ptr<bool>();
  at::parallel_for(0, B * H * T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {  // row = bh * T + i
      const int64_t bh = row / T;
      const int64_t i = row % T;
      for (int64_t j = 0; j < T; ++j) {
        keep_ptr[row * T + j] = philox::keep(*drop, static_cast<uint64_t>(bh), static_cast<uint64_t>(i),
                                             static_cast<uint64_t>(j));
      }
    }
  });
  return keep;
}

}  // namespace causal_attention::kernels
