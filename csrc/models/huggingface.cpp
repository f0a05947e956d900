// Reading a transformers save_pretrained directory as it is (convert.py's and convert_llama.py's
// rules): GPT2LMHeadModel / GPT2Model, LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM,
// config.json plus model.safetensors or model.safetensors.index.json and its shards, in any one
// floating dtype. q | k | v and gate | up are read into the joined rows of attn.qkv and
// mlp.gate_up; GPT-2's Conv1D weights (in, out) are transposed. Every option GPT lacks, and every
// missing, unexpected, misshapen or mistyped tensor, is a FormatError naming it, found from the
// headers before the model is allocated.
#include "causal_attention/gpt.h"
#include "causal_attention/safetensors.h"
#include "checkpoint.h"

#include <ATen/ATen.h>
#include <torch/utils.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

namespace causal_attention::detail {

namespace {

using nlohmann::json;

// config.json's values read as transformers' config classes hold them: an absent or null key takes
// the class's default; a value of another JSON type is an error naming the key.
class HfConfig {
 public:
  HfConfig(json values, std::string source) : values_(std::move(values)), source_(std::move(source)) {}

  bool has(const char* key) const { return values_.contains(key) && !values_.at(key).is_null(); }
  const json& raw(const char* key) const { return values_.at(key); }

  int64_t integer(const char* key, std::optional<int64_t> fallback = std::nullopt) const {
    if (!has(key)) return required(key, fallback);
    const auto& value = values_.at(key);
    // A whole number written as a float (32.0) is read as Python's int() reads it.
    if (value.is_number_float() && std::isfinite(value.get<double>()) && value.get<double>() == std::trunc(value.get<double>()) &&
        std::abs(value.get<double>()) < 9.0e18) {
      return static_cast<int64_t>(value.get<double>());
    }
    if (!value.is_number_integer() || (value.is_number_unsigned() && value.get<uint64_t>() > INT64_MAX)) {
      throw FormatError(concat(source_, ": ", key, " must be an int; got ", value.dump()));
    }
    return value.get<int64_t>();
  }
  double number(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    const auto& value = values_.at(key);
    if (!value.is_number()) throw FormatError(concat(source_, ": ", key, " must be a number; got ", value.dump()));
    return value.get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    const auto& value = values_.at(key);
    if (!value.is_boolean()) throw FormatError(concat(source_, ": ", key, " must be true or false; got ", value.dump()));
    return value.get<bool>();
  }
  std::string text(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const auto& value = values_.at(key);
    if (!value.is_string()) throw FormatError(concat(source_, ": ", key, " must be a string; got ", value.dump()));
    return value.get<std::string>();
  }
  const std::string& source() const { return source_; }

 private:
  template <typename T>
  T required(const char* key, const std::optional<T>& fallback) const {
    if (!fallback.has_value()) throw FormatError(concat(source_, ": missing option ", key));
    return *fallback;
  }

