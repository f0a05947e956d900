// The fused CPU attention kernel: flash-style tiling with an online softmax (forward) and a
// recomputing backward from the saved log-sum-exp. No T x T tensor is made and the key mask is
// never expanded beyond (B, T).
//
// Layout: q (B, H, Tq, hd), k and v (B, Hkv, Tk, hd) are read in place by strides (each head's rows
// dense): either from one qkv buffer (B, T, (H + 2 Hkv) * hd), q | k | v, Tq = Tk = T, or as three
// tensors (transformers' query and its cache's keys). Hkv divides H; query head h reads key/value head
// h / (H / Hkv). Query i sits at key position Tk - Tq + i (the queries end the key sequence: a prefill,
// or a decode step against a cache) and sees the keys up to it, within the window when there is one.
// The output is written as (B, Tq, H, hd), which is (B, Tq, H * hd) for the output projection.
//
// Scores are q . k * scale, then softcap * tanh(score / softcap) with a softcap (Gemma 2).
//
// Work skipped: key blocks above the diagonal, key blocks older than the window, key blocks with no
// real key, and keys past the last real key of a sequence; key blocks that are all real need no
// element-wise mask.
//
// Attention-weight dropout (training): P_drop = P * keep / (1 - p), keep from philox.h, a pure
// function of (seed, b, h, i, j), so the backward regenerates the forward's decisions tile by tile.
// The forward drops the unnormalised weights after the running sum has counted them (the row sum
// is the softmax's, before dropout); the backward uses P_drop for dV and dP * keep / (1 - p) for dS.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "blas.h"
#include "config.h"
#include "decode_heads.h"
#include "decode_merge.h"
#include "causal_attention/attention.h"
#include "philox.h"
#include "schedule.h"
#include "cpu/tile_ops.h"
#include "tile_products.h"

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

// ---- Where the operands of one (batch, head) are --------------------------------------------------

// Keys a query sees with no window: all up to its own.
inline constexpr int64_t kNoWindow = std::numeric_limits<int64_t>::max() / 4;

// What a call does to the scores beyond q . k.
struct ScoreRule {
  double scale;    // scores = q . k * scale
  double softcap;  // > 0: scores = softcap * tanh(scores / softcap); 0: none
  int64_t window;  // keys a query sees, its own included (kNoWindow: every earlier key)
};

struct Geometry {
  int64_t B, Tq, Tk, H, Hkv, hd, nq, nk;  // nq, nk: query and key blocks of the pass
  int64_t dim;                            // H * hd: a row of the output
  int64_t group;                          // H / Hkv: the query heads of a key/value head
  int64_t q_start;                        // Tk - Tq: the key position of query 0
  int64_t window;                         // as ScoreRule's
};

Geometry geometry(int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t Hkv, int64_t hd, int64_t window,
                  int64_t block_q, int64_t block_k) {
  return {B, Tq, Tk, H, Hkv, hd, ceil_div(Tq, block_q), ceil_div(Tk, block_k), H * hd, H / Hkv, Tk - Tq, window};
}

// One operand's heads: row t of head h of sequence b (hd dense values) at base + b * sb + h * sh + t * st.
template <typename T>
struct HeadsView {
  T* base;
  int64_t sb, sh, st;
  T* row(int64_t b, int64_t h, int64_t t) const { return base + b * sb + h * sh + t * st; }
};

// q (B, H, Tq, hd), k and v (B, Hkv, Tk, hd): read by the passes (const), or their gradients (written).
template <typename T>
struct HeadOperands {
  HeadsView<T> q, k, v;
};

// The row stride of x's heads (..., T, hd) as BLAS reads it: with one row it is arbitrary (PyTorch
// ignores the strides of size-1 dimensions), but BLAS checks ld >= the row length all the same.
int64_t head_row_stride(const at::Tensor& x) { return x.size(2) <= 1 ? x.size(3) : x.stride(2); }

template <typename T>
HeadsView<T> heads_view(T* base, const at::Tensor& x) {  // x (B, heads, T, hd)
  return {base, x.stride(0), x.stride(1), head_row_stride(x)};
}

// The heads of one qkv buffer (B, T, (H + 2 Hkv) * hd), rows dense: q | k | v, head h at h * hd of its part.
template <typename T>
HeadOperands<T> fused_heads(T* base, const at::Tensor& qkv, int64_t H, int64_t Hkv) {
  const int64_t hd = qkv.size(2) / (H + 2 * Hkv);
  const int64_t sb = qkv.stride(0), st = row_stride(qkv);
  return {{base, sb, hd, st}, {base + H * hd, sb, hd, st}, {base + (H + Hkv) * hd, sb, hd, st}};
}

// Row t of query head h's q, and of its key/value head's k and v, in sequence b: q + t * q_ld, k + t * k_ld,
// v + t * v_ld (hd entries each).
template <typename scalar_t>
struct HeadRows {
  HeadRows(const HeadOperands<const scalar_t>& in, const Geometry& g, int64_t b, int64_t h)
      : q_ld(in.q.st),
        k_ld(in.k.st),
        v_ld(in.v.st),
        q(in.q.row(b, h, 0)),
        k(in.k.row(b, h / g.group, 0)),
        v(in.v.row(b, h / g.group, 0)) {}
  int64_t q_ld, k_ld, v_ld;
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
};

// The dropout of a call: none (p = 0), or its probability and seed.
using OptionalDropout = std::optional<philox::Dropout>;

// Calls f(r0, r1, cols) for the tiles of a query block (q0, bq rows) against a key block (k0, bk
// keys): one tile below the diagonal; on the diagonal, slices of kDiagonalRows rows, each against
// the keys its rows can see.
template <typename F>
void causal_tiles(int64_t q0, int64_t bq, int64_t k0, int64_t bk, const F& f) {
  if (k0 + bk - 1 <= q0) {
    f(0, bq, bk);
    return;
  }
  for (int64_t r0 = 0; r0 < bq; r0 += kDiagonalRows) {
    const int64_t r1 = std::min(bq, r0 + kDiagonalRows);
    const int64_t cols = std::min(bk, q0 + r1 - k0);
    if (cols > 0) {
      f(r0, r1, cols);
    }
  }
}

// f(g0, rows, cols_g) for the row groups of a tile of n rows and cols keys whose row i sees keys up to
// i + causal (causal_offset): below the diagonal (tile::kNoCausal) the whole tile at once; on it groups
// of kDiagonalGroupRows rows (whole register blocks), each with only the keys its last row sees,
// rounded up to whole panels (at most cols: even, or all the packed keys, as pairs need).
template <typename F>
void diagonal_groups(int64_t n, int64_t cols, int64_t causal, const F& f) {
  if (causal == tile::kNoCausal) {
    f(0, n, cols);
    return;
  }
  for (int64_t g0 = 0; g0 < n; g0 += kDiagonalGroupRows) {
    const int64_t g1 = std::min(n, g0 + kDiagonalGroupRows);
    const int64_t seen = std::clamp<int64_t>(g1 + causal, 0, cols);
    f(g0, g1 - g0, std::min(cols, ceil_div(seen, tile::kPanel) * tile::kPanel));
  }
}

