// causal_attention: the attention core of a GPT-style causal self-attention layer.
//
// Shapes (B = batch, T = sequence length, H = heads, hd = head_dim, dim = H * hd):
//   qkv               (B, T, 3 * dim)   the output of the qkv projection, split q | k | v;
//                                       head h uses columns h*hd:(h+1)*hd of each third.
//   key_padding_mask  (B, T) bool       True = real token, False = padding (never attended to).
//   result            (B, T, dim)       heads joined back, ready for the output projection.
//
// Query t attends keys 0..t that are real; scores are q.k / sqrt(hd), masked scores are -inf
// before the softmax, and a query with no allowed key gives 0 (never NaN).
//
// Attention-weight dropout (training): with probability dropout_p in [0, 1), each weight of the
// softmax is dropped and the kept ones are scaled by 1 / (1 - dropout_p): P_drop = P * keep / (1 - p),
// out = P_drop v. On CPU the keep decisions are a pure function of (seed, b, h, i, j) (Philox4x32-10,
// see dropout_keep_mask), the same in the forward and the backward, for any thread count.
// dropout_p = 0 is the exact path, bit for bit.
#pragma once

#include <ATen/ATen.h>

#include "causal_attention/link.h"

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace causal_attention {

// Validates (qkv, n_heads) for the attention core: 3-D, floating, last dim = 3 * n_heads * hd.
void check_qkv(const at::Tensor& qkv, int64_t n_heads);
// The same with n_kv_heads key/value heads (grouped-query attention): n_kv_heads divides n_heads and the
// last dim is (n_heads + 2 * n_kv_heads) * hd, q | k | v.
void check_qkv(const at::Tensor& qkv, int64_t n_heads, int64_t n_kv_heads);

// Validates the operands of attention over separate heads (attention_heads_forward): q (B, H, Tq, hd), k and
// v (B, Hkv, Tk, hd) of one floating dtype and device, Hkv dividing H, Tq <= Tk; key_mask bool (B, Tk);
// scale and softcap positive and finite, window positive; dropout only where Tq = Tk; sinks floating (H,) on
// q's device.
void check_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& key_mask, std::optional<double> scale, std::optional<int64_t> window,
                 std::optional<double> softcap, double dropout_p,
                 const std::optional<at::Tensor>& sinks = std::nullopt);

// Validates a user key padding mask against x (B, T, dim) and returns it as a bool (B, T)
// tensor (an integer 0/1 mask means the same as bool; a float mask is ambiguous: TypeError).
std::optional<at::Tensor> normalize_key_padding_mask(const std::optional<at::Tensor>& key_padding_mask,
                                                     const at::Tensor& x);

// A key padding mask as bool: bool is copied; an integer mask must hold only 0 and 1 (ValueError).
at::Tensor mask_to_bool(const at::Tensor& key_padding_mask);

// Validates a dropout probability: 0 <= dropout_p < 1 (ValueError naming dropout).
void check_dropout(double dropout_p);

// A dropout seed's value: an int64 tensor with one element (0-d or (1,)), on the CPU.
int64_t seed_value(const at::Tensor& seed);

// A fresh dropout seed (0-d int64) from the default CPU generator (torch.manual_seed reproduces it).
at::Tensor draw_dropout_seed();

// The keep decisions of attention-weight dropout: bool (B, H, T, T), keep[b, h, i, j] = whether
// weight (b, h, i, j) is kept under this seed and dropout_p (all true for dropout_p = 0). It is
// what the fused kernels compute, tile by tile, for the reference and the tests.
at::Tensor dropout_keep_mask(const at::Tensor& seed, int64_t B, int64_t H, int64_t T, double dropout_p);

// Generation: checks that 0 <= start <= end <= start + new_tokens and end <= max_len for every
// sequence (ValueError naming the sequence; "KV cache overflow" past max_len).
void check_cache_positions(const at::Tensor& start, const at::Tensor& end, int64_t new_tokens, int64_t max_len);
// The same over `batch` positions in memory (no tensor: a decode step's checks cost no op call).
void check_cache_positions(const int64_t* start, const int64_t* end, int64_t batch, int64_t new_tokens,
                           int64_t max_len);

