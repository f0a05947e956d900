// Decode attention: a few new queries per sequence against a static KV cache.
//
// The cache holds, per sequence b, keys and values at positions 0..end[b]-1 (B, H, max_len, hd).
// New query i of sequence b (its token sits at position start[b] + i) attends cache positions
// j <= min(start[b] + i, end[b] - 1): the cache plus the new tokens up to itself (causal alignment
// to the bottom right), and never a position at or past end[b] (padding, or stale entries).
//
// Work items are (batch, head, split): when the batch is small the context of each sequence is
// split into parts (flash-decoding) and the partial softmax states are merged at the end. The number
// of parts depends on the shapes only, never on the thread count, so results are bitwise the same
// for any number of threads, and so is the scratch memory.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "causal_attention/attention.h"
#include "tensor_tiles.h"
#include "tile_ops.h"

namespace causal_attention::kernels {
namespace {

constexpr int64_t kDecodeChunk = 256;  // keys per tile
constexpr int64_t kDecodeRows = 64;    // new queries per tile
constexpr int64_t kDecodeFewRows = 16;  // up to this many new queries: row-wise streaming, no GEMM
constexpr int64_t kDecodeItems = 64;    // few new queries: split contexts until B * H * splits reaches this

void check_cache(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& start, const at::Tensor& end, int64_t n_heads) {
  check_qkv(qkv, n_heads);
  const int64_t B = qkv.size(0);
  const int64_t hd = qkv.size(2) / 3 / n_heads;
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(0) == B && k_cache.size(1) == n_heads &&
                        k_cache.size(3) == hd,
                    "k_cache must have shape (B, H, max_len, head_dim) = (", B, ", ", n_heads, ", max_len, ", hd,
                    "); got ", k_cache.sizes());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache must have the shape of k_cache ", k_cache.sizes(),
                    "; got ", v_cache.sizes());
  TORCH_CHECK_TYPE(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
                   "the KV cache dtype (", k_cache.scalar_type(), ") must match the input's (", qkv.scalar_type(),
                   ")");
  TORCH_CHECK_VALUE(k_cache.device() == qkv.device() && v_cache.device() == qkv.device() &&
                        start.device() == qkv.device(),
                    "the KV cache must be on the input's device (", qkv.device(), ")");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache buffers must be contiguous");
  TORCH_CHECK_TYPE(start.scalar_type() == at::kLong && start.dim() == 1 && start.size(0) == B,
                   "cache lengths must be an int64 tensor of shape (B,) = (", B, ",); got ", start.scalar_type(),
                   " of shape ", start.sizes());
  TORCH_CHECK_TYPE(end.scalar_type() == at::kLong && end.sizes() == start.sizes(),
                   "cache ends must be an int64 tensor of shape (B,) = (", B, ",); got ", end.scalar_type(),
                   " of shape ", end.sizes());
  TORCH_CHECK_VALUE(end.device() == qkv.device(), "cache ends must be on the input's device (", qkv.device(), ")");
}

}  // namespace

void kv_cache_write_cpu(const at::Tensor& qkv_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& start_in, const at::Tensor& end_in, int64_t n_heads) {
  check_cache(qkv_in, k_cache, v_cache, start_in, end_in, n_heads);
  const auto qkv = qkv_in.contiguous();
  const auto start = start_in.contiguous();
  const auto end = end_in.contiguous();
  const int64_t B = qkv.size(0), t = qkv.size(1), dim = qkv.size(2) / 3, hd = dim / n_heads;
  const int64_t max_len = k_cache.size(2);
  check_cache_positions(start, end, t, max_len);
  const int64_t* start_ptr = start.data_ptr<int64_t>();
  const int64_t* end_ptr = end.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "kv_cache_write", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, B * n_heads, 1, [&](int64_t begin, int64_t end_bh) {
      for (int64_t bh = begin; bh < end_bh; ++bh) {
        const int64_t b = bh / n_heads, h = bh % n_heads;
        for (int64_t i = 0; i < end_ptr[b] - start_ptr[b]; ++i) {  // the real new tokens only
          const scalar_t* row = src + (b * t + i) * 3 * dim;
          const int64_t pos = (bh * max_len + start_ptr[b] + i) * hd;
          std::copy(row + dim + h * hd, row + dim + (h + 1) * hd, kc + pos);
          std::copy(row + 2 * dim + h * hd, row + 2 * dim + (h + 1) * hd, vc + pos);
        }
      }
    });
  });
}