  json values_;
  std::string source_;
};

[[noreturn]] void unsupported(const HfConfig& hf, const std::string& what) {
  throw FormatError(concat(hf.source(), ": ", what));
}

// GPT2Config options GPT has no counterpart for, with the value it implements.
const std::array<std::pair<const char*, bool>, 4> kGpt2Required{{{"scale_attn_weights", true},
                                                                  {"scale_attn_by_inverse_layer_idx", false},
                                                                  {"reorder_and_upcast_attn", false},
                                                                  {"add_cross_attention", false}}};

GPTConfig gpt2_config(const HfConfig& hf) {
  for (const auto& [option, value] : kGpt2Required) {
    if (hf.has(option) && hf.boolean(option, value) != value) {
      unsupported(hf, concat("GPT-2 option ", option, "=", hf.raw(option).dump(), " is not supported (GPT implements ",
                             option, "=", value ? "true" : "false", ")"));
    }
  }
  const auto activation = hf.text("activation_function", "gelu_new");
  GPTConfig c;
  if (activation == "gelu_new" || activation == "gelu_pytorch_tanh") {
    c.activation = "gelu_tanh";
  } else if (activation == "gelu") {
    c.activation = "gelu";
  } else {
    unsupported(hf, concat("GPT-2 option activation_function=\"", activation,
                           "\" is not supported (one of gelu, gelu_new, gelu_pytorch_tanh)"));
  }
  c.vocab_size = hf.integer("vocab_size", 50257);
  c.max_len = hf.integer("n_positions", 1024);
  c.dim = hf.integer("n_embd", 768);
  c.n_layers = hf.integer("n_layer", 12);
  c.n_heads = hf.integer("n_head", 12);
  if (c.n_heads > 0 && c.dim % c.n_heads != 0) {
    unsupported(hf, concat("GPT-2 config: n_head=", c.n_heads, " does not divide n_embd=", c.dim));
  }
  if (hf.has("n_inner")) c.mlp_hidden = hf.integer("n_inner");
  c.layer_norm_eps = hf.number("layer_norm_epsilon", 1e-5);
  c.bias = true;
  c.tie_head = hf.boolean("tie_word_embeddings", true);
  c.attn_dropout = hf.number("attn_pdrop", 0.1);
  c.resid_dropout = hf.number("resid_pdrop", 0.1);
  c.embd_dropout = hf.number("embd_pdrop", 0.1);
  return c;
}

// rope_theta and Llama 3's scaling from rope_parameters (transformers 5) or rope_theta / rope_scaling.
void read_rope(const HfConfig& hf, GPTConfig& c) {
  const auto object = [&](const char* key) {
    if (!hf.has(key)) return json::object();
    if (!hf.raw(key).is_object()) unsupported(hf, concat(key, " must be an object; got ", hf.raw(key).dump()));
    return hf.raw(key);
  };
  // As transformers' convert_rope_params_to_dict: a non-empty rope_scaling replaces rope_parameters.
  const json legacy = object("rope_scaling");
  const json params = legacy.empty() ? object("rope_parameters") : legacy;
  const std::string from = legacy.empty() ? "rope_parameters" : "rope_scaling";
  const auto field = [&](const json& from, const char* key) -> std::optional<json> {
    if (from.contains(key) && !from.at(key).is_null()) return from.at(key);
    return std::nullopt;
  };
  const auto theta = field(params, "rope_theta");
  if (theta.has_value() && !theta->is_number()) unsupported(hf, from + ".rope_theta must be a number");
  c.rope_theta = theta.has_value() ? theta->get<double>() : hf.number("rope_theta", 10000.0);
  std::optional<json> kind;
  for (const char* key : {"rope_type", "type"}) {
    if (!kind.has_value()) kind = field(params, key);
  }
  auto factor = field(params, "partial_rotary_factor");
  if (!factor.has_value() && hf.has("partial_rotary_factor")) factor = hf.raw("partial_rotary_factor");
  if (factor.has_value() && !(factor->is_number() && factor->get<double>() == 1.0)) {
    unsupported(hf, concat("partial_rotary_factor=", factor->dump(), " is not supported (GPT rotates the whole head)"));
  }
  const std::string type = !kind.has_value() ? "default" : kind->is_string() ? kind->get<std::string>() : kind->dump();
  if (type == "default") return;
  if (type != "llama3") {
    unsupported(hf, concat("rope type '", type, "' is not supported (GPT implements 'default' and 'llama3')"));
  }
  std::array<double, 4> values{};
  const std::array<const char*, 4> keys{"factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings"};
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto value = field(params, keys[i]);
    if (!value.has_value() || !value->is_number()) {
      unsupported(hf, concat("rope type 'llama3' needs a number ", keys[i]));
    }
    values[i] = value->get<double>();
  }
  c.rope_scaling = GPTConfig::RopeScaling{values[0], values[1], values[2], values[3]};
}

GPTConfig llama_config(const HfConfig& hf, const std::string& model_type) {
  GPTConfig c;
  c.dim = hf.integer("hidden_size");
  c.n_heads = hf.integer("num_attention_heads");
  // As convert_llama.py's `num_key_value_heads or heads`: 0 and null mean multi-head.
  const int64_t kv_heads = hf.integer("num_key_value_heads", 0) == 0 ? c.n_heads : hf.integer("num_key_value_heads");
  if (c.n_heads <= 0 || c.dim % c.n_heads != 0) {
    unsupported(hf, concat("num_attention_heads=", c.n_heads, " does not divide hidden_size=", c.dim));
  }
  if (hf.has("head_dim") && hf.integer("head_dim") != c.dim / c.n_heads) {
    unsupported(hf, concat("head_dim=", hf.integer("head_dim"), " is not supported (GPT's head_dim is hidden_size / "
                           "num_attention_heads = ", c.dim / c.n_heads, ")"));
  }
  const auto act = hf.text("hidden_act", "silu");
  if (act != "silu") {
    unsupported(hf, concat("hidden_act=\"", act, "\" is not supported (the Llama family's SwiGLU uses 'silu')"));
  }
  if (hf.integer("pretraining_tp", 1) != 1) {
    unsupported(hf, concat("pretraining_tp=", hf.integer("pretraining_tp"),
                           " is not supported (1: the plain projections)"));
  }
  read_rope(hf, c);
  const int64_t n_layers = hf.integer("num_hidden_layers");
  if (model_type == "mistral") {
    if (hf.has("sliding_window")) c.sliding_window = hf.integer("sliding_window");
  } else if (model_type == "qwen2" && hf.boolean("use_sliding_window", false) &&
             hf.integer("max_window_layers", 0) < n_layers) {
    // Qwen2 windows the layers from max_window_layers on; with none of them, every layer is full.
    unsupported(hf, concat("use_sliding_window=true is not supported for Qwen2 (per-layer windows from "
                           "max_window_layers=", hf.integer("max_window_layers", 0), ")"));
  }
  if (hf.has("layer_types")) {
    const auto& types = hf.raw("layer_types");
    const std::string expected = c.sliding_window.has_value() ? "sliding_attention" : "full_attention";
    if (!types.is_array()) unsupported(hf, "layer_types must be a list");
    for (const auto& type : types) {
      if (type != expected) {
        unsupported(hf, concat("layer_types entry ", type.dump(), " is not supported (every layer must be '",
                               expected, "')"));
      }
    }
  }
  bool qkv = false, proj = false, mlp = false;
  if (model_type == "qwen2") {
    qkv = true;
  } else if (model_type == "llama") {
    qkv = proj = hf.boolean("attention_bias", false);
    mlp = hf.boolean("mlp_bias", false);
  }
  c.vocab_size = hf.integer("vocab_size");
  c.max_len = hf.integer("max_position_embeddings", 2048);
  c.n_layers = n_layers;
  if (kv_heads != c.n_heads) c.n_kv_heads = kv_heads;
  c.mlp_hidden = hf.integer("intermediate_size");
  c.layer_norm_eps = hf.number("rms_norm_eps", 1e-6);
  c.activation = "silu";
  c.bias = false;
  if (qkv) c.qkv_bias = true;
  if (proj) c.proj_bias = true;
  if (mlp) c.mlp_bias = true;
  c.tie_head = hf.boolean("tie_word_embeddings", false);
  c.attn_dropout = hf.number("attention_dropout", 0.0);
  c.resid_dropout = c.embd_dropout = 0.0;
  c.norm = "rmsnorm";
  c.gated_mlp = true;
  c.positions = "rope";
  return c;
}

bool is_llama_type(const std::string& model_type) {
  return model_type == "llama" || model_type == "qwen2" || model_type == "mistral";
}

// One of their tensors and the rows of ours it fills, in row order; Conv1D weights are transposed.
struct Part {
  std::string name;
  int64_t rows;
  bool transposed;
};

// Their names for ours (the model's parameter names).
class Naming {
 public:
  Naming(const GPTConfig& config, bool llama, std::string prefix)
      : config_(config), llama_(llama), prefix_(std::move(prefix)) {}