// Generation: the cache lengths after a step of new_tokens tokens per sequence, key_padding_mask
// (B, new_tokens) bool marking the real ones (right padding, checked) or none (all real). Each
// sequence's capacity is judged by its own real new tokens: ValueError on overflow.
at::Tensor cache_end(const at::Tensor& lengths, const std::optional<at::Tensor>& key_padding_mask, int64_t new_tokens,
                     int64_t max_len);

// x (..., in) @ weight^T (+ bias) -> (..., out), differentiable: the layer's and the GPT's projections.
// at::linear, except for bfloat16/half on a CPU without arithmetic in that type
// (!kernels::half_arithmetic), where it is kernels::widened_linear: float32's speed instead of a
// fraction of it; and for float32 with nothing to differentiate, where it is oneDNN's float32 inner
// product where kernels::float32_products says so.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// The attention core through the dispatcher (autograd, torch.compile, every backend). With
// dropout_p > 0 and no seed, a seed is drawn from the default CPU generator (draw_dropout_seed);
// on other devices dropout is scaled_dot_product_attention's (its own generator; seed unused).
// n_kv_heads: grouped-query attention, qkv (B, T, (H + 2 Hkv) * hd) (as attention_forward_cpu).
at::Tensor attention(const at::Tensor& qkv, const std::optional<at::Tensor>& key_padding_mask,
                     int64_t n_heads, double dropout_p = 0.0, const std::optional<at::Tensor>& seed = std::nullopt,
                     std::optional<int64_t> n_kv_heads = std::nullopt);

namespace kernels {

// Composition of ATen operations (scaled_dot_product_attention); any device, autograd by ATen.
at::Tensor attention_composite(const at::Tensor& qkv, const std::optional<at::Tensor>& key_padding_mask,
                               int64_t n_heads, double dropout_p = 0.0,
                               std::optional<int64_t> n_kv_heads = std::nullopt);

// The specification in ATen operations (materialises T x T): differentiable any number of times;
// the fused kernel's double backward uses it. keep (B, H, T, T) bool: the dropout decisions
// (P_drop = P * keep / (1 - dropout_p)), or none. window: each query sees its last `window` keys
// (its own included) only (a sliding-window model's training path).
at::Tensor attention_math(const at::Tensor& qkv, const std::optional<at::Tensor>& key_padding_mask,
                          int64_t n_heads, double dropout_p = 0.0, const std::optional<at::Tensor>& keep = std::nullopt,
                          std::optional<int64_t> n_kv_heads = std::nullopt, std::optional<int64_t> window = std::nullopt);

// qkv (B, T, (H + 2 Hkv) * hd) -> q (B, H, T, hd), k and v (B, Hkv, T, hd), by views (checked).
std::tuple<at::Tensor, at::Tensor, at::Tensor> split_heads(const at::Tensor& qkv, int64_t n_heads, int64_t n_kv_heads);

// Fused CPU forward: (out (B, T, H * hd), lse (B, H, T)). lse is float32 (float64 for float64 inputs);
// a query with no allowed key has out = 0 and lse = +inf. key_padding_mask: bool (B, T) or none.
// dropout_p > 0: attention-weight dropout with this seed (lse stays the softmax's, before dropout).
// n_kv_heads: grouped-query attention, qkv (B, T, (H + 2 Hkv) * hd) and query head h reading key/value
// head h / (H / Hkv); none: Hkv = H, qkv (B, T, 3 * dim).
std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& qkv,
                                                         const std::optional<at::Tensor>& key_padding_mask,
                                                         int64_t n_heads, double dropout_p = 0.0,
                                                         const std::optional<at::Tensor>& seed = std::nullopt,
                                                         std::optional<int64_t> n_kv_heads = std::nullopt);

