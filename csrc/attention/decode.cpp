// Decode attention: a few new queries per sequence against a static KV cache.
//
// The cache holds, per sequence b, keys and values at positions 0..end[b]-1 (B, H, max_len, hd).
// New query i of sequence b (its token sits at position start[b] + i) attends cache positions
// j <= min(start[b] + i, end[b] - 1): the cache plus the new tokens up to itself (causal alignment
// to the bottom right), and never a position at or past end[b] (padding, or stale entries).
//
// Up to kDecodeFewRows new queries stream the cache row by row. Work items are (batch, head, split):
// when the batch is small the context of each sequence is split into parts (flash-decoding) and the
// partial softmax states are merged at the end. The number of parts depends on the shapes only, never
// on the thread count, so results are bitwise the same for any number of threads, and so is the
// scratch memory. More new queries (a prompt, a chunk of one) take the tiled forward of
// attention_heads_forward_cpu over the cache's keys.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "causal_attention/attention.h"
#include "config.h"
#include "decode_merge.h"
#include "linear/few_rows.h"
#include "schedule.h"
#include "cpu/tile_ops.h"
#include "tile_products.h"

namespace causal_attention::kernels {
namespace {

// Keys per decode_chunk call: kDecodeStreamBytes of keys and values, and at least a tile's.
inline int64_t stream_keys(int64_t hd, int64_t itemsize) {
  return std::max(kDecodeChunk, kDecodeStreamBytes / (2 * std::max<int64_t>(hd, 1) * itemsize));
}
constexpr int64_t kLine = 64;  // bytes per cache line
inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

void check_cache(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& start, const at::Tensor& end, int64_t n_heads, int64_t n_kv_heads) {
  check_qkv(qkv, n_heads, n_kv_heads);
  const int64_t B = qkv.size(0);
  const int64_t hd = qkv.size(2) / (n_heads + 2 * n_kv_heads);
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(0) == B && k_cache.size(1) == n_kv_heads &&
                        k_cache.size(3) == hd,
                    "k_cache must have shape (B, n_kv_heads, max_len, head_dim) = (", B, ", ", n_kv_heads,
                    ", max_len, ", hd, "); got ", k_cache.sizes());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache must have the shape of k_cache ", k_cache.sizes(),
                    "; got ", v_cache.sizes());
  TORCH_CHECK_TYPE(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
                   "the KV cache dtype (k_cache ", k_cache.scalar_type(), ", v_cache ", v_cache.scalar_type(),
                   ") must match the input's (", qkv.scalar_type(), ")");
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

// Writes the keys and values of the real new tokens of a contiguous qkv (B, t, (H + 2 Hkv) * hd) into
// the cache (B, Hkv, max_len, hd), one (batch, key/value head) at a time.
template <typename scalar_t>
class CacheRows {
 public:
  CacheRows(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* start,
            const int64_t* end, int64_t n_heads, int64_t n_kv_heads)
      : src_(qkv.const_data_ptr<scalar_t>()),
        k_(k_cache.data_ptr<scalar_t>()),
        v_(v_cache.data_ptr<scalar_t>()),
        start_(start),
        end_(end),
        B_(qkv.size(0)),
        t_(qkv.size(1)),
        width_(qkv.size(2)),
        H_(n_kv_heads),
        hd_(width_ / (n_heads + 2 * n_kv_heads)),
        dim_(n_heads * hd_),
        max_len_(k_cache.size(2)) {}

  // Every sequence's new tokens of every head (write(b, h) for each, in parallel).
  void write_all() const {
    at::parallel_for(0, B_ * H_, 1, [&](int64_t begin, int64_t end_bh) {
      for (int64_t bh = begin; bh < end_bh; ++bh) {
        write(bh / H_, bh % H_);
      }
    });
  }