  std::vector<Part> parts(const std::string& ours, const std::vector<int64_t>& shape) const {
    const int64_t rows = shape.empty() ? 0 : shape.front();
    if (ours == "head.weight") return {{"lm_head.weight", rows, false}};
    const auto block = block_name(ours, config_.n_layers);
    if (llama_) {
      if (!block.has_value()) {
        return {{ours == "tok.weight" ? "model.embed_tokens.weight" : "model.norm.weight", rows, false}};
      }
      const auto at = concat("model.layers.", block->first, ".");
      const auto& rest = block->second;
      const auto kind = rest.substr(rest.rfind('.') + 1);  // weight or bias
      const int64_t hd = config_.head_dim(), hidden = config_.hidden();
      if (rest == "ln1.weight") return {{at + "input_layernorm.weight", rows, false}};
      if (rest == "ln2.weight") return {{at + "post_attention_layernorm.weight", rows, false}};
      if (rest.rfind("attn.qkv.", 0) == 0) {
        const int64_t kv = config_.kv_heads() * hd;
        return {{at + "self_attn.q_proj." + kind, config_.n_heads * hd, false},
                {at + "self_attn.k_proj." + kind, kv, false},
                {at + "self_attn.v_proj." + kind, kv, false}};
      }
      if (rest.rfind("attn.proj.", 0) == 0) return {{at + "self_attn.o_proj." + kind, rows, false}};
      if (rest.rfind("mlp.gate_up.", 0) == 0) {
        return {{at + "mlp.gate_proj." + kind, hidden, false}, {at + "mlp.up_proj." + kind, hidden, false}};
      }
      return {{at + "mlp.down_proj." + kind, rows, false}};  // mlp.down
    }
    if (!block.has_value()) {
      const std::string theirs = ours == "tok.weight" ? "wte.weight" : ours == "pos.weight" ? "wpe.weight" : ours;
      return {{prefix_ + theirs, rows, false}};  // ln_f's names are GPT-2's
    }
    static const std::map<std::string, std::string> kModules{{"ln1", "ln_1"},          {"ln2", "ln_2"},
                                                             {"attn.qkv", "attn.c_attn"}, {"attn.proj", "attn.c_proj"},
                                                             {"mlp.0", "mlp.c_fc"},       {"mlp.2", "mlp.c_proj"}};
    const auto& rest = block->second;
    const auto dot = rest.rfind('.');
    const auto module = rest.substr(0, dot), kind = rest.substr(dot + 1);
    const bool conv1d = module != "ln1" && module != "ln2" && kind == "weight";
    return {{concat(prefix_, "h.", block->first, ".", kModules.at(module), ".", kind), rows, conv1d}};
  }