// The keys of a tile as its products take them: the pair micro-kernel sums keys in pairs, so an odd
// count short of the block's packed keys takes one more (a key no row sees: its P and dS are 0).
int64_t pair_cols(Products products, int64_t cols, int64_t packed) {
  return (products == Products::kPairs && cols % 2 != 0 && cols < packed) ? cols + 1 : cols;
}

// The causal limit of tile rows starting at query q (tile::kNoCausal when every row sees every key).
int64_t causal_offset(int64_t q, int64_t k0, int64_t cols) { return (k0 + cols - 1 > q) ? q - k0 : tile::kNoCausal; }

// The first key column row 0 of a tile (rows from query position q, keys from k0) sees in the window;
// row i sees from column window_first + i on (very negative with no window).
int64_t window_first(int64_t q, int64_t k0, int64_t window) {
  return window == kNoWindow ? -tile::kNoCausal : q - window + 1 - k0;
}

// Whether some row of a tile of n rows starts its window inside the tile.
bool window_cuts(int64_t first, int64_t n) { return first + n - 1 > 0; }

// The scale the softmax applies to a tile's scores: shape_scores has applied it under a softcap.
double softmax_scale(const ScoreRule& rule) { return rule.softcap > 0 ? 1.0 : rule.scale; }

// The scores of a tile (n x cols, ld) as the rule shapes them before the softmax: with a softcap
// softcap * tanh(scale * s / softcap) (the tanh kept in t, n x cols, where given: the backward's
// derivative); -inf for the keys before each row's window (row i: columns < first + i).
template <typename acc_t>
void shape_scores(acc_t* s, int64_t ld, int64_t n, int64_t cols, const ScoreRule& rule, int64_t first, acc_t* t) {
  if (rule.softcap > 0) {
    const auto scale = static_cast<acc_t>(rule.scale);
    const auto cap = static_cast<acc_t>(rule.softcap);
    for (int64_t i = 0; i < n; ++i) {
      acc_t* row = s + i * ld;
      for (int64_t j = 0; j < cols; ++j) {
        const acc_t th = std::tanh(row[j] * scale / cap);
        if (t != nullptr) {
          t[i * cols + j] = th;
        }
        row[j] = th * cap;
      }
    }
  }
  if (window_cuts(first, n)) {
    for (int64_t i = 0; i < n; ++i) {
      std::fill(s + i * ld, s + i * ld + std::clamp<int64_t>(first + i, 0, cols),
                -std::numeric_limits<acc_t>::infinity());
    }
  }
}

// The micro-kernel's panels of a key block (tile_products.h): keys transposed for the scores; values as
// rows for P V (forward), transposed for dO V^T (backward); keys as rows for dS K (backward). Empty
// where the products go to BLAS.
template <typename acc_t>
struct KeyBlockPanels {
  Panels<acc_t> keys;
  Panels<acc_t> values;
  Panels<acc_t> key_rows;
};

// ---- Forward --------------------------------------------------------------------------------------

// One thread's scratch, reused by every work item of its chunk.
template <typename scalar_t>
struct ForwardWorkspace {
  using acc_t = at::opmath_type<scalar_t>;
  ForwardWorkspace(int64_t hd, Products products)
      : s(kBlockQ * kBlockK),
        p_in(kReduced<scalar_t> && products == Products::kBlas ? kBlockQ * kBlockK : 0),
        pv(kBlockQ * hd),
        o(kBlockQ * hd),
        m(kBlockQ),
        l(kBlockQ),
        alpha(kBlockQ),
        buf(kBlockK),
        p_wide(kReduced<scalar_t> && products == Products::kPanels ? kBlockQ * kBlockK : 0),
        p_pairs(products == Products::kPairs ? kBlockQ * kBlockK : 0) {}
  std::vector<acc_t> s;         // scores, then P
  std::vector<scalar_t> p_in;   // BLAS, bfloat16 / half: P in the input type
  std::vector<acc_t> pv;        // P V of one tile
  std::vector<acc_t> o;         // (bq, hd) unnormalised output
  std::vector<acc_t> m, l, alpha, buf;  // running row max and sum, rescale factors, row scratch
  std::vector<acc_t> q_wide;    // float32 micro-kernel, bfloat16 / half: the query block widened
  std::vector<acc_t> p_wide;    // float32 micro-kernel, bfloat16 / half: P rounded to the input type, widened
  std::vector<scalar_t> p_pairs;  // pair micro-kernel: P in bfloat16, rows of an even length
};

template <typename scalar_t>
class ForwardPass {
 public:
  using acc_t = at::opmath_type<scalar_t>;

  // sinks: (H,) acc_t, or undefined (none).
  ForwardPass(const HeadOperands<const scalar_t>& in, const std::optional<at::Tensor>& mask, const Geometry& g,
              const ScoreRule& rule, const OptionalDropout& drop, const at::Tensor& out, const at::Tensor& lse,
              const at::Tensor& sinks = {})
      : in_(in),
        g_(g),
        rule_(rule),
        summary_(summarize(mask, g.B, g.Tk, kBlockK)),
        drop_(drop),
        out_(out.data_ptr<scalar_t>()),
        lse_(lse.data_ptr<acc_t>()),
        sinks_(sinks.defined() ? sinks.const_data_ptr<acc_t>() : nullptr),
        softmax_scale_(static_cast<acc_t>(softmax_scale(rule))),
        products_(products_for<scalar_t>(g.hd)) {}

  // Work items are (batch, head, query block), costing the keys the block sees. They run in waves of
  // (batch, key/value head)s, the costliest first: each wave packs its heads' key panels, then runs their
  // items grouped by (batch, head), so that the threads share a head's panels in cache
  // (costliest_groups_first). A wave's panels fit kWavePanelBytes: they are read back from cache
  // rather than memory, and the one buffer the waves share is small enough for malloc to reuse.
  void run() const {
    const auto cost = [&](int64_t item) {
      const int64_t b = item / (g_.H * g_.nq);
      const int64_t q0 = (item % g_.nq) * kBlockQ + g_.q_start;
      const int64_t q_end = std::min(g_.Tq, (item % g_.nq + 1) * kBlockQ) + g_.q_start;
      return std::max<int64_t>(0, std::min(q_end, summary_.key_end[b]) - first_key(q0));
    };
    const int64_t per_kv = g_.group * g_.nq;  // the items of a (batch, key/value head): bg * per_kv + i
    std::vector<int64_t> kv_cost(g_.B * g_.Hkv, 0);
    for (int64_t item = 0; item < g_.B * g_.H * g_.nq; ++item) {
      kv_cost[item / per_kv] += cost(item);
    }
    const auto kv_order = costliest_first(g_.B * g_.Hkv, [&](int64_t bg) { return kv_cost[bg]; });
    const int64_t per_wave = heads_per_wave(per_kv);
    at::Tensor panels;  // every wave's panels, packed over the last wave's
    std::vector<std::optional<ForwardWorkspace<scalar_t>>> workspaces(at::get_num_threads());  // by thread
    std::vector<int64_t> wave_items;
    for (size_t w0 = 0; w0 < kv_order.size(); w0 += per_wave) {
      const std::vector<int64_t> wave(kv_order.begin() + w0,
                                      kv_order.begin() + std::min<size_t>(kv_order.size(), w0 + per_wave));
      pack_key_blocks(wave, per_wave, panels);
      wave_items.clear();
      for (const int64_t bg : wave) {
        for (int64_t i = 0; i < per_kv; ++i) {
          wave_items.push_back(bg * per_kv + i);
        }
      }
      const auto order = costliest_groups_first(static_cast<int64_t>(wave_items.size()), g_.nq,
                                                [&](int64_t i) { return cost(wave_items[i]); });
      run_items(
          order,
          [&]() -> ForwardWorkspace<scalar_t>& {
            auto& ws = workspaces.at(at::get_thread_num());
            if (!ws.has_value()) {
              ws.emplace(g_.hd, products_);
            }
            return *ws;
          },
          [&](int64_t i, ForwardWorkspace<scalar_t>& ws) {
            const int64_t item = wave_items[i];
            const int64_t slot = i / per_kv;  // the (batch, key/value head)'s place in the wave
            query_block(item / g_.nq, item % g_.nq, panels, slot, ws);
          });
    }
  }