  // Sequence b's new tokens start[b] .. end[b] - 1 (the real ones only) of head h.
  void write(int64_t b, int64_t h) const {
    for (int64_t i = 0; i < end_[b] - start_[b]; ++i) {
      const scalar_t* row = src_ + (b * t_ + i) * width_;
      const int64_t pos = ((b * H_ + h) * max_len_ + start_[b] + i) * hd_;
      const scalar_t* k = row + dim_ + h * hd_;  // key/value head h of the row's k | v parts
      std::copy(k, k + hd_, k_ + pos);
      std::copy(k + H_ * hd_, k + H_ * hd_ + hd_, v_ + pos);
    }
  }

 private:
  const scalar_t* src_;
  scalar_t* k_;
  scalar_t* v_;
  const int64_t* start_;
  const int64_t* end_;
  const int64_t B_, t_, width_, H_, hd_, dim_, max_len_;  // H_: key/value heads; dim_: q's part of a row
};

}  // namespace

void kv_cache_write_cpu(const at::Tensor& qkv_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& start_in, const at::Tensor& end_in, int64_t n_heads,
                        std::optional<int64_t> n_kv_heads_in) {
  const int64_t n_kv_heads = n_kv_heads_in.value_or(n_heads);
  check_cache(qkv_in, k_cache, v_cache, start_in, end_in, n_heads, n_kv_heads);
  const auto qkv = qkv_in.contiguous();
  const auto start = start_in.contiguous();
  const auto end = end_in.contiguous();
  const int64_t t = qkv.size(1);
  check_cache_positions(start, end, t, k_cache.size(2));
  const int64_t* start_ptr = start.data_ptr<int64_t>();
  const int64_t* end_ptr = end.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "kv_cache_write", [&] {
    CacheRows<scalar_t>(qkv, k_cache, v_cache, start_ptr, end_ptr, n_heads, n_kv_heads).write_all();
  });
}

namespace {

// One thread's scratch, reused by every work item of its chunk.
template <typename scalar_t>
struct DecodeWorkspace {
  using acc_t = at::opmath_type<scalar_t>;
  explicit DecodeWorkspace(int64_t hd)
      : pv(hd), q(kDecodeFewRows * hd), buf(tile::kDecodeGroupRows * stream_keys(hd, sizeof(scalar_t))) {}
  std::vector<acc_t> pv;   // merge_rows' output row
  std::vector<acc_t> q;    // the few queries, widened to acc_t
  std::vector<acc_t> buf;  // the few rows' scores
};

template <typename scalar_t>
class DecodePass {
 public:
  using acc_t = at::opmath_type<scalar_t>;

  // out: (B, t, dim), written by run(); t <= kDecodeFewRows.
  DecodePass(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* start,
             const int64_t* end, int64_t n_heads, int64_t n_kv_heads, scalar_t* out)
      : B_(qkv.size(0)),
        t_(qkv.size(1)),
        hd_(qkv.size(2) / (n_heads + 2 * n_kv_heads)),
        dim_(n_heads * hd_),
        H_(n_heads),
        group_(n_heads / n_kv_heads),
        max_len_(k_cache.size(2)),
        ld_q_(row_stride(qkv)),
        q_(qkv.const_data_ptr<scalar_t>()),
        batch_stride_(qkv.stride(0)),
        k_cache_(k_cache.const_data_ptr<scalar_t>()),
        v_cache_(v_cache.const_data_ptr<scalar_t>()),
        start_(start),
        end_(end),
        scale_(acc_t(1) / std::sqrt(static_cast<acc_t>(hd_))),
        // A small batch: split each context into parts, from the shapes alone (so the result and the
        // scratch size never depend on the thread count).
        n_split_(std::clamp<int64_t>(ceil_div(kDecodeItems, B_ * H_), 1,
                                     std::max<int64_t>(1, ceil_div(max_len_, kDecodeChunk)))),
        // Partial softmax states of every split: output (t, hd), max and sum (t).
        state_stride_(round_up(t_ * (hd_ + 2), kLine / static_cast<int64_t>(sizeof(acc_t)))),
        partial_(static_cast<size_t>(B_ * H_ * n_split_ * state_stride_ + kLine / sizeof(acc_t))),
        states_(line_aligned(partial_.data())),
        out_(out) {
    TORCH_INTERNAL_ASSERT(t_ <= kDecodeFewRows, "DecodePass streams up to ", kDecodeFewRows, " new queries; got ", t_);
  }
  DecodePass(const DecodePass&) = delete;  // states_ points into partial_
  DecodePass& operator=(const DecodePass&) = delete;