  // The shape their tensor must have.
  static std::vector<int64_t> shape_of(const Part& part, std::vector<int64_t> ours) {
    ours.front() = part.rows;
    if (part.transposed) std::reverse(ours.begin(), ours.end());
    return ours;
  }

  // Tensors a checkpoint may hold that the model computes: rotary frequencies, GPT-2's causal mask.
  bool is_buffer(const std::string& name) const {
    static const std::regex kRotary(R"((^|\.)rotary_emb\.inv_freq$)");
    static const std::regex kMask(R"((^|\.)h\.\d+\.attn\.(bias|masked_bias)$)");
    return std::regex_search(name, llama_ ? kRotary : kMask);
  }

 private:
  const GPTConfig& config_;
  bool llama_;
  std::string prefix_;
};

// The weights of a directory: model.safetensors, or the shards model.safetensors.index.json lists.
class Shards {
 public:
  explicit Shards(const std::filesystem::path& directory) {
    const auto single = directory / "model.safetensors", index = directory / "model.safetensors.index.json";
    if (std::filesystem::is_regular_file(single)) {
      source_ = single.string();
      files_.emplace_back(single);
    } else if (std::filesystem::is_regular_file(index)) {
      source_ = index.string();
      read_index(directory, index);
    } else {
      const bool pickle = std::filesystem::exists(directory / "pytorch_model.bin") ||
                          std::filesystem::exists(directory / "pytorch_model.bin.index.json");
      throw FormatError(concat(directory.string(), ": no model.safetensors (or model.safetensors.index.json)",
                               pickle ? "; pytorch_model.bin is not read: save with save_pretrained(..., "
                                        "safe_serialization=True)"
                                      : ""));
    }
    for (size_t i = 0; i < files_.size(); ++i) {
      for (const auto& [name, entry] : files_[i].entries()) {
        where_.emplace(name, i);
        held_ += entry.end - entry.begin;
      }
    }
  }