namespace {

template <typename scalar_t>
void decode_impl(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* start,
                 const int64_t* end, int64_t n_heads, const at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto& ops = tile::tile_ops<scalar_t>();   // streaming decode; conversions to the input type
  const auto& acc_ops = tile::tile_ops<acc_t>();  // the tiles of the GEMM path, in acc_t
  const int64_t B = qkv.size(0), t = qkv.size(1), dim = qkv.size(2) / 3, H = n_heads, hd = dim / H;
  const int64_t max_len = k_cache.size(2);
  const acc_t scale = acc_t(1) / std::sqrt(static_cast<acc_t>(hd));
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;

  // A few new queries of a small batch: split each context into parts, from the shapes alone (so the
  // result and the scratch size never depend on the thread count). Part p of sequence b covers
  // whole chunks of its own context.
  const int64_t n_split = t <= kDecodeFewRows ? std::clamp<int64_t>(ceil_div(kDecodeItems, B * H), 1,
                                                                     ceil_div(max_len, kDecodeChunk))
                                              : 1;
  const int64_t n_items = B * H * n_split;
  // Partial softmax states of every split: output (t, hd), max and sum (t).
  const at::Tensor partial = at::empty({n_items, t * (hd + 2)}, qkv.options().dtype(acc_dtype));
  acc_t* partial_ptr = partial.data_ptr<acc_t>();

  at::parallel_for(0, n_items, 1, [&](int64_t item_begin, int64_t item_end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor scores = at::empty({kDecodeRows * kDecodeChunk}, qkv.options().dtype(acc_dtype));
    const at::Tensor pv = at::empty({kDecodeRows * hd}, qkv.options().dtype(acc_dtype));
    const at::Tensor scratch =
        at::empty({kDecodeRows + kDecodeChunk + kDecodeFewRows * hd}, qkv.options().dtype(acc_dtype));
    acc_t* alpha = scratch.data_ptr<acc_t>();
    acc_t* buf = alpha + kDecodeRows;
    acc_t* q_acc = buf + kDecodeChunk;  // the few queries, widened to acc_t
    for (int64_t item = item_begin; item < item_end; ++item) {
      const int64_t bh = item / n_split, split = item % n_split;
      const int64_t b = bh / H, h = bh % H;
      acc_t* o_acc = partial_ptr + item * t * (hd + 2);
      acc_t* m = o_acc + t * hd;
      acc_t* l = m + t;
      std::fill(o_acc, o_acc + t * hd, acc_t(0));
      std::fill(m, m + t, -std::numeric_limits<acc_t>::infinity());
      std::fill(l, l + t, acc_t(0));
      // This split's share of the context, in whole chunks.
      const int64_t chunks = (end[b] + kDecodeChunk - 1) / kDecodeChunk;
      const int64_t ks = std::min(end[b], (chunks * split / n_split) * kDecodeChunk);
      const int64_t ke = std::min(end[b], (chunks * (split + 1) / n_split) * kDecodeChunk);
      const auto keys = k_cache.select(0, b).select(0, h);    // (max_len, hd)
      const auto values = v_cache.select(0, b).select(0, h);  // (max_len, hd)
      const auto queries = qkv.select(0, b).narrow(1, h * hd, hd);  // (t, hd)
      const scalar_t* keys_ptr = keys.data_ptr<scalar_t>();
      const scalar_t* values_ptr = values.data_ptr<scalar_t>();
      if (t <= kDecodeFewRows) {
        // A few queries: stream each cached key and value row once per query (memory bound).
        const scalar_t* q_ptr = qkv.data_ptr<scalar_t>() + b * qkv.stride(0) + h * hd;
        for (int64_t i = 0; i < t; ++i) {
          for (int64_t d = 0; d < hd; ++d) {
            q_acc[i * hd + d] = static_cast<acc_t>(q_ptr[i * qkv.stride(1) + d]);
          }
        }
        for (int64_t k0 = ks; k0 < std::min(ke, start[b] + t); k0 += kDecodeChunk) {
          const int64_t cols = std::min(std::min(ke, start[b] + t), k0 + kDecodeChunk) - k0;
          ops.decode_chunk(q_acc, t, keys_ptr + k0 * hd, values_ptr + k0 * hd, hd, cols, hd, scale, start[b] - k0, m,
                           l, o_acc, buf);
        }
        continue;
      }
      // More queries: tiles of GEMMs (as in the flash forward), every product in acc_t.
      const at::Tensor queries_acc = widened(queries);  // (t, hd)
      for (int64_t r0 = 0; r0 < t; r0 += kDecodeRows) {
        const int64_t rows = std::min(t, r0 + kDecodeRows) - r0;
        const int64_t visible_end = std::min(ke, start[b] + r0 + rows);  // causal: the row block's last query
        for (int64_t k0 = ks; k0 < visible_end; k0 += kDecodeChunk) {
          const int64_t cols = std::min(visible_end, k0 + kDecodeChunk) - k0;
          at::Tensor s = tile(scores, rows, cols);
          at::mm_out(s, queries_acc.narrow(0, r0, rows), widened(keys.narrow(0, k0, cols)).t());
          acc_ops.softmax_tile(s.data_ptr<acc_t>(), cols, rows, cols, scale, start[b] + r0 - k0, nullptr, m + r0,
                               l + r0, alpha, buf);
          ops.round_to_input(s.data_ptr<acc_t>(), cols, rows, cols);  // P as an input-type operand
          at::Tensor pv_tile = tile(pv, rows, hd);
          at::mm_out(pv_tile, s, widened(values.narrow(0, k0, cols)));
          acc_ops.rescale_add(o_acc + r0 * hd, hd, pv_tile.data_ptr<acc_t>(), hd, rows, hd, alpha);
        }
      }
    }
  });

  // Merge the splits of each (batch, head): out = sum_s O_s e^(m_s - M) / sum_s l_s e^(m_s - M).
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end_bh) {
    std::vector<acc_t> merged(hd);
    for (int64_t bh = begin; bh < end_bh; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      for (int64_t i = 0; i < t; ++i) {
        acc_t top = -std::numeric_limits<acc_t>::infinity();
        for (int64_t sp = 0; sp < n_split; ++sp) {
          top = std::max(top, partial_ptr[(bh * n_split + sp) * t * (hd + 2) + t * hd + i]);
        }
        scalar_t* o = out_ptr + (b * t + i) * dim + h * hd;
        if (top == -std::numeric_limits<acc_t>::infinity()) {  // no visible key: output 0
          std::fill(o, o + hd, scalar_t(0));
          continue;
        }
        std::fill(merged.begin(), merged.end(), acc_t(0));
        acc_t total = 0;
        for (int64_t sp = 0; sp < n_split; ++sp) {
          const acc_t* base = partial_ptr + (bh * n_split + sp) * t * (hd + 2);
          const acc_t w = std::exp(base[t * hd + i] - top);  // 0 for a split that saw no key
          total += base[t * hd + t + i] * w;
          for (int64_t d = 0; d < hd; ++d) {
            merged[d] += base[i * hd + d] * w;
          }
        }
        for (int64_t d = 0; d < hd; ++d) {
          o[d] = static_cast<scalar_t>(merged[d] / total);
        }
      }
    }
  });
}

}  // namespace

at::Tensor decode_attention_cpu(const at::Tensor& qkv_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& start_in, const at::Tensor& end_in, int64_t n_heads) {
  check_cache(qkv_in, k_cache, v_cache, start_in, end_in, n_heads);
  const auto qkv = qkv_in.stride(-1) == 1 ? qkv_in : qkv_in.contiguous();
  const auto start = start_in.contiguous();
  const auto end = end_in.contiguous();
  const int64_t B = qkv.size(0), t = qkv.size(1), dim = qkv.size(2) / 3, max_len = k_cache.size(2);
  check_cache_positions(start, end, t, max_len);
  const int64_t* s = start.data_ptr<int64_t>();
  const int64_t* e = end.data_ptr<int64_t>();
  auto out = at::empty({B, t, dim}, qkv.options());
  if (out.numel() == 0) {
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "decode_attention", [&] {
    decode_impl<scalar_t>(qkv, k_cache, v_cache, s, e, n_heads, out);
  });
  return out;
}

}  // namespace causal_attention::kernels
