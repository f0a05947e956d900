// A few queries over separate heads against a long past (transformers' decode step): the streaming
// decode kernel (tile_ops' decode_chunk) reading the cache's keys and values in place, once per key/value
// head for a single query (the group's query heads are its rows, read in groups of kDecodeGroupRows), once
// per query head for a few.
//
// q (B, H, Tq, hd) ends k, v (B, Hkv, Tk, hd) (query i at key position Tk - Tq + i). The key mask's holes
// (left padding, unfilled slots) split the keys into runs of real ones, each streamed on its own; the
// softmax state carries across runs. A window W starts query i's keys at its position - W + 1: the keys
// older than the last query's window (fewer than Tq) go row by row, the rest to the whole group.
//
// Work items are (batch, unit, split), a unit being a key/value head (one query) or a query head (a few):
// a small batch splits each context into parts of whole chunks, from the shapes alone, and merges their
// partial softmax states at the end (results and scratch never depend on the thread count).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "causal_attention/attention.h"
#include "config.h"
#include "decode_merge.h"
#include "decode_heads.h"
#include "schedule.h"
#include "cpu/tile_ops.h"
#include "tile_products.h"

namespace causal_attention::kernels {
namespace {

template <typename scalar_t>
class HeadsDecodePass {
 public:
  using acc_t = at::opmath_type<scalar_t>;

  HeadsDecodePass(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                  double scale, std::optional<int64_t> window, const at::Tensor& out, const at::Tensor& lse,
                  const at::Tensor& sinks)
      : B_(q.size(0)),
        H_(q.size(1)),
        Tq_(q.size(2)),
        hd_(q.size(3)),
        Hkv_(k.size(1)),
        Tk_(k.size(2)),
        group_(H_ / Hkv_),
        stacked_(Tq_ == 1),
        units_(stacked_ ? Hkv_ : H_),
        rows_(stacked_ ? group_ : Tq_),
        q_(q.const_data_ptr<scalar_t>()),
        k_(k.const_data_ptr<scalar_t>()),
        v_(v.const_data_ptr<scalar_t>()),
        qs_{q.stride(0), q.stride(1), q.size(2) <= 1 ? hd_ : q.stride(2)},
        ks_{k.stride(0), k.stride(1), k.size(2) <= 1 ? hd_ : k.stride(2)},
        vs_{v.stride(0), v.stride(1), ks_.t},
        mask_(mask.has_value() ? mask->const_data_ptr<bool>() : nullptr),
        scale_(static_cast<acc_t>(scale)),
        window_(window.value_or(Tk_)),
        first_key_(row_first_key(0)),
        group_key_(stacked_ ? first_key_ : row_first_key(Tq_ - 1)),
        n_split_(std::clamp<int64_t>(ceil_div(kDecodeItems, B_ * units_), 1,
                                     std::max<int64_t>(1, ceil_div(Tk_ - first_key_, kDecodeChunk)))),
        states_(B_ * units_ * n_split_ * rows_ * (hd_ + 2)),
        out_(out.data_ptr<scalar_t>()),
        lse_(lse.data_ptr<acc_t>()),
        sinks_(sinks.defined() ? sinks.const_data_ptr<acc_t>() : nullptr) {}

  void run() {
    run_items(
        costliest_first(B_ * units_ * n_split_, [](int64_t) { return int64_t{1}; }),
        [&] { return Workspace{std::vector<acc_t>(rows_ * hd_), std::vector<acc_t>(tile::kDecodeGroupRows * per_call())}; },
        [&](int64_t item, Workspace& ws) { split(item, ws); });
    at::parallel_for(0, B_ * units_, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> merged(hd_);
      for (int64_t bu = begin; bu < end; ++bu) {
        merge(bu, merged.data());
      }
    });
  }

 private:
  struct Strides {
    int64_t b, h, t;
  };
  struct Workspace {
    std::vector<acc_t> q;    // the item's query rows, widened: rows x hd
    std::vector<acc_t> buf;  // decode_chunk's scratch
  };

  int64_t per_call() const { return std::max(kDecodeChunk, kDecodeStreamBytes / (2 * hd_ * int64_t(sizeof(scalar_t)))); }
  acc_t* state(int64_t item) { return states_.data() + item * rows_ * (hd_ + 2); }  // o (rows x hd), m, l

  // The first key that query i sees (by the window; 0 without one).
  int64_t row_first_key(int64_t i) const { return std::max<int64_t>(0, Tk_ - Tq_ + i - window_ + 1); }

  // Query row r of unit u of sequence b: a query head of the group (stacked), or query r of head u.
  const scalar_t* query_row(int64_t b, int64_t u, int64_t r) const {
    return stacked_ ? q_ + b * qs_.b + (u * group_ + r) * qs_.h : q_ + b * qs_.b + u * qs_.h + r * qs_.t;
  }