  const std::string& source() const { return source_; }
  const std::map<std::string, size_t>& names() const { return where_; }  // sorted
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const SafetensorsFile& file(const std::string& name) const { return files_.at(where_.at(name)); }
  const SafetensorsEntry& entry(const std::string& name) const { return file(name).entry(name); }
  uint64_t bytes() const { return held_; }

 private:
  void read_index(const std::filesystem::path& directory, const std::filesystem::path& index) {
    std::ifstream in(index);
    std::stringstream text;
    text << in.rdbuf();
    const auto values = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (values.is_discarded() || !values.is_object() || !values.contains("weight_map") ||
        !values["weight_map"].is_object()) {
      throw FormatError(concat(source_, ": expected a JSON object with a weight_map {tensor: shard file}"));
    }
    std::map<std::string, size_t> shard_of_file;
    std::map<std::string, std::string> listed;
    for (const auto& [name, shard] : values["weight_map"].items()) {
      // A shard is a file beside the index: no directories, no way out of the model's directory.
      if (!shard.is_string() || shard.get<std::string>().empty() ||
          shard.get<std::string>().find_first_of("/\\") != std::string::npos || shard == "." || shard == "..") {
        throw FormatError(concat(source_, ": weight_map['", name, "'] must be a file name beside the index; got ",
                                 shard.dump()));
      }
      listed[name] = shard.get<std::string>();
      if (shard_of_file.emplace(shard.get<std::string>(), files_.size()).second) {
        const auto path = directory / shard.get<std::string>();
        if (!std::filesystem::is_regular_file(path)) {
          throw FormatError(concat(source_, ": shard ", path.string(), " (of '", name, "') not found"));
        }
        files_.emplace_back(path);
      }
    }
    for (const auto& [file, i] : shard_of_file) {
      for (const auto& [name, _] : files_[i].entries()) {
        const auto found = listed.find(name);
        if (found == listed.end() || found->second != file) {
          throw FormatError(concat(files_[i].path().string(), ": tensor '", name, "' is not listed for this shard in ",
                                   source_, found == listed.end() ? "" : concat(" (it names ", found->second, ")")));
        }
      }
    }
    for (const auto& [name, file] : listed) {
      if (!files_[shard_of_file.at(file)].contains(name)) {
        throw FormatError(concat(source_, ": tensor '", name, "' is listed in ", file, " but that shard lacks it"));
      }
    }
  }