  void run() {
    // Items taken one at a time, the longest contexts first: a thread that streams slower (a busy
    // core of a shared machine) takes fewer, where a static split left the other waiting at the end.
    const auto order = costliest_first(items(), [&](int64_t item) { return cost_of(item); });
    run_items(
        order, [&] { return DecodeWorkspace<scalar_t>(hd_); },
        [&](int64_t item, DecodeWorkspace<scalar_t>& ws) { split(item, ws); });
    merge();
  }

 private:
  // The work items, (batch, head, split) numbered as ((b * H) + h) * splits + split, and the
  // cost of each (its sequence's context).
  int64_t items() const { return B_ * H_ * n_split_; }
  int64_t cost_of(int64_t item) const { return end_[item / n_split_ / H_]; }

  // Work item (batch, head, split): the split's share of the context, in whole chunks, into its
  // partial softmax state. An item that is its (batch, head)'s only split writes its output rows
  // too, as merge() would (one parallel pass fewer: ~13 us of a decode step with the caches cold).
  void split(int64_t item, DecodeWorkspace<scalar_t>& ws) {
    const int64_t bh = item / n_split_, sp = item % n_split_;
    const int64_t b = bh / H_, h = bh % H_;
    acc_t* o = state(item);
    acc_t* m = o + t_ * hd_;
    acc_t* l = m + t_;
    std::fill(o, o + t_ * hd_, acc_t(0));
    std::fill(m, m + t_, -std::numeric_limits<acc_t>::infinity());
    std::fill(l, l + t_, acc_t(0));
    const int64_t chunks = ceil_div(end_[b], kDecodeChunk);
    const int64_t ks = std::min(end_[b], (chunks * sp / n_split_) * kDecodeChunk);
    const int64_t ke = std::min(end_[b], (chunks * (sp + 1) / n_split_) * kDecodeChunk);
    const scalar_t* q = q_ + b * batch_stride_ + h * hd_;  // (t, hd), ld ld_q_
    const int64_t bg = b * (H_ / group_) + h / group_;      // its key/value head
    const scalar_t* keys = k_cache_ + bg * max_len_ * hd_;   // (max_len, hd)
    const scalar_t* values = v_cache_ + bg * max_len_ * hd_;
    few_rows(b, q, keys, values, ks, ke, o, m, l, ws);
    if (n_split_ == 1) {
      merge_rows(bh, ws.pv.data());
    }
  }

  // The splits of each (batch, head) merged: out = sum_s O_s e^(m_s - M) / sum_s l_s e^(m_s - M).
  // After every item's split(); nothing to do where each (batch, head) is one split (split() wrote it).
  void merge() {
    if (n_split_ == 1) {
      return;
    }
    at::parallel_for(0, B_ * H_, 1, [&](int64_t begin, int64_t end_bh) {
      std::vector<acc_t> merged(hd_);
      for (int64_t bh = begin; bh < end_bh; ++bh) {
        merge_rows(bh, merged.data());
      }
    });
  }

  // The output rows of (batch, head) bh from its splits' states (merged: hd_ values of scratch).
  void merge_rows(int64_t bh, acc_t* merged) {
    const int64_t b = bh / H_, h = bh % H_;
    const auto split_state = [&](int64_t sp) -> const acc_t* { return state(bh * n_split_ + sp); };
    for (int64_t i = 0; i < t_; ++i) {
      merge_split_row(split_state, n_split_, t_, hd_, i, merged, out_ + (b * t_ + i) * dim_ + h * hd_);
    }
  }

