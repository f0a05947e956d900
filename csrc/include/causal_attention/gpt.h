// The C++ GPT: the Python GPT (src/causal_attention/gpt.py) with the same architecture, options and
// parameter names, built from causal_attention::CausalSelfAttention, and its generation over
// ragged prompts with the C++ KV cache.
//
//   auto model = causal_attention::load_gpt("demo_out");   // config.json + model.safetensors (GPT.save)
//   auto logits = model->forward(tokens, mask);             // (B, T) int64 -> (B, T, V)
//   causal_attention::GenerateOptions options;
//   options.max_new_tokens = 13;
//   options.eos_id = 11;
//   auto answers = model->generate({{12, 1, 2, 3, 10}, {12, 4, 10}}, options).tokens;
//
// Parameters: tok, pos (embeddings; none with rotary positions), blocks.{i}.ln1, .attn.qkv, .attn.proj,
// .ln2, .mlp.0, .mlp.2 (the MLP's Linears; a gated MLP's .mlp.gate_up and .mlp.down), ln_f and, with an
// untied head, head; with bias = false the Linears and LayerNorms have weights only (per-projection
// biases: qkv_bias, proj_bias, mlp_bias). Every option of the Llama family is built.
#pragma once

#include "causal_attention/module.h"

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace causal_attention {

// GPTConfig of gpt.py, field by field (config.json holds these keys plus "format").
struct GPTConfig {
  int64_t vocab_size = 0;
  int64_t max_len = 0;
  int64_t dim = 128;
  int64_t n_layers = 3;
  int64_t n_heads = 4;
  std::optional<int64_t> mlp_hidden;  // none: 4 * dim
  double layer_norm_eps = 1e-5;
  std::string activation = "gelu";  // "gelu" (exact), "gelu_tanh" (GPT-2's gelu_new) or "silu"
  bool bias = true;
  bool tie_head = true;
  double attn_dropout = 0.0;
  double resid_dropout = 0.0;
  double embd_dropout = 0.0;
  // The Llama family's options (gpt.py's; their defaults are GPT-2's architecture, and config.json
  // holds them only where they differ).
  std::optional<int64_t> n_kv_heads;  // grouped-query attention's key/value heads; none: n_heads
  std::string norm = "layernorm";     // or "rmsnorm" (Llama's: the mean square in float32)
  bool gated_mlp = false;             // down(act(gate(x)) * up(x)), gate | up in one Linear mlp.gate_up
  std::string positions = "learned";  // or "rope" (rotary, rotate-half layout, no pos embedding)
  double rope_theta = 10000.0;
  struct RopeScaling {  // Llama 3's frequency scaling (rope_type "llama3")
    double factor, low_freq_factor, high_freq_factor, original_max_position_embeddings;
  };
  std::optional<RopeScaling> rope_scaling;
  std::optional<bool> qkv_bias, proj_bias, mlp_bias;  // none: as bias
  std::optional<int64_t> sliding_window;              // keys each query sees, its own included (Mistral's)

  int64_t hidden() const { return mlp_hidden.value_or(4 * dim); }
  int64_t head_dim() const { return dim / n_heads; }
  int64_t kv_heads() const { return n_kv_heads.value_or(n_heads); }
  bool qkv_has_bias() const { return qkv_bias.value_or(bias); }
  bool proj_has_bias() const { return proj_bias.value_or(bias); }
  bool mlp_has_bias() const { return mlp_bias.value_or(bias); }
  // Every field checked as GPTConfig.__post_init__ does; a std::invalid_argument naming the field.
  void validate() const;
  // From config.json's text, by gpt.py's GPTConfig.from_dict rules: an unknown key, a missing one,
  // a JSON type other than the field's (true or 2.0 for an int) or a "format" other than
  // "causal_attention.gpt" is a FormatError naming `source` and the key. An older version's file
  // (the demo's, with mlp_ratio) is read as that version's model: the options it lacks take the
  // defaults above, named in a warning on stderr.
  static GPTConfig from_json(const std::string& text, const std::string& source = "config.json");
  std::string to_json() const;
};

// LayerNorm with an optional bias (torch::nn::LayerNorm has none to turn off): weight, [bias]. With
// rms, Llama's RMSNorm instead (weight only): x / sqrt(mean(x^2) + eps) in float32, rounded back to
// x's dtype, times the weight (gpt.py's RMSNorm).
class LayerNormImpl : public torch::nn::Module {
 public:
  LayerNormImpl(int64_t dim, double eps, bool bias, bool rms = false);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;  // bias undefined without bias

 private:
  int64_t dim_;
  double eps_;
  bool rms_;
};
TORCH_MODULE(LayerNorm);

// The gated MLP (gpt.py's GatedMLP): down(act(gate(x)) * up(x)), gate | up in one Linear gate_up,
// then dropout (SwiGLU with activation "silu"). x (..., dim) -> (..., dim); step: a decode step's few
// rows (each weight streamed once by few_rows_linear), else the products by project.
class GatedMLPImpl : public torch::nn::Module {
 public:
  // dtype, init: the parameters' (CausalSelfAttentionOptions's).
  explicit GatedMLPImpl(const GPTConfig& config, at::ScalarType dtype = at::kFloat, Init init = Init::kRandom);
  at::Tensor forward(const at::Tensor& x, bool step = false);
  torch::nn::Linear gate_up{nullptr}, down{nullptr};
  torch::nn::Dropout drop{nullptr};

 private:
  int64_t hidden_;
  bool silu_;
  std::string approximate_;
};
TORCH_MODULE(GatedMLP);

// Rotary positions (gpt.py's Rotary): cos and sin (..., hd) at each token's position in the model's dtype.
struct Rotary {
  at::Tensor cos, sin;
  // positions (...) int64, inv_freq (hd / 2,) float32 -> cos and sin (..., hd) in dtype (computed in float32).
  static Rotary at(const at::Tensor& positions, const at::Tensor& inv_freq, at::ScalarType dtype);
  // qkv (..., (H + 2 Hkv) * hd) -> the same with q and k rotated (rotate-half layout).
  at::Tensor apply(const at::Tensor& qkv, int64_t n_heads, int64_t kv_heads) const;
};

// The rotary frequencies (hd / 2,) float32, with Llama 3's scaling where config asks for it.
at::Tensor inverse_frequencies(const GPTConfig& config);

// Pre-LayerNorm block: x + drop(attn(ln1(x))), then x + mlp(ln2(x)) (mlp: Linear, GELU, Linear, Dropout).
class BlockImpl : public torch::nn::Module {
 public:
  // dtype, init: the parameters' (CausalSelfAttentionOptions's).
  explicit BlockImpl(const GPTConfig& config, at::ScalarType dtype = at::kFloat, Init init = Init::kRandom);
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& mask);
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& mask, KVCache& cache);
  // A rotary or sliding-window model's block, projection by projection: rotary holds cos and sin
  // (B, T, hd) at x's positions (null without rotary positions); cache may be null. With a cache and a
  // window: a prefill into empty caches, or one token per sequence.
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& mask, KVCache* cache,
                     const Rotary* rotary);
  // The MLP of forward without a cache, its products by causal_attention::project: (..., dim) -> (..., dim).
  at::Tensor mlp_forward(const at::Tensor& x);
  at::Tensor activate(const at::Tensor& x);  // the MLP's activation (mlp[1])

  LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Dropout attn_drop{nullptr};
  torch::nn::Sequential mlp{nullptr};  // null with a gated MLP
  GatedMLP gated{nullptr};             // registered as "mlp" with gated_mlp

 private:
  at::Tensor mlp_of(const at::Tensor& x, bool step);  // whichever MLP the block has
  // The sliding window's attention of qkv (B, t, (H + 2 Hkv) * hd), q and k rotated -> (B, t, H * hd);
  // with a cache, the keys and values are written and the lengths advance.
  at::Tensor attend_windowed(const at::Tensor& qkv, const std::optional<at::Tensor>& mask, KVCache* cache);
  std::optional<int64_t> n_kv_heads_;
  std::optional<int64_t> window_;  // GPTConfig.sliding_window
};
TORCH_MODULE(Block);