  std::string source_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;
  uint64_t held_ = 0;
};

// The model's tensors in order, each with their parts: visit(ours, shape, parts) until it returns false.
template <typename Visit>
void for_each_tensor(const Layout& layout, int64_t n_layers, const Naming& naming, const Visit& visit) {
  for (const auto& t : layout.before) {
    if (!visit(t.name, t.shape, naming.parts(t.name, t.shape))) return;
  }
  for (int64_t i = 0; i < n_layers; ++i) {
    for (const auto& t : layout.block) {
      const auto name = concat("blocks.", i, ".", t.name);
      if (!visit(name, t.shape, naming.parts(name, t.shape))) return;
    }
  }
  for (const auto& t : layout.after) {
    if (!visit(t.name, t.shape, naming.parts(t.name, t.shape))) return;
  }
}

// Checks the headers against config (convert.py's order: dtypes, missing, the tied head,
// unexpected, shapes); returns the model's dtype: the tensors' one floating dtype, float32 where they
// mix several (as convert.py's _model_like).
at::ScalarType check_headers(const GPTConfig& config, const Naming& naming, const Shards& shards,
                             const std::string& config_source) {
  const auto& source = shards.source();
  std::optional<std::pair<std::string, at::ScalarType>> first;
  bool mixed = false;  // floating dtypes of more than one kind: the model is built in float32, as in Python
  for (const auto& [name, _] : shards.names()) {
    if (naming.is_buffer(name)) continue;
    const auto dtype = shards.entry(name).dtype;
    if (!at::isFloatingType(dtype)) {
      throw FormatError(concat(source, ": tensor '", name, "' has dtype ", safetensors_dtype_name(dtype),
                               "; expected a floating dtype (F64, F32, F16 or BF16)"));
    }
    if (!first.has_value()) first.emplace(name, dtype);
    mixed = mixed || dtype != first->second;
  }
  const auto layout = parameter_layout(config);
  for (const auto* part : {&layout.before, &layout.block, &layout.after}) {
    for (const auto& tensor : *part) {
      if (numel(tensor.shape) < 0) {
        throw FormatError(concat(config_source, " describes tensors too large to address (tensor '", tensor.name, "')"));
      }
    }
  }
  // Missing first: the walk stops at the ninth, so a config claiming a million layers costs nothing.
  std::vector<std::string> missing;
  std::set<std::string> used;
  for_each_tensor(layout, config.n_layers, naming, [&](const std::string&, const auto&, const auto& parts) {
    for (const auto& part : parts) {
      if (!shards.contains(part.name)) missing.push_back(part.name);
      used.insert(part.name);
    }
    return missing.size() < 9;
  });
  if (!missing.empty()) {
    const auto dtype = first.has_value() && !mixed ? first->second : at::kFloat;
    const Count all = parameter_count(layout, config.n_layers);
    const Count needed = all.times(c10::elementSize(dtype));
    if (needed.over || needed.value > shards.bytes()) {
      throw FormatError(concat(config_source, " describes a model of ", all.text(), " parameters (", needed.text(),
                               " bytes as ", safetensors_dtype_name(dtype), ") but ", source, " holds ",
                               shards.bytes(), " bytes; missing tensor(s) ", listing(missing)));
    }
    throw FormatError(concat(source, ": missing tensor(s) ", listing(missing)));
  }
  if (config.tie_head && shards.contains("lm_head.weight")) used.insert("lm_head.weight");  // checked equal on reading
  if (!config.tie_head && !shards.contains("lm_head.weight")) {
    throw FormatError(concat(source, ": missing tensor 'lm_head.weight' (the head is not tied)"));
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, _] : shards.names()) {
    if (!used.count(name) && !naming.is_buffer(name)) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    throw FormatError(concat(source, ": unexpected tensor(s) ", listing(unexpected), " (not in the model that ",
                             config_source, " describes)"));
  }
  for_each_tensor(layout, config.n_layers, naming, [&](const std::string&, const auto& shape, const auto& parts) {
    for (const auto& part : parts) {
      const auto want = Naming::shape_of(part, shape);
      const auto& have = shards.entry(part.name).shape;
      if (have != want) {
        throw FormatError(concat(source, ": tensor '", part.name, "' has shape ", shape_string(have), "; the model (",
                                 config_source, ") expects ", shape_string(want)));
      }
    }
    return true;
  });
  return first.has_value() && !mixed ? first->second : at::kFloat;
}