  // A few queries: stream each cached key and value row once per query (memory bound).
  void few_rows(int64_t b, const scalar_t* q, const scalar_t* keys, const scalar_t* values, int64_t ks, int64_t ke,
                acc_t* o, acc_t* m, acc_t* l, DecodeWorkspace<scalar_t>& ws) const {
    for (int64_t i = 0; i < t_; ++i) {
      for (int64_t d = 0; d < hd_; ++d) {
        ws.q[i * hd_ + d] = static_cast<acc_t>(q[i * ld_q_ + d]);
      }
    }
    const int64_t visible_end = std::min(ke, start_[b] + t_);
    const int64_t per_call = stream_keys(hd_, sizeof(scalar_t));
    for (int64_t k0 = ks; k0 < visible_end; k0 += per_call) {
      const int64_t cols = std::min(visible_end, k0 + per_call) - k0;
      tile::tile_ops<scalar_t>().decode_chunk(ws.q.data(), t_, keys + k0 * hd_, values + k0 * hd_, hd_, cols, hd_,
                                              scale_, start_[b] - k0, m, l, o, ws.buf.data());
    }
  }

  // Item's partial state, in whole cache lines of its own: items that two threads ran side by side
  // wrote into each other's lines (float32, B=8, H=12, one key each, caches warm, 2 threads: the op
  // took 22-44 us, 19-20 us with the lines apart, as one thread took).
  acc_t* state(int64_t item) { return states_ + item * state_stride_; }

  // The first cache-line boundary at or after p (partial_ holds a line's worth of slack for it).
  static acc_t* line_aligned(acc_t* p) {
    const auto address = reinterpret_cast<uintptr_t>(p);
    return reinterpret_cast<acc_t*>((address + kLine - 1) & ~static_cast<uintptr_t>(kLine - 1));
  }

  const int64_t B_, t_, hd_, dim_, H_, group_, max_len_, ld_q_;  // dim_: H * hd, a row of out; group_: H / Hkv
  const scalar_t* q_;  // qkv: row t of sequence b at q_ + b * batch_stride_ + t * ld_q_
  const int64_t batch_stride_;
  const scalar_t* k_cache_;  // (B, Hkv, max_len, hd)
  const scalar_t* v_cache_;
  const int64_t* start_;
  const int64_t* end_;
  const acc_t scale_;
  const int64_t n_split_;
  const int64_t state_stride_;  // acc_t per item's state: t (hd + 2), rounded up to whole cache lines
  std::vector<acc_t> partial_;
  acc_t* const states_;  // item 0's state: partial_'s first cache-line boundary
  scalar_t* const out_;  // (B, t, dim)
};

// More than kDecodeFewRows new queries of qkv (B, t, (H + 2 Hkv) * hd) against the cache (B, Hkv, max_len, hd),
// as DecodePass's contract says: (B, t, dim). The tiled forward puts query i at key Tk - t + i, so each
// sequence's keys are its cache up to start + t (padded with masked zero keys where that passes max_len),
// and keys at or past end are masked off. One call where every sequence starts at the same position.
at::Tensor attend_many(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& start, const at::Tensor& end, int64_t n_heads, int64_t n_kv_heads) {
  const int64_t B = qkv.size(0), t = qkv.size(1), max_len = k_cache.size(2);
  const auto q = std::get<0>(split_heads(qkv, n_heads, n_kv_heads));  // (B, H, t, hd)
  const int64_t* s = start.const_data_ptr<int64_t>();
  const int64_t* e = end.const_data_ptr<int64_t>();
  // Sequences b0 .. b0 + n - 1, all starting at s[b0]: (n, t, H, hd).
  const auto attend = [&](int64_t b0, int64_t n) {
    const int64_t keys = s[b0] + t;
    const auto cached = [&](const at::Tensor& cache) {
      const auto rows = cache.narrow(0, b0, n).narrow(2, 0, std::min(keys, max_len));
      return keys > max_len ? at::constant_pad_nd(rows, {0, 0, 0, keys - max_len}) : rows;
    };
    std::optional<at::Tensor> mask;
    if (std::any_of(e + b0, e + b0 + n, [&](int64_t end_b) { return end_b < keys; })) {
      mask = at::arange(keys, end.options()).unsqueeze(0) < end.narrow(0, b0, n).unsqueeze(1);  // (n, keys)
    }
    return std::get<0>(attention_heads_forward_cpu(q.narrow(0, b0, n), cached(k_cache), cached(v_cache), mask));
  };
  if (std::all_of(s, s + B, [&](int64_t start_b) { return start_b == s[0]; })) {
    return attend(0, B).view({B, t, -1});
  }
  auto out = at::empty({B, t, q.size(1) * q.size(3)}, qkv.options());
  for (int64_t b = 0; b < B; ++b) {
    out.narrow(0, b, 1).copy_(attend(b, 1).view({1, t, -1}));
  }
  return out;
}

}  // namespace