// Fused CPU backward from the forward's out and lse: grad_qkv, qkv's shape. dropout_p, seed and
// n_kv_heads must be the forward's: the keep decisions are regenerated.
at::Tensor attention_backward_cpu(const at::Tensor& grad_out, const at::Tensor& qkv,
                                  const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
                                  const at::Tensor& lse, int64_t n_heads, double dropout_p = 0.0,
                                  const std::optional<at::Tensor>& seed = std::nullopt,
                                  std::optional<int64_t> n_kv_heads = std::nullopt);

// Fused CPU attention over separate heads, the form transformers hands its attention functions:
// q (B, H, Tq, hd), k and v (B, Hkv, Tk, hd), each head's rows dense (any other layout is copied),
// Hkv dividing H (query head h reads key/value head h / (H / Hkv), each read once per group).
// Query i sits at key position Tk - Tq + i (Tq <= Tk: a prefill, or queries against a cache) and sees
// the keys j <= that position whose key_mask (B, Tk) bool entry is true (none: all), and with a window
// only those with position - j < window. Scores are q . k * scale (default 1 / sqrt(hd)), with a softcap
// softcap * tanh(scores / softcap). sinks (H,) (gpt-oss): query head h's softmax takes one more logit,
// sinks[h], of value 0, so that its weights sum to less than 1. Returns (out (B, Tq, H, hd), lse (B, H, Tq),
// float32 or float64, the sink's logit included); a query with no allowed key gives 0 and lse +inf.
// dropout_p > 0 needs Tq = Tk (as attention_forward_cpu).
std::tuple<at::Tensor, at::Tensor> attention_heads_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& key_mask,
    std::optional<double> scale = std::nullopt, std::optional<int64_t> window = std::nullopt,
    std::optional<double> softcap = std::nullopt, double dropout_p = 0.0,
    const std::optional<at::Tensor>& seed = std::nullopt, const std::optional<at::Tensor>& sinks = std::nullopt);

// Its backward from the forward's out and lse: (dq, dk, dv), each of its input's shape (and layout where
// that is dense). The other arguments must be the forward's; with sinks, the forward's out and lse carry
// them (attention_sinks_backward gives the sinks' own gradient).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_heads_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_mask, const at::Tensor& out, const at::Tensor& lse,
    std::optional<double> scale = std::nullopt, std::optional<int64_t> window = std::nullopt,
    std::optional<double> softcap = std::nullopt, double dropout_p = 0.0,
    const std::optional<at::Tensor>& seed = std::nullopt);

// The gradient of the sinks (H,) of attention_heads_forward_cpu from its out (B, Tq, H, hd), lse (B, H, Tq)
// and grad_out: -sum over b, i of e^(sinks[h] - lse) * (grad_out . out) (a sink's probability times the
// row's dO . O), in the sinks' dtype. ATen operations: differentiable, and traced as they are.
at::Tensor attention_sinks_backward(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                                    const at::Tensor& sinks);

// The layout of attention_heads_backward_cpu's gradient of x (B, heads, T, hd): x's where x is dense with
// its last dimension dense (transformers' query, a transposed view), else contiguous. Its meta kernel too.
at::Tensor heads_grad_like(const at::Tensor& x);

// dropout_keep_mask on the CPU (the seed is a CPU tensor).
at::Tensor dropout_keep_mask_cpu(const at::Tensor& seed, int64_t B, int64_t H, int64_t T, double dropout_p);

// Static KV cache (B, Hkv, max_len, hd): writes the k and v of the real new tokens of qkv (B, t, 3 * dim;
// with n_kv_heads (B, t, (H + 2 Hkv) * hd)), the first end[b] - start[b] of sequence b, at positions
// start[b] .. end[b] - 1 (right padding is never written). Positions are checked as by
// check_cache_positions. n_kv_heads: none for H.
void kv_cache_write_cpu(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& start, const at::Tensor& end, int64_t n_heads,
                        std::optional<int64_t> n_kv_heads = std::nullopt);