  void split(int64_t item, Workspace& ws) {
    const int64_t bu = item / n_split_, sp = item % n_split_;
    const int64_t b = bu / units_, u = bu % units_;
    const int64_t kv = stacked_ ? u : u / group_;
    acc_t* o = state(item);
    acc_t* m = o + rows_ * hd_;
    acc_t* l = m + rows_;
    std::fill(o, o + rows_ * hd_, acc_t(0));
    std::fill(m, m + rows_, -std::numeric_limits<acc_t>::infinity());
    std::fill(l, l + rows_, acc_t(0));
    for (int64_t r = 0; r < rows_; ++r) {
      const scalar_t* row = query_row(b, u, r);
      for (int64_t d = 0; d < hd_; ++d) {
        ws.q[r * hd_ + d] = static_cast<acc_t>(row[d]);
      }
    }
    const int64_t chunks = ceil_div(Tk_ - first_key_, kDecodeChunk);
    const int64_t ks = first_key_ + (chunks * sp / n_split_) * kDecodeChunk;
    const int64_t ke = std::min(Tk_, first_key_ + (chunks * (sp + 1) / n_split_) * kDecodeChunk);
    const scalar_t* keys = k_ + b * ks_.b + kv * ks_.h;
    const scalar_t* values = v_ + b * vs_.b + kv * vs_.h;
    const bool* real = mask_ == nullptr ? nullptr : mask_ + b * Tk_;
    for (int64_t j = ks; j < ke;) {  // runs of real keys
      if (real != nullptr && !real[j]) {
        ++j;
        continue;
      }
      int64_t run_end = j + 1;
      while (run_end < ke && (real == nullptr || real[run_end])) {
        ++run_end;
      }
      // Keys older than the last query's window: each query row from its own window's first key.
      const int64_t older_end = std::min(run_end, group_key_);
      for (int64_t r = 0; r < rows_ && j < older_end; ++r) {
        const int64_t k0 = std::max(j, row_first_key(r));
        if (k0 < older_end) {
          tile::tile_ops<scalar_t>().decode_chunk(ws.q.data() + r * hd_, 1, keys + k0 * ks_.t, values + k0 * ks_.t,
                                                  ks_.t, older_end - k0, hd_, scale_, Tk_ - Tq_ + r - k0, m + r, l + r,
                                                  o + r * hd_, ws.buf.data());
        }
      }
      for (int64_t k0 = std::max(j, group_key_); k0 < run_end; k0 += per_call()) {
        const int64_t cols = std::min(run_end, k0 + per_call()) - k0;
        // Row r (stacked: every row at the last position) sees keys up to its position.
        const int64_t causal = stacked_ ? tile::kNoCausal : Tk_ - Tq_ - k0;
        tile::tile_ops<scalar_t>().decode_chunk(ws.q.data(), rows_, keys + k0 * ks_.t, values + k0 * ks_.t, ks_.t,
                                                cols, hd_, scale_, causal, m, l, o, ws.buf.data());
      }
      j = run_end;
    }
  }

  // The output rows and lse of (batch, unit) bu from its splits' states.
  void merge(int64_t bu, acc_t* merged) {
    const int64_t b = bu / units_, u = bu % units_;
    const auto split_state = [&](int64_t sp) -> const acc_t* { return state(bu * n_split_ + sp); };
    for (int64_t r = 0; r < rows_; ++r) {
      const int64_t h = stacked_ ? u * group_ + r : u;
      const int64_t i = stacked_ ? 0 : r;
      lse_[(b * H_ + h) * Tq_ + i] =
          merge_split_row(split_state, n_split_, rows_, hd_, r, merged, out_ + ((b * Tq_ + i) * H_ + h) * hd_,
                          sinks_ == nullptr ? nullptr : sinks_ + h);
    }
  }

  const int64_t B_, H_, Tq_, hd_, Hkv_, Tk_, group_;
  const bool stacked_;            // one query: the group's query heads are the rows of one item
  const int64_t units_, rows_;
  const scalar_t* q_;
  const scalar_t* k_;
  const scalar_t* v_;
  const Strides qs_, ks_;
  const Strides vs_;
  const bool* mask_;              // (B, Tk) contiguous, or nullptr
  const acc_t scale_;
  const int64_t window_;          // keys a query sees, its own included (Tk without a window)
  const int64_t first_key_;       // the first query's first key by the window (0 without one)
  const int64_t group_key_;       // the last query's: from here on every row's window has begun
  const int64_t n_split_;
  std::vector<acc_t> states_;     // per item: o (rows x hd), m (rows), l (rows)
  scalar_t* out_;                 // (B, Tq, H, hd)
  acc_t* lse_;                    // (B, H, Tq)
  const acc_t* sinks_;            // (H,) or nullptr
};

}  // namespace

bool decodes_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::optional<double> softcap,
                   double dropout_p) {
  const int64_t Tq = q.size(2);
  return Tq >= 1 && Tq <= kDecodeFewRows && Tq < k.size(2) && !softcap.has_value() && dropout_p == 0 &&
         k.stride(3) == 1 && v.stride(3) == 1 && q.stride(3) == 1 &&
         (k.size(2) <= 1 || (k.stride(2) == v.stride(2) && k.stride(2) >= k.size(3)));
}

std::tuple<at::Tensor, at::Tensor> decode_heads_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const std::optional<at::Tensor>& mask, double scale,
                                                    std::optional<int64_t> window, const at::Tensor& sinks) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), hd = q.size(3);
  const auto acc_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto out = at::empty({B, Tq, H, hd}, q.options());
  auto lse = at::empty({B, H, Tq}, q.options().dtype(acc_dtype));
  if (out.numel() == 0) {
    return {out, lse};
  }
  const auto contiguous_mask = mask.has_value() ? std::optional<at::Tensor>(mask->contiguous()) : std::nullopt;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "causal_attention_decode_heads", [&] {
    HeadsDecodePass<scalar_t>(q, k, v, contiguous_mask, scale, window, out, lse, sinks).run();
  });
  return {out, lse};
}

}  // namespace causal_attention::kernels