 private:
  // (batch, key/value head)s per wave: as many as kWavePanelBytes holds, at least one, and enough that
  // every thread has several items (a wave ends when its last item does).
  int64_t heads_per_wave(int64_t per_kv) const {
    const int64_t all = g_.B * g_.Hkv;
    if (products_ == Products::kBlas) {
      return all;  // nothing packed
    }
    const auto value_bytes =
        static_cast<int64_t>(products_ == Products::kPairs ? sizeof(c10::BFloat16) : sizeof(float));
    const int64_t head_bytes = g_.nk * block_panels_size() * value_bytes;
    const int64_t by_bytes = kWavePanelBytes / std::max<int64_t>(1, head_bytes);
    const int64_t by_items = ceil_div(kWaveItemsPerThread * at::get_num_threads(), per_kv);
    return std::clamp<int64_t>(std::max(by_bytes, by_items), 1, all);
  }

  // The first key that a query at position q sees by the window.
  int64_t first_key(int64_t q) const { return g_.window == kNoWindow ? 0 : std::max<int64_t>(0, q - g_.window + 1); }

  // The key block's panels in pack_key_blocks' buffer: keys transposed, then values as rows (float32
  // values, or bfloat16 ones holding pairs).
  int64_t key_panels_size() const { return packed_size(products_, g_.hd, kBlockK); }
  int64_t block_panels_size() const { return key_panels_size() + packed_size(products_, kBlockK, g_.hd); }

