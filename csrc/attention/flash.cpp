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
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "causal_attention/attention.h"
#include "tile_ops.h"

namespace causal_attention::kernels {
namespace {

enum KeyBlockStatus : uint8_t { kNoneReal = 0, kAllReal = 1, kMixed = 2 };

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

// bfloat16 / half: score and score-gradient tiles are computed in float32.
template <typename scalar_t>
constexpr bool kReduced = !std::is_same_v<scalar_t, at::opmath_type<scalar_t>>;

// Query rows per slice of a diagonal tile. With float/double GEMMs the masked triangle is worth
// skipping; bfloat16/half GEMMs (oneDNN) are fast enough that more, smaller GEMMs cost more.
template <typename scalar_t>
constexpr int64_t diagonal_rows() {
  return std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double> ? kDiagonalRows : kBlockQ;
}

// A (rows, cols) matrix view of a flat workspace.
at::Tensor tile(const at::Tensor& workspace, int64_t rows, int64_t cols) {
  return workspace.narrow(0, 0, rows * cols).view({rows, cols});
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

template <typename scalar_t>
void forward_impl(const at::Tensor& qkv, const std::optional<at::Tensor>& mask, const Geometry& g,
                  const at::Tensor& out, const at::Tensor& lse) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto& ops = tile::tile_ops<scalar_t>();
  const MaskSummary summary = summarize(mask, g.B, g.T, kBlockK);
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  acc_t* lse_ptr = lse.data_ptr<acc_t>();
  const acc_t scale = acc_t(1) / std::sqrt(static_cast<acc_t>(g.hd));
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;

  // bfloat16/half score tiles in float32: straight from bfloat16 pairs with AVX512-BF16 where the
  // CPU has it, else from q and k widened to float32 once, (B, T, 2 * dim).
  const bool dot_bf16 = ops.bf16_scores != nullptr && g.hd % 2 == 0;
  const at::Tensor qk_wide =
      kReduced<scalar_t> && !dot_bf16 ? qkv.narrow(2, 0, 2 * g.dim).to(at::kFloat) : at::Tensor();
  const int64_t ld = qkv.stride(1);

  at::parallel_for(0, g.B * g.H * g.nq, 1, [&](int64_t begin, int64_t end) {
    // Worker threads do not inherit the caller's dispatch state: the tile products below are
    // plain kernels, never recorded by autograd.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Per-chunk workspace, reused by every work item of the chunk.
    const at::Tensor scores = at::empty({kBlockQ * kBlockK}, qkv.options());
    const at::Tensor pv = at::empty({kBlockQ * g.hd}, qkv.options());
    // bfloat16/half: scores are computed and normalised in float32 (q and k widened first), and
    // only the probabilities are rounded to the input type for the P V product.
    const at::Tensor s_wide = kReduced<scalar_t> ? at::empty({kBlockQ * kBlockK}, qkv.options().dtype(at::kFloat))
                                                 : at::Tensor();
    const at::Tensor pack = dot_bf16 ? at::empty({(g.hd / 2) * (kBlockK + 32)}, qkv.options().dtype(at::kInt))
                                     : at::Tensor();
    const at::Tensor acc = at::empty({kBlockQ * g.hd + 3 * kBlockQ + kBlockK}, qkv.options().dtype(acc_dtype));
    acc_t* o_acc = acc.data_ptr<acc_t>();
    acc_t* m = o_acc + kBlockQ * g.hd;
    acc_t* l = m + kBlockQ;
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
      const auto seq = qkv.select(0, b);                              // (T, 3 * dim)
      const auto q = seq.narrow(0, q0, bq).narrow(1, h * g.hd, g.hd);  // (bq, hd)
      const at::Tensor q32 = qk_wide.defined() ? qk_wide.select(0, b).narrow(0, q0, bq).narrow(1, h * g.hd, g.hd)
                                               : at::Tensor();  // (bq, hd) float32
      const scalar_t* seq_ptr = seq.data_ptr<scalar_t>();

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
          const auto k = seq.narrow(0, k0, cols).narrow(1, g.dim + h * g.hd, g.hd);      // (cols, hd)
          const auto v = seq.narrow(0, k0, cols).narrow(1, 2 * g.dim + h * g.hd, g.hd);  // (cols, hd)
          at::Tensor s = tile(scores, r1 - r0, cols);                                    // (rows, cols)
          const int64_t causal_offset = (k0 + cols - 1 > q0 + r0) ? q0 + r0 - k0 : tile::kNoCausal;
          if constexpr (kReduced<scalar_t>) {
            at::Tensor s32 = tile(s_wide, r1 - r0, cols);
            if (dot_bf16) {
              ops.bf16_scores(seq_ptr + (q0 + r0) * ld + h * g.hd, ld, seq_ptr + k0 * ld + g.dim + h * g.hd, ld,
                              r1 - r0, cols, g.hd, s32.data_ptr<float>(), cols,
                              reinterpret_cast<uint32_t*>(pack.data_ptr<int32_t>()));
            } else {
              const auto k32 = qk_wide.select(0, b).narrow(0, k0, cols).narrow(1, g.dim + h * g.hd, g.hd);
              at::mm_out(s32, q32.narrow(0, r0, r1 - r0), k32.t());
            }
            tile::tile_ops<float>().softmax_tile(s32.data_ptr<float>(), cols, r1 - r0, cols, scale, causal_offset,
                                                 key_mask, m + r0, l + r0, alpha + r0, buf);
            s.copy_(s32);  // probabilities, rounded to the input type
          } else {
            at::mm_out(s, q.narrow(0, r0, r1 - r0), k.t());
            ops.softmax_tile(s.data_ptr<scalar_t>(), cols, r1 - r0, cols, scale, causal_offset, key_mask, m + r0,
                             l + r0, alpha + r0, buf);
          }
          at::Tensor pv_tile = tile(pv, r1 - r0, g.hd);  // (rows, hd)
          at::mm_out(pv_tile, s, v);
          ops.rescale_add(o_acc + r0 * g.hd, g.hd, pv_tile.data_ptr<scalar_t>(), g.hd, r1 - r0, g.hd, alpha + r0);
        };
        if (k0 + bk - 1 <= q0) {  // below the diagonal: every row sees every key
          attend(0, bq, bk);
          continue;
        }
        // On the diagonal: rows in slices, each against the keys it can see.
        for (int64_t r0 = 0; r0 < bq; r0 += diagonal_rows<scalar_t>()) {
          const int64_t r1 = std::min(bq, r0 + diagonal_rows<scalar_t>());
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

// acc (rows, cols; leading dimension ld) += a @ b, accumulated in acc_t: straight into acc when
// acc_t is the input type, else through the workspace tmp.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void accumulate_product(acc_t* acc, int64_t ld, const at::Tensor& a, const at::Tensor& b, const at::Tensor& tmp,
                        const tile::TileOps<scalar_t>& ops) {
  const int64_t rows = a.size(0);
  const int64_t cols = b.size(1);
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    at::Tensor out = at::from_blob(acc, {rows, cols}, {ld, 1}, a.options());
    at::addmm_out(out, out, a, b);
  } else {
    at::Tensor t = tile(tmp, rows, cols);
    at::mm_out(t, a, b);
    ops.add(acc, ld, t.data_ptr<scalar_t>(), cols, rows, cols);
  }
}

template <typename scalar_t>
void backward_impl(const at::Tensor& grad_out, const at::Tensor& qkv, const std::optional<at::Tensor>& mask,
                   const at::Tensor& out, const at::Tensor& lse, const Geometry& g, const at::Tensor& grad_qkv) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto& ops = tile::tile_ops<scalar_t>();
  const MaskSummary summary = summarize(mask, g.B, g.T, kBwdBlockK);
  const acc_t* lse_ptr = lse.data_ptr<acc_t>();
  const acc_t scale = acc_t(1) / std::sqrt(static_cast<acc_t>(g.hd));
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  // delta[b, t, h] = sum_d dO[b, t, h, d] * O[b, t, h, d]
  const at::Tensor delta = (grad_out.to(acc_dtype) * out.to(acc_dtype)).view({g.B, g.T, g.H, g.hd}).sum(3).contiguous();
  const acc_t* delta_ptr = delta.data_ptr<acc_t>();
  scalar_t* grad_ptr = grad_qkv.data_ptr<scalar_t>();
  const int64_t ld_grad = 3 * g.dim;

  at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in the forward
    const at::Tensor p_ws = at::empty({kBwdBlockQ * kBwdBlockK}, qkv.options());
    const at::Tensor dp_ws = at::empty({kBwdBlockQ * kBwdBlockK}, qkv.options());
    const at::Tensor tmp_ws = at::empty({std::max(kBwdBlockQ, kBwdBlockK) * g.hd}, qkv.options());
    // bfloat16/half: P and dP are computed in float32 from widened q, k, v, dO (as in the forward).
    const auto f32 = qkv.options().dtype(at::kFloat);
    const auto wide = [&](int64_t n) { return kReduced<scalar_t> ? at::empty({n}, f32) : at::Tensor(); };
    const bool dot_bf16 = ops.bf16_scores != nullptr && g.hd % 2 == 0;  // as in the forward
    // Widened inputs only where the float32 GEMMs need them (no AVX512-BF16 path).
    const auto widened = [&](int64_t n) { return dot_bf16 ? at::Tensor() : wide(n); };
    const at::Tensor q_wide = widened(kBwdBlockQ * g.hd), do_wide = widened(kBwdBlockQ * g.hd);
    const at::Tensor k_wide = widened(kBwdBlockK * g.hd), v_wide = widened(kBwdBlockK * g.hd);
    const at::Tensor p_wide = wide(kBwdBlockQ * kBwdBlockK), dp_wide = wide(kBwdBlockQ * kBwdBlockK);
    const at::Tensor pack = dot_bf16 ? at::empty({(g.hd / 2) * (kBwdBlockK + 32)}, qkv.options().dtype(at::kInt))
                                     : at::Tensor();
    uint32_t* pack_ptr = dot_bf16 ? reinterpret_cast<uint32_t*>(pack.data_ptr<int32_t>()) : nullptr;
    const at::Tensor acc = at::empty({(g.T + 2 * kBwdBlockK) * g.hd}, qkv.options().dtype(acc_dtype));
    acc_t* dq_acc = acc.data_ptr<acc_t>();        // (T, hd)
    acc_t* dk_acc = dq_acc + g.T * g.hd;          // (block_k, hd)
    acc_t* dv_acc = dk_acc + kBwdBlockK * g.hd;      // (block_k, hd)

    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / g.H;
      const int64_t h = bh % g.H;
      const auto seq = qkv.select(0, b);       // (T, 3 * dim)
      const auto dout = grad_out.select(0, b);  // (T, dim)
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
        const at::Tensor k32 = kReduced<scalar_t> && !dot_bf16 ? tile(k_wide, bk, g.hd).copy_(k) : at::Tensor();
        const at::Tensor v32 = kReduced<scalar_t> && !dot_bf16 ? tile(v_wide, bk, g.hd).copy_(v) : at::Tensor();
        std::fill(dk_acc, dk_acc + bk * g.hd, acc_t(0));
        std::fill(dv_acc, dv_acc + bk * g.hd, acc_t(0));

        for (int64_t q0 = (k0 / kBwdBlockQ) * kBwdBlockQ; q0 < g.T; q0 += kBwdBlockQ) {
          const int64_t bq = std::min(g.T, q0 + kBwdBlockQ) - q0;
          // Query rows r0..r1 of the block against the first `cols` keys of the key block.
          const auto grad_tile = [&](int64_t r0, int64_t r1, int64_t cols) {
            const int64_t rows = r1 - r0;
            const auto q = seq.narrow(0, q0 + r0, rows).narrow(1, h * g.hd, g.hd);   // (rows, hd)
            const auto dO = dout.narrow(0, q0 + r0, rows).narrow(1, h * g.hd, g.hd);  // (rows, hd)
            const auto kc = k.narrow(0, 0, cols);                                       // (cols, hd)
            at::Tensor p = tile(p_ws, rows, cols);                                      // (rows, cols)
            at::Tensor dp = tile(dp_ws, rows, cols);                                    // (rows, cols)
            const int64_t causal_offset = (k0 + cols - 1 > q0 + r0) ? q0 + r0 - k0 : tile::kNoCausal;
            const acc_t* lse_rows = lse_ptr + bh * g.T + q0 + r0;
            const acc_t* delta_rows = delta_ptr + (b * g.T + q0 + r0) * g.H + h;
            if constexpr (kReduced<scalar_t>) {
              const auto& ops32 = tile::tile_ops<float>();
              at::Tensor p32 = tile(p_wide, rows, cols);
              at::Tensor dp32 = tile(dp_wide, rows, cols);
              if (dot_bf16) {
                ops.bf16_scores(q.data_ptr<scalar_t>(), q.stride(0), kc.data_ptr<scalar_t>(), kc.stride(0), rows, cols,
                                g.hd, p32.data_ptr<float>(), cols, pack_ptr);
              } else {
                at::mm_out(p32, tile(q_wide, rows, g.hd).copy_(q), k32.narrow(0, 0, cols).t());
              }
              ops32.probabilities(p32.data_ptr<float>(), cols, rows, cols, scale, causal_offset, key_mask, lse_rows);
              p.copy_(p32);
              accumulate_product(dv_acc, g.hd, p.t(), dO, tmp_ws, ops);  // dV += P^T dO
              if (dot_bf16) {  // dP = dO V^T
                const auto vc = v.narrow(0, 0, cols);
                ops.bf16_scores(dO.data_ptr<scalar_t>(), dO.stride(0), vc.data_ptr<scalar_t>(), vc.stride(0), rows, cols,
                                g.hd, dp32.data_ptr<float>(), cols, pack_ptr);
              } else {
                at::mm_out(dp32, tile(do_wide, rows, g.hd).copy_(dO), v32.narrow(0, 0, cols).t());
              }
              ops32.score_grad(dp32.data_ptr<float>(), p32.data_ptr<float>(), cols, rows, cols, scale, delta_rows,
                               g.H);  // dS = scale * P (dP - delta)
              dp.copy_(dp32);
            } else {
              at::mm_out(p, q, kc.t());
              ops.probabilities(p.data_ptr<scalar_t>(), cols, rows, cols, scale, causal_offset, key_mask, lse_rows);
              accumulate_product(dv_acc, g.hd, p.t(), dO, tmp_ws, ops);  // dV += P^T dO
              at::mm_out(dp, dO, v.narrow(0, 0, cols).t());               // dP = dO V^T
              ops.score_grad(dp.data_ptr<scalar_t>(), p.data_ptr<scalar_t>(), cols, rows, cols, scale, delta_rows,
                             g.H);  // dS = scale * P (dP - delta)
            }
            accumulate_product(dq_acc + (q0 + r0) * g.hd, g.hd, dp, kc, tmp_ws, ops);  // dQ += dS K
            accumulate_product(dk_acc, g.hd, dp.t(), q, tmp_ws, ops);                  // dK += dS^T Q
          };
          if (k0 + bk - 1 <= q0) {  // below the diagonal: every row sees every key
            grad_tile(0, bq, bk);
            continue;
          }
          for (int64_t r0 = 0; r0 < bq; r0 += diagonal_rows<scalar_t>()) {  // on the diagonal, as in the forward
            const int64_t r1 = std::min(bq, r0 + diagonal_rows<scalar_t>());
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

// The kernels read rows by stride; the last dimension must be dense.
at::Tensor dense_rows(const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

std::optional<at::Tensor> contiguous_mask(const std::optional<at::Tensor>& mask) {
  return mask.has_value() ? std::optional<at::Tensor>(mask->contiguous()) : std::nullopt;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& qkv_in,
                                                         const std::optional<at::Tensor>& mask_in,
                                                         int64_t n_heads) {
  check_cpu_inputs(qkv_in, mask_in, n_heads);
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
    forward_impl<scalar_t>(qkv, mask, g, out, lse);
  });
  return {out, lse};
}

at::Tensor attention_backward_cpu(const at::Tensor& grad_out_in, const at::Tensor& qkv_in,
                                  const std::optional<at::Tensor>& mask_in, const at::Tensor& out,
                                  const at::Tensor& lse, int64_t n_heads) {
  check_cpu_inputs(qkv_in, mask_in, n_heads);
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
    backward_impl<scalar_t>(grad_out, qkv, mask, out.contiguous(), lse.contiguous(), g, grad_qkv);
  });
  return grad_qkv;
}

}  // namespace causal_attention::kernels