at::Tensor decode_attention_cpu(const at::Tensor& qkv_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& start_in, const at::Tensor& end_in, int64_t n_heads,
                                std::optional<int64_t> n_kv_heads_in) {
  const int64_t n_kv_heads = n_kv_heads_in.value_or(n_heads);
  check_cache(qkv_in, k_cache, v_cache, start_in, end_in, n_heads, n_kv_heads);
  const auto qkv = blas_rows(qkv_in);
  const auto start = start_in.contiguous();
  const auto end = end_in.contiguous();
  const int64_t B = qkv.size(0), t = qkv.size(1), max_len = k_cache.size(2);
  const int64_t dim = n_heads * (qkv.size(2) / (n_heads + 2 * n_kv_heads));
  check_cache_positions(start, end, t, max_len);
  const int64_t* s = start.data_ptr<int64_t>();
  const int64_t* e = end.data_ptr<int64_t>();
  if (t > kDecodeFewRows && B * dim > 0) {
    return attend_many(qkv, k_cache, v_cache, start, end, n_heads, n_kv_heads);
  }
  auto out = at::empty({B, t, dim}, qkv.options());
  if (out.numel() == 0) {
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "decode_attention", [&] {
    DecodePass<scalar_t>(qkv, k_cache, v_cache, s, e, n_heads, n_kv_heads, out.data_ptr<scalar_t>()).run();
  });
  return out;
}

namespace {

void check_layer_weights(const at::Tensor& x, const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias,
                         const at::Tensor& proj_weight, const std::optional<at::Tensor>& proj_bias, int64_t n_heads,
                         int64_t n_kv_heads) {
  TORCH_CHECK_VALUE(n_heads > 0, "decode_layer: n_heads must be positive; got ", n_heads);
  TORCH_CHECK_VALUE(n_kv_heads > 0 && n_heads % n_kv_heads == 0,
                    "decode_layer: n_kv_heads must be positive and divide n_heads (", n_heads, "); got ", n_kv_heads);
  TORCH_CHECK_VALUE(x.dim() == 3, "decode_layer: x must be 3-D (B, t, dim); got shape ", x.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "decode_layer: x must be a floating-point tensor; got dtype ",
                   x.scalar_type());
  const int64_t dim = x.size(2);
  TORCH_CHECK_VALUE(dim > 0 && dim % n_heads == 0, "decode_layer: x's last dimension (dim, got ", dim,
                    ") must be a positive multiple of n_heads (got ", n_heads, ")");
  const auto check = [&](const at::Tensor& t, const char* name, at::IntArrayRef shape) {
    TORCH_CHECK_VALUE(t.sizes() == shape, "decode_layer: ", name, " must have shape ", shape, " for dim=", dim,
                      "; got ", t.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(), "decode_layer: ", name, " dtype (", t.scalar_type(),
                     ") must match x's (", x.scalar_type(), ")");
    TORCH_CHECK_VALUE(t.device() == x.device(), "decode_layer: ", name, " must be on x's device (", x.device(),
                      "); got ", t.device());
  };
  const int64_t width = (n_heads + 2 * n_kv_heads) * (dim / n_heads);  // q | k | v
  check(qkv_weight, "qkv_weight", {width, dim});
  check(proj_weight, "proj_weight", {dim, dim});
  if (qkv_bias.has_value()) {
    check(*qkv_bias, "qkv_bias", {width});
  }
  if (proj_bias.has_value()) {
    check(*proj_bias, "proj_bias", {dim});
  }
}

}  // namespace