  // With a micro-kernel: the panels of every key block with a real key that a query sees of the wave's
  // (batch, key/value head)s, packed in parallel into panels (the wave's slot s at s * nk key blocks),
  // once per wave rather than once per query block that reads them (in float32 for the float32
  // micro-kernel, in bfloat16 for pairs; the value panels round hd up to a panel). panels is made on the
  // first wave, sized for per_wave heads, and stays undefined (no memory) where the products go to BLAS.
  void pack_key_blocks(const std::vector<int64_t>& wave, int64_t per_wave, at::Tensor& panels) const {
    if constexpr (std::is_same_v<acc_t, float>) {
      const int64_t size = per_wave * g_.nk * block_panels_size();
      if (products_ == Products::kPairs) {
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (!panels.defined()) {
            panels = at::empty({size}, at::kBFloat16);
          }
          scalar_t* base = panels.data_ptr<scalar_t>();
          for_each_key_block(wave, [&](const HeadRows<scalar_t>& rows, int64_t i, int64_t k0, int64_t bk) {
            scalar_t* dst = base + i * block_panels_size();
            pack_pairs(rows.k + k0 * rows.k_ld, 1, rows.k_ld, g_.hd, bk, dst);
            pack_pairs(rows.v + k0 * rows.v_ld, rows.v_ld, 1, bk, g_.hd, dst + key_panels_size());
          });
        }
      }
      if (products_ == Products::kPanels) {
        if (!panels.defined()) {
          panels = at::empty({size}, at::kFloat);
        }
        float* base = panels.data_ptr<float>();
        for_each_key_block(wave, [&](const HeadRows<scalar_t>& rows, int64_t i, int64_t k0, int64_t bk) {
          float* dst = base + i * block_panels_size();
          pack_transposed(rows.k + k0 * rows.k_ld, rows.k_ld, bk, g_.hd, dst);
          pack_rows(rows.v + k0 * rows.v_ld, rows.v_ld, bk, g_.hd, dst + key_panels_size());
        });
      }
    }
  }

  // f(rows, i, k0, bk) in parallel for each key block i = slot * nk + kb of the wave's (batch, key/value head)
  // bg = wave[slot] with a real key that a query sees: the rows of bg (those of the group's first query head),
  // first key and keys up to the last real one.
  template <typename F>
  void for_each_key_block(const std::vector<int64_t>& wave, const F& f) const {
    const int64_t first = first_key(g_.q_start);
    at::parallel_for(0, static_cast<int64_t>(wave.size()) * g_.nk, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t bg = wave[i / g_.nk];
        const int64_t b = bg / g_.Hkv;
        const int64_t k0 = (i % g_.nk) * kBlockK;
        if (summary_.status[b * g_.nk + i % g_.nk] == kNoneReal || k0 >= summary_.key_end[b] ||
            k0 + kBlockK <= first) {
          continue;
        }
        f(HeadRows<scalar_t>(in_, g_, b, (bg % g_.Hkv) * g_.group), i, k0,
          std::min(summary_.key_end[b], k0 + kBlockK) - k0);
      }
    });
  }

  // The panels of key block kb of the wave's slot in pack_key_blocks' buffer (empty when undefined).
  KeyBlockPanels<acc_t> block_panels(const at::Tensor& panels, int64_t slot, int64_t kb, int64_t bk) const {
    if (!panels.defined()) {
      return {};
    }
    if (products_ == Products::kPairs) {
      const auto* block =
          static_cast<const c10::BFloat16*>(panels.const_data_ptr()) + (slot * g_.nk + kb) * block_panels_size();
      return {{nullptr, g_.hd, block}, {nullptr, bk, block + key_panels_size()}, {}};
    }
    const acc_t* block = panels.const_data_ptr<acc_t>() + (slot * g_.nk + kb) * block_panels_size();
    return {{block, g_.hd}, {block + key_panels_size(), bk}, {}};
  }

  // Query block qb of (batch, head) bh against every key block it may see; its key/value head's panels
  // are at slot of the wave's.
  void query_block(int64_t bh, int64_t qb, const at::Tensor& panels, int64_t slot,
                   ForwardWorkspace<scalar_t>& ws) const {
    const int64_t b = bh / g_.H;
    const int64_t h = bh % g_.H;
    const HeadRows<scalar_t> rows(in_, g_, b, h);
    const int64_t q0 = qb * kBlockQ;  // query index; its key position is q0 + q_start
    const int64_t qp = q0 + g_.q_start;
    const int64_t bq = std::min(g_.Tq, q0 + kBlockQ) - q0;
    std::fill(ws.o.begin(), ws.o.begin() + bq * g_.hd, acc_t(0));
    std::fill(ws.m.begin(), ws.m.begin() + bq, -std::numeric_limits<acc_t>::infinity());
    std::fill(ws.l.begin(), ws.l.begin() + bq, acc_t(0));
    const auto q_block = operand<scalar_t>(rows.q + q0 * rows.q_ld, rows.q_ld, bq, g_.hd, products_, ws.q_wide);

    const int64_t k_stop = std::min(qp + bq, summary_.key_end[b]);  // causal, and no key past the last real one
    for (int64_t kb = first_key(qp) / kBlockK; kb * kBlockK < k_stop; ++kb) {
      const uint8_t st = summary_.status[b * g_.nk + kb];
      if (st == kNoneReal) {
        continue;
      }
      const int64_t k0 = kb * kBlockK;
      const bool* key_mask = (st == kMixed) ? summary_.mask + b * g_.Tk + k0 : nullptr;
      const int64_t packed = std::min(summary_.key_end[b], k0 + kBlockK) - k0;
      const auto block = block_panels(panels, slot, kb, packed);
      causal_tiles(qp, bq, k0, std::min(k_stop, k0 + kBlockK) - k0, [&](int64_t r0, int64_t r1, int64_t cols) {
        tile(rows, q_block, bh, qp + r0, r0, r1 - r0, k0, pair_cols(products_, cols, packed), key_mask, block, ws);
      });
    }
    if (sinks_ != nullptr) {
      for (int64_t r = 0; r < bq; ++r) {
        merge_sink(sinks_[h], g_.hd, ws.o.data() + r * g_.hd, ws.m[r], ws.l[r]);
      }
    }
    tile::tile_ops<scalar_t>().finalize(ws.o.data(), g_.hd, bq, g_.hd, ws.m.data(), ws.l.data(),
                                        out_ + (b * g_.Tq + q0) * g_.dim + h * g_.hd, g_.dim, lse_ + bh * g_.Tq + q0);
  }

  // Queries at key positions q..q+n (rows r0.. of the block's state) against keys k0..k0+cols: the scores,
  // one online-softmax step, dropout, and O = O * alpha + P V.
  // q_block: the block's queries (row r0 is the query at q).
  void tile(const HeadRows<scalar_t>& rows, const Operand<scalar_t>& q_block, int64_t bh, int64_t q, int64_t r0,
            int64_t n, int64_t k0, int64_t cols, const bool* key_mask, const KeyBlockPanels<acc_t>& panels,
            ForwardWorkspace<scalar_t>& ws) const {
    const auto& acc_ops = tile::tile_ops<acc_t>();
    acc_t* s = ws.s.data();
    const int64_t causal = causal_offset(q, k0, cols);
    const int64_t first = window_first(q, k0, g_.window);
    diagonal_groups(n, cols, causal, [&](int64_t g0, int64_t rows_g, int64_t cols_g) {
      if (cols_g > 0) {  // (the entries past a row's keys are never read)
        score_product<scalar_t>(rows_from(q_block, r0 + g0), rows.k + k0 * rows.k_ld, rows.k_ld, rows_g, cols_g,
                                g_.hd, s + g0 * cols, cols, panels.keys);
      }
    });
    shape_scores<acc_t>(s, cols, n, cols, rule_, first, nullptr);
    const auto p = [&]() -> Operand<scalar_t> {  // P, entries <= 1, as the product P V reads it
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (products_ == Products::kPairs && !drop_.has_value()) {  // rounded as the softmax makes it
          tile::tile_ops<scalar_t>().softmax_tile_rounded(s, cols, n, cols, softmax_scale_, causal, key_mask,
                                                          ws.m.data() + r0, ws.l.data() + r0, ws.alpha.data() + r0,
                                                          ws.p_pairs.data(), pair_row_ld(cols));
          return pair_rows_operand(ws.p_pairs.data(), n, cols);
        }
      }
      acc_ops.softmax_tile(s, cols, n, cols, softmax_scale_, causal, key_mask, ws.m.data() + r0, ws.l.data() + r0,
                           ws.alpha.data() + r0, ws.buf.data());
      if (drop_.has_value()) {  // after the row sums: they are the softmax's, before dropout
        acc_ops.dropout(s, nullptr, cols, n, cols, *drop_, static_cast<uint64_t>(bh), q, k0);
      }
      return input_operand<scalar_t>(s, ws.p_in.data(), ws.p_wide.data(), cols, n, cols, products_,
                                     {ws.p_pairs.data(), nullptr});
    }();
    diagonal_groups(n, cols, causal, [&](int64_t g0, int64_t rows_g, int64_t cols_g) {  // P is 0 past a row's keys
      row_product<scalar_t>(false, rows_g, g_.hd, cols_g, rows_from(p, g0), rows.v + k0 * rows.v_ld, rows.v_ld,
                            panels.values, false, ws.pv.data() + g0 * g_.hd, g_.hd);
    });
    if (key_mask != nullptr || causal != tile::kNoCausal || window_cuts(first, n)) {
      exclude_masked_values<scalar_t>(p, rows.v + k0 * rows.v_ld, rows.v_ld, n, cols, g_.hd, causal, first, key_mask,
                                      ws.pv.data());
    }
    acc_ops.rescale_add(ws.o.data() + r0 * g_.hd, g_.hd, ws.pv.data(), g_.hd, n, g_.hd, ws.alpha.data() + r0);
  }

  const HeadOperands<const scalar_t> in_;
  const Geometry g_;
  const ScoreRule rule_;
  const MaskSummary summary_;
  const OptionalDropout drop_;
  scalar_t* out_;
  acc_t* lse_;
  const acc_t* sinks_;  // (H,) or nullptr
  const acc_t softmax_scale_;
  const Products products_;
};

// ---- Backward -------------------------------------------------------------------------------------