// Attention of the t new queries in qkv (B, t, 3 * dim) against the cache: new query i of sequence
// b attends positions j <= min(start[b] + i, end[b] - 1) (end[b]: the cache length with the new
// real tokens). Returns (B, t, H * hd); a query with no visible key gives 0. With n_kv_heads, query
// head h reads cache head h / (H / Hkv).
at::Tensor decode_attention_cpu(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& start, const at::Tensor& end, int64_t n_heads,
                                std::optional<int64_t> n_kv_heads = std::nullopt);

// A decode step of the whole layer against its KV cache, in one op: end = cache_end(lengths,
// key_padding_mask, t, max_len) (right padding and room checked), qkv = x (B, t, dim) @ qkv_weight^T
// (+ qkv_bias), its real new keys and values written as kv_cache_write writes them, out =
// proj(decode_attention(qkv)), and lengths advanced to end; the same values, bit for bit, as those
// ops one after the other (the linear layers as few_rows_linear_cpu), which it runs in turn in one
// call. Biases and the mask (bool (B, t), True = real) are optional; no autograd. Returns (B, t, dim).
// n_kv_heads: qkv_weight ((H + 2 Hkv) * hd, dim) and the cache (B, Hkv, max_len, hd).
at::Tensor decode_layer_cpu(const at::Tensor& x, const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias,
                            const at::Tensor& proj_weight, const std::optional<at::Tensor>& proj_bias,
                            const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& lengths,
                            const std::optional<at::Tensor>& key_padding_mask, int64_t n_heads,
                            std::optional<int64_t> n_kv_heads = std::nullopt);

// x (..., in) @ weight^T (+ bias) -> (..., out) for the few rows of a decode step, streaming the weight
// (out, in) from memory once; sums in float32 for bfloat16/half (float64 for float64), one rounding.
// Any number of rows is computed, but BLAS is faster past a handful. No autograd.
at::Tensor few_rows_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// A zeroed CPU tensor for a KV cache's keys or values: of at least one transparent huge page (2 MB
// on x86-64; the kernel's hpage_pmd_size), a mapping of its own that starts at a huge-page boundary,
// its whole huge pages advised to be huge (Linux, madvise MADV_HUGEPAGE; the tail, less than one,
// stays on small pages), where torch's allocator leaves it on 4 KB pages. Copies of it (clone, .to,
// deepcopy) are torch's, on 4 KB pages. A decode step streams the whole cache; on 4 KB pages
// every 4 KB of it costs a TLB miss.
// Smaller, or on another device than the CPU (device; none: the CPU): at::zeros. (The device is
// also what FakeTensorMode, compiling or exporting, needs of the op: it calls an op without tensor
// arguments with device=meta.)
at::Tensor cache_zeros(at::IntArrayRef size, at::ScalarType dtype, std::optional<at::Device> device = std::nullopt);

// An uninitialised CPU tensor on memory as cache_zeros's (smaller than a huge page: torch's own), for
// weights a loader fills at once: their first touch makes the huge pages, with no copy afterwards
// (advise_huge_pages then finds them there).
at::Tensor huge_page_empty(at::IntArrayRef size, at::ScalarType dtype);

// Moves the whole transparent huge pages inside a CPU tensor's storage onto huge pages, in place
// (Linux: madvise MADV_HUGEPAGE, then MADV_COLLAPSE a huge page at a time, Linux 6.1 and later):
// the values, the address and the tensor stay as they are; the memory around the storage is not
// advised. Pages this process shares copy-on-write with another (after a fork) are not moved (the
// collapse would copy them into memory of its own), nor anything where the administrator set THP to
// "never". Returns the bytes of those whole huge pages that are on huge pages after the call (those
// already there included; 0 where the kernel could not: an older kernel, no huge page free; where
// there is less than a huge page inside the storage, or no storage: a sparse or MKLDNN tensor; and
// elsewhere than Linux). A tensor not on the CPU is an error (ValueError). make_cache calls it on
// the layer's weights: a decode step streams them with the cache, and on 4 KB pages every 4 KB of
// them costs a TLB miss.
int64_t advise_huge_pages(const at::Tensor& tensor);