// Older GPT-2 checkpoints hold the causal mask as buffers: it must be the causal mask.
void check_mask_buffers(const Naming& naming, const Shards& shards) {
  for (const auto& [name, _] : shards.names()) {
    if (!naming.is_buffer(name) || name.size() < 5 || name.compare(name.size() - 5, 5, ".bias") != 0) continue;
    const auto value = shards.file(name).read(name);
    if (value.dim() < 2) continue;
    const int64_t T = value.size(-1);
    const auto causal = at::ones({T, T}, at::kBool).tril();
    if (value.size(-2) != T || !at::equal(value.reshape({-1, T, T})[0].to(at::kBool), causal)) {
      throw FormatError(concat(shards.source(), ": '", name,
                               "' is not the causal mask; GPT implements causal attention only"));
    }
  }
}

}  // namespace

}  // namespace causal_attention::detail

namespace causal_attention {

GPTConfig config_from_huggingface(const std::string& text, const std::string& source) {
  using namespace detail;
  const auto values = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (values.is_discarded() || !values.is_object()) throw FormatError(source + ": not a well-formed JSON object");
  const HfConfig hf(values, source);
  const auto model_type = hf.text("model_type", "gpt2");
  GPTConfig config;
  if (is_llama_type(model_type)) {
    config = llama_config(hf, model_type);
  } else if (model_type == "gpt2") {
    config = gpt2_config(hf);
  } else {
    throw FormatError(concat(source, ": model_type \"", model_type, "\" is not supported: the C++ GPT reads GPT-2, "
                             "Llama, Qwen2 and Mistral checkpoints (model_type 'gpt2', 'llama', 'qwen2', 'mistral')"));
  }
  try {
    config.validate();
  } catch (const std::invalid_argument& error) {
    throw FormatError(concat(source, ": ", error.what()));
  }
  return config;
}

}  // namespace causal_attention

namespace causal_attention::detail {

GPT load_huggingface(const std::filesystem::path& directory, const std::string& config_text) {
  const auto config_source = (directory / "config.json").string();
  const auto config = config_from_huggingface(config_text, config_source);  // before the weights are opened
  const Shards shards(directory);
  const bool llama = config.positions == "rope";
  std::string prefix;
  if (!llama) {
    const auto& names = shards.names();
    const auto found = names.lower_bound("transformer.");
    if (found != names.end() && found->first.rfind("transformer.", 0) == 0) prefix = "transformer.";
  }
  const Naming naming(config, llama, prefix);
  const auto dtype = check_headers(config, naming, shards, config_source);
  if (!llama) check_mask_buffers(naming, shards);

  GPT model(config, dtype, Init::kSkip);  // every parameter read below
  torch::NoGradGuard no_grad;
  for (auto& param : model->named_parameters()) {
    const auto& target = param.value();  // contiguous: each part is read straight into its rows
    const auto shape = target.sizes().vec();
    int64_t row = 0;
    for (const auto& part : naming.parts(param.key(), shape)) {
      const auto rows = target.narrow(0, row, part.rows);
      if (part.transposed || shards.entry(part.name).dtype != rows.scalar_type()) {  // copied, widened
        const auto value = shards.file(part.name).read(part.name);
        rows.copy_(part.transposed ? value.t() : value);
      } else {
        shards.file(part.name).read_into(part.name, rows);
      }
      row += part.rows;
    }
    TORCH_CHECK(row == shape.front(), "load_huggingface: the checkpoint's parts of '", param.key(),
                "' fill ", row, " of its ", shape, " rows");  // the rest would be uninitialised
  }
  if (config.tie_head && shards.contains("lm_head.weight")) {
    const auto head = shards.file("lm_head.weight").read("lm_head.weight").to(model->tok->weight.scalar_type());
    if (!at::equal(head, model->tok->weight)) {
      throw FormatError(concat(shards.source(), ": 'lm_head.weight' differs from the token embedding (",
                               naming.parts("tok.weight", {1}).front().name, ") but the head is tied"));
    }
  }
  model->eval();
  return model;
}

}  // namespace causal_attention::detail