// One thread's scratch, reused by every (batch, head) of its chunk.
template <typename scalar_t>
struct BackwardWorkspace {
  using acc_t = at::opmath_type<scalar_t>;
  BackwardWorkspace(int64_t Tq, int64_t hd, int64_t group, bool dropout, bool softcap, Products products)
      : p(kBwdBlockQ * kBwdBlockK),
        dp(kBwdBlockQ * kBwdBlockK),
        p_drop(dropout ? kBwdBlockQ * kBwdBlockK : 0),
        p_in(kReduced<scalar_t> && products == Products::kBlas ? kBwdBlockQ * kBwdBlockK : 0),
        ds_in(kReduced<scalar_t> && products == Products::kBlas ? kBwdBlockQ * kBwdBlockK : 0),
        dq(group * Tq * hd),
        dk(kBwdBlockK * hd),
        dv(kBwdBlockK * hd),
        p_wide(kReduced<scalar_t> && products == Products::kPanels ? kBwdBlockQ * kBwdBlockK : 0),
        ds_wide(kReduced<scalar_t> && products == Products::kPanels ? kBwdBlockQ * kBwdBlockK : 0),
        p_tpairs(products == Products::kPairs ? kBwdBlockQ * kBwdBlockK : 0),
        ds_pairs(products == Products::kPairs ? kBwdBlockQ * kBwdBlockK : 0),
        ds_tpairs(products == Products::kPairs ? kBwdBlockQ * kBwdBlockK : 0),
        tanh(softcap ? kBwdBlockQ * kBwdBlockK : 0) {}
  std::vector<acc_t> p;          // P (from the saved lse)
  std::vector<acc_t> dp;         // dP, then dS
  std::vector<acc_t> p_drop;     // with dropout: P_drop
  std::vector<scalar_t> p_in;    // bfloat16 / half: P (or P_drop) in the input type, for P^T dO
  std::vector<scalar_t> ds_in;   // bfloat16 / half: dS in the input type, for dS K and dS^T Q
  std::vector<acc_t> dq;         // (group, Tq, hd): the key/value head's query heads
  std::vector<acc_t> dk, dv;     // (block_k, hd) of the key block
  PanelBuffer<scalar_t> keys, values, key_rows;  // the micro-kernel's panels of the key block (tile_products.h)
  PanelBuffer<scalar_t> query_rows, dout_rows;   // and of a query block's q and dO
  std::vector<acc_t> q_wide, dout_wide;   // float32 micro-kernel, bfloat16 / half: the tile's q and dO widened
  std::vector<acc_t> p_wide, ds_wide;     // float32 micro-kernel, bfloat16 / half: P (P_drop) and dS rounded, widened
  std::vector<scalar_t> p_tpairs;         // pair micro-kernel: P (P_drop) transposed, in pairs
  std::vector<scalar_t> ds_pairs, ds_tpairs;  // pair micro-kernel: dS in pairs, and transposed
  std::vector<acc_t> tanh;                    // softcap: the tile's tanh(scale * s / softcap)
};

template <typename scalar_t>
class BackwardPass {
 public:
  using acc_t = at::opmath_type<scalar_t>;

  // grad: where dq, dk, dv go (every element is written).
  BackwardPass(const at::Tensor& grad_out, const HeadOperands<const scalar_t>& in,
               const std::optional<at::Tensor>& mask, const at::Tensor& out, const at::Tensor& lse, const Geometry& g,
               const ScoreRule& rule, const OptionalDropout& drop, const HeadOperands<scalar_t>& grad)
      : in_(in),
        grad_(grad),
        g_(g),
        rule_(rule),
        summary_(summarize(mask, g.B, g.Tk, kBwdBlockK)),
        drop_(drop),
        // delta[b, t, h] = sum_d dO[b, t, h, d] * O[b, t, h, d]   (O with dropout: sum_j P dP_drop, still)
        products_(products_for<scalar_t>(g.hd)),
        delta_t_(delta(grad_out, out, g, products_)),
        delta_(delta_t_.const_data_ptr<acc_t>()),
        lse_(lse.const_data_ptr<acc_t>()),
        dout_(grad_out.const_data_ptr<scalar_t>()),
        softmax_scale_(static_cast<acc_t>(softmax_scale(rule))) {}

  // Work items are (batch, key/value head), costing the keys of the sequence: dK and dV sum over the
  // group's query heads.
  void run() const {
    const auto order = costliest_first(g_.B * g_.Hkv, [&](int64_t bg) { return summary_.key_end[bg / g_.Hkv]; });
    run_items(
        order,
        [&] {
          return BackwardWorkspace<scalar_t>(g_.Tq, g_.hd, g_.group, drop_.has_value(), rule_.softcap > 0, products_);
        },
        [&](int64_t bg, BackwardWorkspace<scalar_t>& ws) { kv_head(bg, ws); });
  }

 private:
  // With a micro-kernel, in its summation order (tile_ops' fma_dots, pair_dots); else ATen's.
  static at::Tensor delta(const at::Tensor& grad_out, const at::Tensor& out, const Geometry& g, Products products) {
    const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
    if (products == Products::kBlas) {
      return (grad_out.to(acc_dtype) * out.to(acc_dtype)).view({g.B, g.Tq, g.H, g.hd}).sum(3).contiguous();
    }
    const auto dout = grad_out.contiguous();
    const auto o = out.contiguous();
    at::Tensor result = at::empty({g.B, g.Tq, g.H}, grad_out.options().dtype(acc_dtype));
    const scalar_t* x = dout.const_data_ptr<scalar_t>();
    const scalar_t* y = o.const_data_ptr<scalar_t>();
    acc_t* d = result.data_ptr<acc_t>();
    at::parallel_for(0, g.B * g.Tq * g.H, 4096, [&](int64_t r0, int64_t r1) {
      const auto& ops = tile::tile_ops<scalar_t>();
      (products == Products::kPairs ? ops.pair_dots : ops.fma_dots)(x + r0 * g.hd, y + r0 * g.hd, r1 - r0, g.hd,
                                                                    d + r0);
    });
    return result;
  }

  // dK and dV of keys k0..k1 of (b, key/value head kv) that no query may attend (padding) are zero.
  void zero_key_rows(int64_t b, int64_t kv, int64_t k0, int64_t k1) const {
    for (int64_t t = k0; t < k1; ++t) {
      std::fill(grad_.k.row(b, kv, t), grad_.k.row(b, kv, t) + g_.hd, scalar_t(0));
      std::fill(grad_.v.row(b, kv, t), grad_.v.row(b, kv, t) + g_.hd, scalar_t(0));
    }
  }

  // The queries (indices, from a block boundary) that may see keys k0..k0+bk: from the one at key
  // position k0, up to the last one whose window still holds key k0 + bk - 1.
  std::pair<int64_t, int64_t> query_range(int64_t k0, int64_t bk) const {
    const int64_t first = std::max<int64_t>(0, k0 - g_.q_start);
    const int64_t end = g_.window == kNoWindow ? g_.Tq
                                               : std::clamp<int64_t>(k0 + bk - 1 + g_.window - g_.q_start, 0, g_.Tq);
    return {(first / kBwdBlockQ) * kBwdBlockQ, end};
  }