// The instruction set the CPU kernel's element-wise routines were chosen for at run time.
const char* cpu_capability();

// What runs the attention kernels' tile products of dtype here (an even head_dim for bfloat16's
// pairs): "AMX-BF16 tiles" or "AVX512-BF16 pairs" (bfloat16), "<ISA> float32 micro-kernel" (float32,
// and half / bfloat16 widened to it) or "BLAS" (float64, CPUs without AVX2).
std::string tile_products(at::ScalarType dtype);

// Whether this CPU multiplies dtype natively on the engine's path: float32 and float64 always;
// bfloat16 with AVX512-BF16 and half with AVX512-FP16, on the AVX512 path (cpu_capability).
bool half_arithmetic(at::ScalarType dtype);

// What multiplies widened_addmm's float32 blocks now: "oneDNN+sgemm" (oneDNN's inner product where the
// weight is in its (out, in) layout, sgemm for the rest; where torch has oneDNN, torch.backends.mkldnn is
// enabled and its float32 products are IEEE) or "sgemm".
const char* widened_products();

// What multiplies project's float32 products where nothing is differentiated: "oneDNN" (its float32
// inner product: torch has oneDNN, torch.backends.mkldnn is enabled and its float32 products are IEEE;
// for plain CPU operands, a row-major weight, no CPU autocast) or "ATen" (at::linear). MKL's sgemm
// takes slower paths on AMD CPUs than oneDNN's. Training keeps at::linear.
const char* float32_products();

// a (M, K) @ b (K, N) (+ bias (N,)) -> (M, N), bfloat16 or half operands of any strides, each output
// summed in float32 from exact widenings (float32 blocks, widened_products) and rounded once to the
// dtype. No autograd.
at::Tensor widened_addmm_cpu(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias);
at::Tensor widened_addmm_meta(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias);
// widened_addmm(a, b) and b's column sums b.sum(0) -> ((M, N) in the dtype, (N,) float32), the sums taken
// from b's float32 widening (a weight gradient a^T g and its bias gradient in one pass over g). No autograd.
std::tuple<at::Tensor, at::Tensor> widened_addmm_sums_cpu(const at::Tensor& a, const at::Tensor& b);
std::tuple<at::Tensor, at::Tensor> widened_addmm_sums_meta(const at::Tensor& a, const at::Tensor& b);

// Rotary positions, rotate-half layout (Llama's): qkv (..., (H + 2 Hkv) * hd) with cos and sin broadcasting
// to (..., hd) in qkv's dtype -> a new qkv whose q and k heads are x * cos + rotate_half(x) * sin (each
// product rounded to the dtype, then the sum, as ATen's composition of them) and whose v is copied. One
// pass; no autograd (Rotary::apply differentiates the composition).
at::Tensor rotary_qkv_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
                          int64_t n_kv_heads);
at::Tensor rotary_qkv_meta(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
                           int64_t n_kv_heads);

// x (..., in) @ weight^T (+ bias) -> (..., out) summed in float32 (float64 for float64) and returned
// unrounded: float32 for bfloat16/half operands (each product of two exact widenings), x's dtype
// otherwise. Up to 64 rows (a decode step's) stream the weight (few_rows_linear_cpu's sums, not
// rounded); more are widened_addmm's float32 sums. No autograd (causal_attention::unrounded_linear
// has it).
at::Tensor unrounded_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor unrounded_linear_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// x (..., in) @ weight^T (+ bias) -> (..., out) by widened_addmm, its gradients by the same products
// (differentiable any number of times; the bias's gradient summed in float32).
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// project below autograd (the op's CompositeExplicitAutograd kernel): the same product, no graph.
at::Tensor project_no_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// Whether project widens: x, weight and bias CPU tensors of one half dtype that
// this CPU has no arithmetic for, shapes that match, no CPU autocast.
bool project_widens(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

}  // namespace kernels
}  // namespace causal_attention