struct GenerateOptions {
  int64_t max_new_tokens = 32;
  std::optional<int64_t> top_k;     // none: greedy; else top-k sampling at the temperature
  double temperature = 1.0;         // must be positive (top-k divides the logits by it)
  std::optional<int64_t> eos_id;    // a sequence stops after generating it (it is kept)
  std::vector<int64_t> stop_ids;    // more ids that end a sequence as eos_id does (a list eos_token_id)
  int64_t pad_id = 0;               // fills the right padding of the prefill (never attended)
  std::optional<uint64_t> seed;     // top-k: a generator seeded so (torch.Generator().manual_seed)
  bool keep_logits = false;         // return every step's logits
  // A bfloat16/half model chooses from its head's float32 sums (GPTImpl::logits' float32), not from
  // logits rounded to its dtype, which make nearby logits equal (bfloat16 keeps 8 bits).
  bool float32_logits = true;
  // Called with (sequence, token) as each token is chosen, a sequence's in order (streaming).
  std::function<void(int64_t, int64_t)> on_token;
};

struct GenerateResult {
  std::vector<std::vector<int64_t>> tokens;  // per prompt, up to and including eos_id
  at::Tensor step_logits;                     // (B, steps, V) when keep_logits: the logits each token was chosen from
};

class GPTImpl : public torch::nn::Module {
 public:
  // dtype: the parameters' (none: float32), each module converted as it is built, so that a loader
  // of a half model never holds the whole model in float32 (initial values are drawn in float32).
  // init: Init::kSkip leaves every parameter uninitialised, in dtype, drawing nothing (load_gpt's,
  // which overwrites them all).
  explicit GPTImpl(GPTConfig config, std::optional<at::ScalarType> dtype = std::nullopt, Init init = Init::kRandom);