  // dQ of a key/value head's query heads, and its dK, dV: key blocks in order, each against the
  // queries of every head of the group that see it (in head order), dK and dV summed over them.
  void kv_head(int64_t bg, BackwardWorkspace<scalar_t>& ws) const {
    const int64_t b = bg / g_.Hkv;
    const int64_t kv = bg % g_.Hkv;
    const int64_t h0 = kv * g_.group;  // the group's first query head
    const HeadRows<scalar_t> rows(in_, g_, b, h0);  // k and v: the group's
    const int64_t key_end = summary_.key_end[b];
    std::fill(ws.dq.begin(), ws.dq.end(), acc_t(0));
    zero_key_rows(b, kv, key_end, g_.Tk);
    for (int64_t kb = 0; kb * kBwdBlockK < key_end; ++kb) {
      const uint8_t st = summary_.status[b * g_.nk + kb];
      const int64_t k0 = kb * kBwdBlockK;
      const int64_t bk = std::min(key_end, k0 + kBwdBlockK) - k0;
      const auto [q_first, q_end] = query_range(k0, bk);
      if (st == kNoneReal || q_first >= q_end) {
        zero_key_rows(b, kv, k0, k0 + bk);
        continue;
      }
      const bool* key_mask = (st == kMixed) ? summary_.mask + b * g_.Tk + k0 : nullptr;
      std::fill(ws.dk.begin(), ws.dk.begin() + bk * g_.hd, acc_t(0));
      std::fill(ws.dv.begin(), ws.dv.begin() + bk * g_.hd, acc_t(0));
      const KeyBlockPanels<acc_t> panels{
          transposed_panels<scalar_t>(rows.k + k0 * rows.k_ld, rows.k_ld, bk, g_.hd, ws.keys, products_),
          transposed_panels<scalar_t>(rows.v + k0 * rows.v_ld, rows.v_ld, bk, g_.hd, ws.values, products_),
          row_panels<scalar_t>(rows.k + k0 * rows.k_ld, rows.k_ld, bk, g_.hd, ws.key_rows, products_)};
      for (int64_t i = 0; i < g_.group; ++i) {
        const HeadRows<scalar_t> head_rows(in_, g_, b, h0 + i);
        acc_t* dq = ws.dq.data() + i * g_.Tq * g_.hd;
        for (int64_t q0 = q_first; q0 < q_end; q0 += kBwdBlockQ) {
          const int64_t bq = std::min(q_end, q0 + kBwdBlockQ) - q0;
          causal_tiles(q0 + g_.q_start, bq, k0, bk, [&](int64_t r0, int64_t r1, int64_t cols) {
            tile(head_rows, b, h0 + i, q0 + r0, r1 - r0, k0, pair_cols(products_, cols, bk), key_mask, panels, dq, ws);
          });
        }
      }
      const auto& ops = tile::tile_ops<scalar_t>();
      ops.store(ws.dk.data(), g_.hd, bk, g_.hd, grad_.k.row(b, kv, k0), grad_.k.st);
      ops.store(ws.dv.data(), g_.hd, bk, g_.hd, grad_.v.row(b, kv, k0), grad_.v.st);
    }
    for (int64_t i = 0; i < g_.group; ++i) {
      tile::tile_ops<scalar_t>().store(ws.dq.data() + i * g_.Tq * g_.hd, g_.hd, g_.Tq, g_.hd,
                                       grad_.q.row(b, h0 + i, 0), grad_.q.st);
    }
  }

  // Queries t..t+n (indices; key positions from t + q_start) of head h against keys k0..k0+cols: P, dP,
  // then dV += P_drop^T dO, dS = scale * P (dP_drop - delta) (times the softcap's derivative), dQ += dS K
  // (dq: the head's (Tq, hd)), dK += dS^T Q. Products in the input type (P and dS rounded to it) with
  // acc_t sums.
  void tile(const HeadRows<scalar_t>& rows, int64_t b, int64_t h, int64_t t, int64_t n, int64_t k0, int64_t cols,
            const bool* key_mask, const KeyBlockPanels<acc_t>& panels, acc_t* dq,
            BackwardWorkspace<scalar_t>& ws) const {
    const auto& acc_ops = tile::tile_ops<acc_t>();
    const int64_t bh = b * g_.H + h;
    const int64_t hd = g_.hd;
    const int64_t q = t + g_.q_start;  // key position of the first row
    const int64_t causal = causal_offset(q, k0, cols);
    const scalar_t* q_rows = rows.q + t * rows.q_ld;
    const scalar_t* k_rows = rows.k + k0 * rows.k_ld;
    const scalar_t* dout_rows = dout_ + (b * g_.Tq + t) * g_.dim + h * hd;  // ld dim
    const auto q_op = operand<scalar_t>(q_rows, rows.q_ld, n, hd, products_, ws.q_wide);
    const auto dout_op = operand<scalar_t>(dout_rows, g_.dim, n, hd, products_, ws.dout_wide);
    acc_t* p = ws.p.data();
    acc_t* dp = ws.dp.data();
    // P = exp(scores - lse)
    score_product<scalar_t>(q_op, k_rows, rows.k_ld, n, cols, hd, p, cols, panels.keys);
    shape_scores<acc_t>(p, cols, n, cols, rule_, window_first(q, k0, g_.window), ws.tanh.data());
    acc_ops.probabilities(p, cols, n, cols, softmax_scale_, causal, key_mask, lse_ + bh * g_.Tq + t);
    // dP = dO v^T
    score_product<scalar_t>(dout_op, rows.v + k0 * rows.v_ld, rows.v_ld, n, cols, hd, dp, cols, panels.values);
    const acc_t* p_drop = p;
    if (drop_.has_value()) {  // P_drop = P * keep / (1 - p) and dP_drop = dP * keep / (1 - p)
      std::copy(p, p + n * cols, ws.p_drop.data());
      acc_ops.dropout(ws.p_drop.data(), dp, cols, n, cols, *drop_, static_cast<uint64_t>(bh), q, k0);
      p_drop = ws.p_drop.data();
    }
    // dV += P_drop^T dO
    const auto dout_panels = row_panels<scalar_t>(dout_rows, g_.dim, n, hd, ws.dout_rows, products_);
    row_product<scalar_t>(true, cols, hd, n,
                          input_operand<scalar_t>(p_drop, ws.p_in.data(), ws.p_wide.data(), cols, n, cols, products_,
                                                  {nullptr, ws.p_tpairs.data()}),
                          dout_rows, g_.dim, dout_panels, true, ws.dv.data(), hd);
    // dS = scale * P (dP_drop - delta), in the input type for the products that follow
    const acc_t* delta = delta_ + (b * g_.Tq + t) * g_.H + h;
    const auto ds = [&]() -> Operand<scalar_t> {
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (products_ == Products::kPairs && rule_.softcap == 0) {  // rounded, both ways, as it is made
          const int64_t ld_rows = pair_row_ld(cols);
          tile::tile_ops<scalar_t>().score_grad_pairs(dp, p, cols, n, cols, softmax_scale_, delta, g_.H,
                                                      ws.ds_pairs.data(), ld_rows, ws.ds_tpairs.data(), 2 * cols);
          return {nullptr, ld_rows, nullptr, 0, pair_rows_view(ws.ds_pairs.data(), cols),
                  transposed_pairs_view(ws.ds_tpairs.data(), cols)};
        }
      }
      acc_ops.score_grad(dp, p, cols, n, cols, softmax_scale_, delta, g_.H);
      if (rule_.softcap > 0) {  // d(cap * tanh(scale * s / cap)) / ds = scale * (1 - tanh^2)
        const auto scale = static_cast<acc_t>(rule_.scale);
        for (int64_t e = 0; e < n * cols; ++e) {
          dp[e] *= scale * (acc_t(1) - ws.tanh[e] * ws.tanh[e]);
        }
      }
      return input_operand<scalar_t>(dp, ws.ds_in.data(), ws.ds_wide.data(), cols, n, cols, products_,
                                     {ws.ds_pairs.data(), ws.ds_tpairs.data()});
    }();
    row_product<scalar_t>(false, n, hd, cols, ds, k_rows, rows.k_ld, panels.key_rows, true, dq + t * hd,
                          hd);  // dQ += dS K
    row_product<scalar_t>(true, cols, hd, n, ds, q_rows, rows.q_ld,
                          row_panels<scalar_t>(q_rows, rows.q_ld, n, hd, ws.query_rows, products_), true,
                          ws.dk.data(), hd);  // dK += dS^T Q
  }

  const HeadOperands<const scalar_t> in_;
  const HeadOperands<scalar_t> grad_;
  const Geometry g_;
  const ScoreRule rule_;
  const MaskSummary summary_;
  const OptionalDropout drop_;
  const Products products_;
  const at::Tensor delta_t_;  // (B, Tq, H) acc_t, owns delta_
  const acc_t* delta_;
  const acc_t* lse_;
  const scalar_t* dout_;  // (B, Tq, H * hd)
  const acc_t softmax_scale_;
};