at::Tensor decode_layer_cpu(const at::Tensor& x_in, const at::Tensor& qkv_weight,
                            const std::optional<at::Tensor>& qkv_bias, const at::Tensor& proj_weight,
                            const std::optional<at::Tensor>& proj_bias, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& lengths,
                            const std::optional<at::Tensor>& key_padding_mask, int64_t n_heads,
                            std::optional<int64_t> n_kv_heads_in) {
  const int64_t n_kv_heads = n_kv_heads_in.value_or(n_heads);
  check_layer_weights(x_in, qkv_weight, qkv_bias, proj_weight, proj_bias, n_heads, n_kv_heads);
  TORCH_CHECK_VALUE(x_in.device().is_cpu(), "decode_layer takes CPU tensors; got x on ", x_in.device());
  const int64_t B = x_in.size(0), t = x_in.size(1), dim = x_in.size(2);
  const int64_t width = qkv_weight.size(0);
  auto qkv = at::empty({B, t, width}, x_in.options());  // the projections
  check_cache(qkv, k_cache, v_cache, lengths, lengths, n_heads, n_kv_heads);
  // lengths is written last: refuse what could fail there before anything is written.
  TORCH_CHECK_VALUE(at::has_internal_overlap(lengths) != at::MemOverlap::Yes,
                    "decode_layer: lengths is written in place and must not be an expanded view (its elements "
                    "overlap in memory); got strides ", lengths.strides());
  const auto start = lengths.contiguous();
  const int64_t* s = start.data_ptr<int64_t>();
  // The lengths after the step, checked (right padding, room): without a mask, computed and checked
  // here (cache_end's tensor ops cost a decode step ~30 us with the caches cold, as a step runs).
  std::vector<int64_t> end(B);
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const auto end_t = cache_end(start, key_padding_mask, t, k_cache.size(2)).contiguous();
    std::copy_n(end_t.const_data_ptr<int64_t>(), B, end.begin());
  } else {
    for (int64_t b = 0; b < B; ++b) {  // wrapping as ATen's add did (a length near 2^63 fails the check)
      end[b] = static_cast<int64_t>(static_cast<uint64_t>(s[b]) + static_cast<uint64_t>(t));
    }
    check_cache_positions(s, end.data(), B, t, k_cache.size(2));
  }
  // lengths = end, written in place last (a 1-D int64 CPU tensor of B elements without overlap,
  // checked above); through its data where lengths.copy_ cost another op call. Like the cache's
  // keys and values, not through an in-place op: its version counter is not bumped here (through
  // the dispatcher, the op's mutable schema stands for the write, and copy_ did not bump it there).
  const auto advance = [&] {
    int64_t* l = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      l[b * lengths.stride(0)] = end[b];
    }
  };
  auto heads = at::empty({B, t, dim}, x_in.options());
  if (heads.numel() == 0) {
    advance();
    return heads;
  }
  const int64_t* e = end.data();
  // The steps of few_rows_linear_cpu, kv_cache_write_cpu and decode_attention_cpu, each a parallel
  // pass of its own (so that each streams its weight or cache unbroken), in one op call.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x_in.scalar_type(), "decode_layer", [&] {
    // (The pass, whose state it allocates, is made before the cache is written: nothing is written
    // where that fails.)
    std::optional<DecodePass<scalar_t>> pass;
    if (t <= kDecodeFewRows) {
      pass.emplace(qkv, k_cache, v_cache, s, e, n_heads, n_kv_heads, heads.data_ptr<scalar_t>());
    }
    FewRowsProduct<scalar_t>(x_in.reshape({B * t, dim}), qkv_weight, qkv_bias).all(qkv.data_ptr<scalar_t>(), width);
    CacheRows<scalar_t>(qkv, k_cache, v_cache, s, e, n_heads, n_kv_heads).write_all();
    if (pass) {
      pass->run();
    } else {
      heads = attend_many(qkv, k_cache, v_cache, start, at::from_blob(end.data(), {B}, at::kLong), n_heads, n_kv_heads);
    }
  });
  auto out = few_rows_linear_cpu(heads, proj_weight, proj_bias);
  advance();
  return out;
}

}  // namespace causal_attention::kernels