  // tokens (B, T) int64/int32, key_padding_mask (B, T) bool or 0/1 (True = real) -> logits (B, T, V),
  // zero at padding positions (as the Python forward).
  // float32_logits: a bfloat16/half model's logits in float32 (logits' float32).
  at::Tensor forward(const at::Tensor& tokens, const std::optional<at::Tensor>& key_padding_mask = std::nullopt,
                     bool float32_logits = false);
  // With caches (one per layer): tokens are each sequence's new tokens, right-padded by the mask;
  // positions continue from each cache's length -> final hidden states (B, T, dim), after ln_f.
  at::Tensor hidden_states(const at::Tensor& tokens, const std::optional<at::Tensor>& key_padding_mask,
                           std::vector<KVCache>& caches);
  // Hidden states (..., dim) -> logits (..., V); with float32 (a bfloat16/half model) the head's sums
  // in float32 as they are, not rounded to the model's dtype (unrounded_linear).
  at::Tensor logits(const at::Tensor& h, bool float32 = false) const;

  std::vector<KVCache> make_caches(int64_t batch_size, int64_t max_len) const;

  // GPT.generate of gpt.py with use_cache=True: the prompts prefilled right-padded into the caches
  // (the head only at each prompt's last token), then one token per sequence per step. The last
  // token is never fed back: longest prompt + max_new_tokens - 1 <= max_len.
  GenerateResult generate(const std::vector<std::vector<int64_t>>& prompts, const GenerateOptions& options);

  const GPTConfig& config() const { return config_; }
  at::Tensor head_weight() const;  // (V, dim): tok.weight when tied

  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};  // null when tied

 private:
  at::Tensor embed(const at::Tensor& tokens, const at::Tensor& offset);  // offset (B,) -> (B, T, dim)
  at::Tensor positions(const at::Tensor& tokens, const at::Tensor& offset) const;  // (B, T), checked
  // x through the blocks (caches: one per layer, or empty) at positions (B, T).
  at::Tensor run_blocks(at::Tensor x, const std::optional<at::Tensor>& mask, const at::Tensor& positions,
                        std::vector<KVCache>* caches);

  GPTConfig config_;
  at::Tensor inv_freq_;  // rotary frequencies, float32 (not a buffer: .to() would round it); undefined without
};
TORCH_MODULE(GPT);

// The model in directory: what GPT.save (or the demo) wrote (config.json + model.safetensors), or
// a transformers save_pretrained directory as it is (GPT2LMHeadModel / GPT2Model, LlamaForCausalLM,
// Qwen2ForCausalLM, MistralForCausalLM: config.json + model.safetensors or
// model.safetensors.index.json and its shards; q | k | v and gate | up read into the joined rows,
// GPT-2's Conv1D weights transposed). The headers are checked against the config before the model
// is built (for GPT.save's files as GPT.load does, with the same messages): all tensors of one
// floating dtype (the model's), none unexpected, no more bytes asked for than the files hold, none
// missing, each of the model's shape; a FormatError names the file and the tensor or option.
GPT load_gpt(const std::filesystem::path& directory);

// GPTConfig from transformers' config.json text (GPT2Config, LlamaConfig, Qwen2Config,
// MistralConfig), by convert.py's config_from_huggingface rules: an absent or null option takes the
// config class's default; an option GPT cannot represent is a FormatError naming it and `source`.
GPTConfig config_from_huggingface(const std::string& text, const std::string& source = "config.json");

}  // namespace causal_attention