void check_cpu_inputs(const at::Tensor& qkv, const std::optional<at::Tensor>& mask, int64_t n_heads,
                      int64_t n_kv_heads) {
  check_qkv(qkv, n_heads, n_kv_heads);
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

std::optional<at::Tensor> contiguous_mask(const std::optional<at::Tensor>& mask) {
  return mask.has_value() ? std::optional<at::Tensor>(mask->contiguous()) : std::nullopt;
}

bool computes_in_float64(const at::Tensor& qkv, int64_t n_heads, int64_t n_kv_heads) {
  return tile::computes_in_float64(qkv.scalar_type(), qkv.size(2) / (n_heads + 2 * n_kv_heads));
}

// x (B, heads, T, hd) with heads whose rows BLAS can read by a leading dimension: the last dimension
// dense and rows at least hd apart (else a contiguous copy).
at::Tensor heads_rows(const at::Tensor& x) {
  const bool ok = x.stride(3) == 1 && (x.size(2) <= 1 || x.stride(2) >= x.size(3));
  return ok ? x : x.contiguous();
}

}  // namespace

at::Tensor heads_grad_like(const at::Tensor& x) {
  auto grad = at::empty_like(x);
  return grad.sym_stride(3) == 1 ? grad : at::empty_symint(x.sym_sizes(), x.options());
}

namespace {

ScoreRule score_rule(int64_t hd, std::optional<double> scale, std::optional<int64_t> window,
                     std::optional<double> softcap) {
  return {scale.value_or(1.0 / std::sqrt(static_cast<double>(hd))), softcap.value_or(0.0), window.value_or(kNoWindow)};
}

template <typename scalar_t>
void forward(const HeadOperands<const scalar_t>& in, const std::optional<at::Tensor>& mask, const Geometry& g,
             const ScoreRule& rule, const OptionalDropout& drop, const at::Tensor& out, const at::Tensor& lse,
             const at::Tensor& sinks = {}) {
  ForwardPass<scalar_t>(in, mask, g, rule, drop, out, lse, sinks).run();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& qkv_in,
                                                         const std::optional<at::Tensor>& mask_in,
                                                         int64_t n_heads, double dropout_p,
                                                         const std::optional<at::Tensor>& seed,
                                                         std::optional<int64_t> n_kv_heads_in) {
  const int64_t n_kv_heads = n_kv_heads_in.value_or(n_heads);
  check_cpu_inputs(qkv_in, mask_in, n_heads, n_kv_heads);
  if (computes_in_float64(qkv_in, n_heads, n_kv_heads)) {
    auto [out, lse] = attention_forward_cpu(qkv_in.to(at::kDouble), mask_in, n_heads, dropout_p, seed, n_kv_heads);
    return {out.to(at::kFloat), lse};
  }
  const auto drop = dropout_of(dropout_p, seed);
  const auto qkv = blas_rows(qkv_in);
  const auto mask = contiguous_mask(mask_in);
  const int64_t B = qkv.size(0), T = qkv.size(1), hd = qkv.size(2) / (n_heads + 2 * n_kv_heads);
  const auto g = geometry(B, T, T, n_heads, n_kv_heads, hd, kNoWindow, kBlockQ, kBlockK);
  const auto acc_dtype = qkv.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto out = at::empty({g.B, g.Tq, g.dim}, qkv.options());
  auto lse = at::empty({g.B, g.H, g.Tq}, qkv.options().dtype(acc_dtype));
  if (out.numel() == 0) {
    return {out, lse};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "causal_attention_forward", [&] {
    forward<scalar_t>(fused_heads(qkv.const_data_ptr<scalar_t>(), qkv, n_heads, n_kv_heads), mask, g,
                      score_rule(hd, std::nullopt, std::nullopt, std::nullopt), drop, out, lse);
  });
  return {out, lse};
}

at::Tensor attention_backward_cpu(const at::Tensor& grad_out_in, const at::Tensor& qkv_in,
                                  const std::optional<at::Tensor>& mask_in, const at::Tensor& out,
                                  const at::Tensor& lse, int64_t n_heads, double dropout_p,
                                  const std::optional<at::Tensor>& seed, std::optional<int64_t> n_kv_heads_in) {
  const int64_t n_kv_heads = n_kv_heads_in.value_or(n_heads);
  check_cpu_inputs(qkv_in, mask_in, n_heads, n_kv_heads);
  if (computes_in_float64(qkv_in, n_heads, n_kv_heads)) {
    return attention_backward_cpu(grad_out_in.to(at::kDouble), qkv_in.to(at::kDouble), mask_in,
                                  out.to(at::kDouble), lse.to(at::kDouble), n_heads, dropout_p, seed, n_kv_heads)
        .to(at::kFloat);
  }
  const auto drop = dropout_of(dropout_p, seed);
  const auto qkv = blas_rows(qkv_in);
  const auto mask = contiguous_mask(mask_in);
  const int64_t B = qkv.size(0), T = qkv.size(1), hd = qkv.size(2) / (n_heads + 2 * n_kv_heads);
  const auto g = geometry(B, T, T, n_heads, n_kv_heads, hd, kNoWindow, kBwdBlockQ, kBwdBlockK);
  TORCH_CHECK_VALUE(grad_out_in.sizes() == out.sizes() && out.sizes() == at::IntArrayRef({g.B, g.Tq, g.dim}),
                    "grad_out and out must have shape (B, T, n_heads * head_dim) = (", g.B, ", ", g.Tq, ", ", g.dim,
                    "); got ", grad_out_in.sizes(), " and ", out.sizes());
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef({g.B, g.H, g.Tq}), "lse must have shape (B, H, T); got ",
                    lse.sizes());
  const auto grad_out = grad_out_in.to(qkv.scalar_type()).contiguous();
  auto grad_qkv = at::empty({g.B, g.Tq, qkv.size(2)}, qkv.options());  // every element is written
  if (grad_qkv.numel() == 0) {
    return grad_qkv;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "causal_attention_backward", [&] {
    BackwardPass<scalar_t>(grad_out, fused_heads(qkv.const_data_ptr<scalar_t>(), qkv, n_heads, n_kv_heads), mask,
                           out.contiguous(), lse.contiguous(), g,
                           score_rule(hd, std::nullopt, std::nullopt, std::nullopt), drop,
                           fused_heads(grad_qkv.data_ptr<scalar_t>(), grad_qkv, n_heads, n_kv_heads))
        .run();
  });
  return grad_qkv;
}

std::tuple<at::Tensor, at::Tensor> attention_heads_forward_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const std::optional<at::Tensor>& mask_in,
    std::optional<double> scale, std::optional<int64_t> window, std::optional<double> softcap, double dropout_p,
    const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& sinks_in) {
  check_heads(q_in, k_in, v_in, mask_in, scale, window, softcap, dropout_p, sinks_in);
  const int64_t B = q_in.size(0), H = q_in.size(1), Tq = q_in.size(2), hd = q_in.size(3);
  const int64_t Hkv = k_in.size(1), Tk = k_in.size(2);
  if (tile::computes_in_float64(q_in.scalar_type(), hd)) {
    auto [out, lse] = attention_heads_forward_cpu(q_in.to(at::kDouble), k_in.to(at::kDouble), v_in.to(at::kDouble),
                                                  mask_in, scale, window, softcap, dropout_p, seed, sinks_in);
    return {out.to(at::kFloat), lse};
  }
  const auto acc_dtype = q_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor sinks = sinks_in.has_value() ? sinks_in->to(acc_dtype).contiguous() : at::Tensor();
  const auto drop = dropout_of(dropout_p, seed);
  const auto rule = score_rule(hd, scale, window, softcap);
  if (decodes_heads(q_in, k_in, v_in, softcap, dropout_p)) {  // a decode step: stream the past once
    return decode_heads_cpu(q_in, k_in, v_in, mask_in, rule.scale, window, sinks);
  }
  const auto q = heads_rows(q_in), k = heads_rows(k_in), v = heads_rows(v_in);
  const auto mask = contiguous_mask(mask_in);
  const auto g = geometry(B, Tq, Tk, H, Hkv, hd, rule.window, kBlockQ, kBlockK);
  auto out = at::empty({B, Tq, H, hd}, q.options());
  auto lse = at::empty({B, H, Tq}, q.options().dtype(acc_dtype));
  if (out.numel() == 0) {
    return {out, lse};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "causal_attention_heads_forward", [&] {
    const HeadOperands<const scalar_t> in{heads_view(q.const_data_ptr<scalar_t>(), q),
                                          heads_view(k.const_data_ptr<scalar_t>(), k),
                                          heads_view(v.const_data_ptr<scalar_t>(), v)};
    forward<scalar_t>(in, mask, g, rule, drop, out, lse, sinks);
  });
  return {out, lse};
}

at::Tensor attention_sinks_backward(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                                    const at::Tensor& sinks) {
  // Symbolic sizes: the op is composite, traced with the shapes torch.compile and torch.export give it.
  TORCH_CHECK_VALUE(out.dim() == 4 && grad_out.sym_sizes() == out.sym_sizes() && lse.dim() == 3 &&
                        lse.sym_size(0) == out.sym_size(0) && lse.sym_size(1) == out.sym_size(2) &&
                        lse.sym_size(2) == out.sym_size(1) && sinks.dim() == 1 && sinks.sym_size(0) == out.sym_size(2),
                    "attention_sinks_backward: grad_out and out (B, Tq, H, hd), lse (B, H, Tq) and sinks (H,) must "
                    "match; got ", grad_out.sym_sizes(), ", ", out.sym_sizes(), ", ", lse.sym_sizes(), " and ",
                    sinks.sym_sizes());
  const auto acc = lse.scalar_type();
  const auto rows = (grad_out.to(acc) * out.to(acc)).sum(-1).transpose(1, 2);  // (B, H, Tq): dO . O
  const auto sink_p = at::exp(sinks.to(acc).view({1, -1, 1}) - lse);           // 0 where lse = +inf (no key)
  return (sink_p * rows).sum({0, 2}).neg().to(sinks.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_heads_backward_cpu(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& mask_in, const at::Tensor& out, const at::Tensor& lse,
    std::optional<double> scale, std::optional<int64_t> window, std::optional<double> softcap, double dropout_p,
    const std::optional<at::Tensor>& seed) {
  check_heads(q_in, k_in, v_in, mask_in, scale, window, softcap, dropout_p);
  const int64_t B = q_in.size(0), H = q_in.size(1), Tq = q_in.size(2), hd = q_in.size(3);
  const int64_t Hkv = k_in.size(1), Tk = k_in.size(2);
  TORCH_CHECK_VALUE(grad_out_in.sizes() == out.sizes() && out.sizes() == at::IntArrayRef({B, Tq, H, hd}),
                    "grad_out and out must have shape (B, Tq, H, head_dim) = (", B, ", ", Tq, ", ", H, ", ", hd,
                    "); got ", grad_out_in.sizes(), " and ", out.sizes());
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef({B, H, Tq}), "lse must have shape (B, H, Tq) = (", B, ", ", H,
                    ", ", Tq, "); got ", lse.sizes());
  if (tile::computes_in_float64(q_in.scalar_type(), hd)) {
    auto [dq, dk, dv] = attention_heads_backward_cpu(
        grad_out_in.to(at::kDouble), q_in.to(at::kDouble), k_in.to(at::kDouble), v_in.to(at::kDouble), mask_in,
        out.to(at::kDouble), lse.to(at::kDouble), scale, window, softcap, dropout_p, seed);
    return {dq.to(at::kFloat), dk.to(at::kFloat), dv.to(at::kFloat)};
  }
  const auto drop = dropout_of(dropout_p, seed);
  const auto q = heads_rows(q_in), k = heads_rows(k_in), v = heads_rows(v_in);
  const auto mask = contiguous_mask(mask_in);
  const auto rule = score_rule(hd, scale, window, softcap);
  const auto g = geometry(B, Tq, Tk, H, Hkv, hd, rule.window, kBwdBlockQ, kBwdBlockK);
  const auto grad_out = grad_out_in.to(q.scalar_type()).contiguous();
  auto dq = heads_grad_like(q_in), dk = heads_grad_like(k_in), dv = heads_grad_like(v_in);  // every element written
  if (dq.numel() == 0 || dk.numel() == 0) {
    return {dq.zero_(), dk.zero_(), dv.zero_()};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "causal_attention_heads_backward", [&] {
    const HeadOperands<const scalar_t> in{heads_view(q.const_data_ptr<scalar_t>(), q),
                                          heads_view(k.const_data_ptr<scalar_t>(), k),
                                          heads_view(v.const_data_ptr<scalar_t>(), v)};
    const HeadOperands<scalar_t> grad{heads_view(dq.data_ptr<scalar_t>(), dq), heads_view(dk.data_ptr<scalar_t>(), dk),
                                      heads_view(dv.data_ptr<scalar_t>(), dv)};
    BackwardPass<scalar_t>(grad_out, in, mask, out.contiguous(), lse.contiguous(), g, rule, drop, grad).run();
  });
  return {dq, dk, dv};
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
