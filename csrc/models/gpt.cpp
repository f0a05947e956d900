#include "causal_attention/gpt.h"

#include "causal_attention/attention.h"
#include "causal_attention/safetensors.h"
#include "checkpoint.h"
#include "memory/parameters.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/activation.h>
#include <torch/utils.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <variant>

namespace causal_attention {

using detail::concat;
using detail::listing;

namespace {

constexpr const char* kFormat = "causal_attention.gpt";

}  // namespace

// ---------------------------------------------------------------------------------------------
// GPTConfig

void GPTConfig::validate() const {
  const std::pair<const char*, int64_t> positive[] = {
      {"vocab_size", vocab_size}, {"max_len", max_len}, {"dim", dim}, {"n_layers", n_layers}, {"n_heads", n_heads}};
  for (const auto& [name, value] : positive) {
    if (value <= 0) throw std::invalid_argument(concat("GPTConfig.", name, " must be a positive int; got ", value));
  }
  if (dim % n_heads != 0) {
    throw std::invalid_argument(concat("GPTConfig: n_heads=", n_heads, " must divide dim=", dim));
  }
  if (mlp_hidden.has_value() && *mlp_hidden <= 0) {
    throw std::invalid_argument(concat("GPTConfig.mlp_hidden must be None or a positive int; got ", *mlp_hidden));
  }
  if (activation != "gelu" && activation != "gelu_tanh" && activation != "silu") {
    throw std::invalid_argument(
        concat("GPTConfig.activation must be 'gelu', 'gelu_tanh' or 'silu'; got '", activation, "'"));
  }
  if (!(std::isfinite(layer_norm_eps) && layer_norm_eps > 0)) {  // inf makes every norm's output 0
    throw std::invalid_argument(
        concat("GPTConfig.layer_norm_eps must be a positive finite float; got ", layer_norm_eps));
  }
  const std::pair<const char*, double> probabilities[] = {
      {"attn_dropout", attn_dropout}, {"resid_dropout", resid_dropout}, {"embd_dropout", embd_dropout}};
  for (const auto& [name, p] : probabilities) {
    if (!(p >= 0.0 && p < 1.0)) {
      throw std::invalid_argument(concat("GPTConfig.", name, " must be a probability in [0, 1); got ", p));
    }
  }
  // The Llama family's options, in gpt.py's _check_llama_options order and words.
  const std::pair<const char*, std::optional<int64_t>> optional_positive[] = {{"n_kv_heads", n_kv_heads},
                                                                              {"sliding_window", sliding_window}};
  for (const auto& [name, value] : optional_positive) {
    if (value.has_value() && *value <= 0) {
      throw std::invalid_argument(concat("GPTConfig.", name, " must be None or a positive int; got ", *value));
    }
  }
  if (n_kv_heads.has_value() && n_heads % *n_kv_heads != 0) {
    throw std::invalid_argument(concat("GPTConfig: n_kv_heads=", *n_kv_heads, " must divide n_heads=", n_heads));
  }
  if (norm != "layernorm" && norm != "rmsnorm") {
    throw std::invalid_argument(concat("GPTConfig.norm must be 'layernorm' or 'rmsnorm'; got '", norm, "'"));
  }
  if (positions != "learned" && positions != "rope") {
    throw std::invalid_argument(concat("GPTConfig.positions must be 'learned' or 'rope'; got '", positions, "'"));
  }
  if (positions == "rope" && head_dim() % 2 != 0) {
    throw std::invalid_argument(concat("GPTConfig: rotary positions need an even head_dim; got ", head_dim()));
  }
  if (!(std::isfinite(rope_theta) && rope_theta > 0)) {
    throw std::invalid_argument(concat("GPTConfig.rope_theta must be a positive finite number; got ", rope_theta));
  }
  if (rope_scaling.has_value()) {
    if (positions != "rope") throw std::invalid_argument("GPTConfig.rope_scaling needs positions='rope'");
    const auto& r = *rope_scaling;
    const std::pair<const char*, double> factors[] = {{"factor", r.factor},
                                                      {"low_freq_factor", r.low_freq_factor},
                                                      {"high_freq_factor", r.high_freq_factor},
                                                      {"original_max_position_embeddings",
                                                       r.original_max_position_embeddings}};
    for (const auto& [name, value] : factors) {
      if (!(value > 0)) {
        throw std::invalid_argument(concat("GPTConfig.rope_scaling: ", name, " must be a positive number; got ", value));
      }
    }
    if (!(r.high_freq_factor > r.low_freq_factor)) {
      throw std::invalid_argument("GPTConfig.rope_scaling: high_freq_factor must exceed low_freq_factor");
    }
  }
}

namespace {

// config.json's options, in GPTConfig's order (as gpt.py's fields), and an older version's file:
// the demo's, with mlp_ratio, whose missing options take the values of the model it built.
// A field of GPTConfig; its type says which JSON values it takes.
using Field = std::variant<int64_t GPTConfig::*, std::optional<int64_t> GPTConfig::*, double GPTConfig::*,
                           bool GPTConfig::*, std::string GPTConfig::*, std::optional<bool> GPTConfig::*,
                           std::optional<GPTConfig::RopeScaling> GPTConfig::*>;
struct Option {
  const char* key;
  Field field;
};
// The first kRequired are in every config.json (GPT.save writes them); the Llama family's after them
// only where they differ from their defaults.
constexpr size_t kRequired = 13;
const std::array<Option, 23> kOptions{{{"vocab_size", &GPTConfig::vocab_size},
                                       {"max_len", &GPTConfig::max_len},
                                       {"dim", &GPTConfig::dim},
                                       {"n_layers", &GPTConfig::n_layers},
                                       {"n_heads", &GPTConfig::n_heads},
                                       {"mlp_hidden", &GPTConfig::mlp_hidden},
                                       {"layer_norm_eps", &GPTConfig::layer_norm_eps},
                                       {"activation", &GPTConfig::activation},
                                       {"bias", &GPTConfig::bias},
                                       {"tie_head", &GPTConfig::tie_head},
                                       {"attn_dropout", &GPTConfig::attn_dropout},
                                       {"resid_dropout", &GPTConfig::resid_dropout},
                                       {"embd_dropout", &GPTConfig::embd_dropout},
                                       {"n_kv_heads", &GPTConfig::n_kv_heads},
                                       {"norm", &GPTConfig::norm},
                                       {"gated_mlp", &GPTConfig::gated_mlp},
                                       {"positions", &GPTConfig::positions},
                                       {"rope_theta", &GPTConfig::rope_theta},
                                       {"rope_scaling", &GPTConfig::rope_scaling},
                                       {"qkv_bias", &GPTConfig::qkv_bias},
                                       {"proj_bias", &GPTConfig::proj_bias},
                                       {"mlp_bias", &GPTConfig::mlp_bias},
                                       {"sliding_window", &GPTConfig::sliding_window}}};
constexpr std::array<const char*, 6> kLegacyRequired{"vocab_size", "max_len", "dim", "n_layers", "n_heads", "mlp_ratio"};

const std::vector<std::pair<std::string, nlohmann::json>>& legacy_defaults() {
  static const std::vector<std::pair<std::string, nlohmann::json>> defaults{
      {"layer_norm_eps", 1e-5}, {"activation", "gelu"},  {"bias", true},         {"tie_head", true},
      {"attn_dropout", 0.0},    {"resid_dropout", 0.0}, {"embd_dropout", 0.0}};
  return defaults;
}

bool is_int64(const nlohmann::json& value) {
  return value.is_number_integer() &&
         !(value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX));
}

}  // namespace

namespace {

template <typename... F>
struct Overloaded : F... {
  using F::operator()...;
};

FormatError wrong_type(const std::string& source, const char* key, const char* what, const nlohmann::json& value) {
  return FormatError(concat(source, ": ", key, " must be ", what, "; got ", value.dump()));
}

// Unknown keys, the format, and missing keys, in gpt.py's order (_config_values); returns whether
// this is an older version's file (mlp_ratio).
bool check_keys(const nlohmann::json& values, const std::string& source) {
  const auto is_option = [](const std::string& key) {
    return std::any_of(kOptions.begin(), kOptions.end(), [&](const Option& option) { return key == option.key; });
  };
  std::vector<std::string> unknown;
  for (const auto& [key, _] : values.items()) {  // sorted, as nlohmann::json keeps objects
    if (!is_option(key) && key != "format" && key != "mlp_ratio") unknown.push_back(key);
  }
  if (!unknown.empty()) {
    throw FormatError(concat(source, ": unknown option(s) ", listing(unknown),
                             "; known: activation, attn_dropout, bias, dim, embd_dropout, format, gated_mlp, "
                             "layer_norm_eps, max_len, mlp_bias, mlp_hidden, n_heads, n_kv_heads, n_layers, norm, "
                             "positions, proj_bias, qkv_bias, resid_dropout, rope_scaling, rope_theta, "
                             "sliding_window, tie_head, vocab_size"));
  }
  if (values.contains("format") && values["format"] != kFormat) {
    throw FormatError(concat(source, ": format must be \"", kFormat, "\"; got ", values["format"].dump()));
  }
  const bool legacy = values.contains("mlp_ratio");
  if (legacy && values.contains("mlp_hidden")) {
    throw FormatError(source + ": mlp_ratio (an older version's option) and mlp_hidden cannot both be given");
  }
  std::vector<std::string> missing;
  if (legacy) {
    for (const char* key : kLegacyRequired) {
      if (!values.contains(key)) missing.emplace_back(key);
    }
  } else {
    for (size_t i = 0; i < kRequired; ++i) {
      if (!values.contains(kOptions[i].key)) missing.emplace_back(kOptions[i].key);
    }
  }
  std::sort(missing.begin(), missing.end());
  if (!missing.empty()) {
    throw FormatError(concat(source, ": missing option(s) ", listing(missing), " (GPT.save writes every option)"));
  }
  return legacy;
}

// rope_scaling's object: Llama 3's scaling, its four numbers (gpt.py's _check_rope_scaling's rules).
GPTConfig::RopeScaling read_rope_scaling(const nlohmann::json& value, const std::string& source) {
  const auto kind = value.contains("rope_type") ? value["rope_type"] : value.value("type", nlohmann::json());
  if (kind != "llama3") {
    throw FormatError(concat(source, ": GPTConfig.rope_scaling: rope_type ", kind.dump(),
                             " is not supported (only 'llama3')"));
  }
  const char* keys[] = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
  double numbers[4];
  for (int i = 0; i < 4; ++i) {
    if (!value.contains(keys[i]) || !value[keys[i]].is_number()) {
      throw FormatError(concat(source, ": GPTConfig.rope_scaling (llama3): ", keys[i], " must be a number"));
    }
    numbers[i] = value[keys[i]].get<double>();
  }
  for (const auto& [key, _] : value.items()) {
    if (key != "rope_type" && key != "type" && std::none_of(std::begin(keys), std::end(keys), [&](const char* k) {
          return key == k;
        })) {
      throw FormatError(concat(source, ": GPTConfig.rope_scaling (llama3): unknown key '", key, "'"));
    }
  }
  return {numbers[0], numbers[1], numbers[2], numbers[3]};
}

// One option's value into its field, by the field's type (true or 2.0 is no int).
void read_option(const Option& option, const nlohmann::json& value, GPTConfig& config, const std::string& source) {
  const auto wrong = [&](const char* what) { return wrong_type(source, option.key, what, value); };
  std::visit(Overloaded{[&](int64_t GPTConfig::*field) {
                          if (!is_int64(value)) throw wrong("an int");
                          config.*field = value.get<int64_t>();
                        },
                        [&](std::optional<int64_t> GPTConfig::*field) {
                          if (!value.is_null() && !is_int64(value)) throw wrong("an int or null");
                          config.*field = value.is_null() ? std::nullopt : std::optional<int64_t>(value.get<int64_t>());
                        },
                        [&](double GPTConfig::*field) {
                          if (!value.is_number()) throw wrong("a number");
                          config.*field = value.get<double>();
                        },
                        [&](bool GPTConfig::*field) {
                          if (!value.is_boolean()) throw wrong("true or false");
                          config.*field = value.get<bool>();
                        },
                        [&](std::string GPTConfig::*field) {
                          if (!value.is_string()) throw wrong("a string");
                          config.*field = value.get<std::string>();
                        },
                        [&](std::optional<bool> GPTConfig::*field) {
                          if (!value.is_null() && !value.is_boolean()) throw wrong("true, false or null");
                          config.*field = value.is_null() ? std::nullopt : std::optional<bool>(value.get<bool>());
                        },
                        [&](std::optional<GPTConfig::RopeScaling> GPTConfig::*field) {
                          if (!value.is_null() && !value.is_object()) throw wrong("an object or null");
                          config.*field = value.is_null() ? std::optional<GPTConfig::RopeScaling>()
                                                          : std::optional(read_rope_scaling(value, source));
                        }},
             option.field);
}

// An older version's file: its missing options take that version's values (named in `taken`), and
// mlp_ratio becomes mlp_hidden.
std::string fill_legacy_defaults(nlohmann::json& values) {
  std::string taken;
  for (const auto& [key, value] : legacy_defaults()) {
    if (values.contains(key)) continue;
    taken += (taken.empty() ? "" : ", ") + key + "=" + value.dump();
    values[key] = value;
  }
  return taken;
}

void read_mlp_ratio(const nlohmann::json& values, GPTConfig& config, const std::string& source,
                    const std::string& taken) {
  if (!is_int64(values["mlp_ratio"])) throw wrong_type(source, "mlp_ratio", "an int", values["mlp_ratio"]);
  const auto ratio = values["mlp_ratio"].get<int64_t>();
  if (ratio <= 0) throw FormatError(concat(source, ": mlp_ratio must be a positive int; got ", ratio));
  int64_t hidden = 0;
  if (ratio != 4 && __builtin_mul_overflow(ratio, config.dim, &hidden)) {
    throw FormatError(concat(source, ": mlp_ratio x dim does not fit in 64 bits"));
  }
  if (ratio != 4) config.mlp_hidden = hidden;
  if (!taken.empty()) {
    std::cerr << "warning: " << source
              << ": an older version's file (mlp_ratio); the options it lacks take that version's values: " << taken
              << "\n";
  }
}

}  // namespace

GPTConfig GPTConfig::from_json(const std::string& text, const std::string& source) {
  nlohmann::json values = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (values.is_discarded()) throw FormatError(source + ": not well-formed JSON");
  if (!values.is_object()) throw FormatError(concat(source, ": must be a JSON object; got ", values.type_name()));
  const bool legacy = check_keys(values, source);
  const std::string taken = legacy ? fill_legacy_defaults(values) : "";
  GPTConfig config;
  for (const auto& option : kOptions) {  // then types, in GPTConfig's order
    if (values.contains(option.key)) read_option(option, values[option.key], config, source);
  }
  if (legacy) read_mlp_ratio(values, config, source, taken);
  try {
    config.validate();
  } catch (const std::invalid_argument& error) {
    throw FormatError(concat(source, ": ", error.what()));
  }
  return config;
}

std::string GPTConfig::to_json() const {
  nlohmann::ordered_json out;
  out["format"] = kFormat;
  out["vocab_size"] = vocab_size;
  out["max_len"] = max_len;
  out["dim"] = dim;
  out["n_layers"] = n_layers;
  out["n_heads"] = n_heads;
  out["mlp_hidden"] = mlp_hidden.has_value() ? nlohmann::ordered_json(*mlp_hidden) : nlohmann::ordered_json(nullptr);
  out["layer_norm_eps"] = layer_norm_eps;
  out["activation"] = activation;
  out["bias"] = bias;
  out["tie_head"] = tie_head;
  out["attn_dropout"] = attn_dropout;
  out["resid_dropout"] = resid_dropout;
  out["embd_dropout"] = embd_dropout;
  // The Llama family's options where they differ from their defaults (as GPTConfig.to_dict).
  if (n_kv_heads.has_value()) out["n_kv_heads"] = *n_kv_heads;
  if (norm != "layernorm") out["norm"] = norm;
  if (gated_mlp) out["gated_mlp"] = true;
  if (positions != "learned") out["positions"] = positions;
  if (rope_theta != 10000.0) out["rope_theta"] = rope_theta;
  if (rope_scaling.has_value()) {
    out["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", rope_scaling->factor},
                           {"low_freq_factor", rope_scaling->low_freq_factor},
                           {"high_freq_factor", rope_scaling->high_freq_factor},
                           {"original_max_position_embeddings", rope_scaling->original_max_position_embeddings}};
  }
  const std::pair<const char*, std::optional<bool>> biases[] = {
      {"qkv_bias", qkv_bias}, {"proj_bias", proj_bias}, {"mlp_bias", mlp_bias}};
  for (const auto& [key, value] : biases) {
    if (value.has_value()) out[key] = *value;
  }
  if (sliding_window.has_value()) out["sliding_window"] = *sliding_window;
  return out.dump(2);
}

// ---------------------------------------------------------------------------------------------
// Modules

LayerNormImpl::LayerNormImpl(int64_t dim, double eps, bool bias, bool rms) : dim_(dim), eps_(eps), rms_(rms) {
  weight = register_parameter("weight", torch::ones({dim}));
  if (bias && !rms) this->bias = register_parameter("bias", torch::zeros({dim}));
}

at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  if (rms_) {  // Llama's RMSNorm: in float32 whatever x's dtype, rounded back, then the weight
    auto h = x.to(at::kFloat);
    h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
    return weight * h.to(x.scalar_type());
  }
  return at::layer_norm(x, {dim_}, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, eps_);
}

GatedMLPImpl::GatedMLPImpl(const GPTConfig& config, at::ScalarType dtype, Init init)
    : hidden_(config.hidden()), silu_(config.activation == "silu") {
  const bool bias = config.mlp_has_bias();
  gate_up = register_module("gate_up", detail::make_linear(config.dim, 2 * hidden_, bias, dtype, init));
  down = register_module("down", detail::make_linear(hidden_, config.dim, bias, dtype, init));
  drop = register_module("drop", torch::nn::Dropout(config.resid_dropout));
  approximate_ = config.activation == "gelu_tanh" ? "tanh" : "none";
}

at::Tensor GatedMLPImpl::forward(const at::Tensor& x, bool step) {
  const auto optional = [](const at::Tensor& b) { return b.defined() ? std::optional<at::Tensor>(b) : std::nullopt; };
  const auto linear = [&](const at::Tensor& in, const torch::nn::Linear& layer) {
    return step ? few_rows_linear(in, layer->weight, layer->bias) : project(in, layer->weight, optional(layer->bias));
  };
  const auto both = linear(x, gate_up);  // (..., 2 * hidden): gate | up
  const auto gate = both.narrow(-1, 0, hidden_), up = both.narrow(-1, hidden_, hidden_);
  const auto act = silu_ ? at::silu(gate) : at::gelu(gate, approximate_);
  return drop->forward(linear(act * up, down));
}

// cos and sin (..., hd) at positions (...), in dtype: computed in float32 as transformers computes them.
Rotary Rotary::at(const at::Tensor& positions, const at::Tensor& inv_freq, at::ScalarType dtype) {
  const auto freqs = positions.unsqueeze(-1).to(at::kFloat) * inv_freq;  // (..., hd / 2)
  const auto angles = at::cat({freqs, freqs}, -1);                        // (..., hd)
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}

// qkv (B, T, (H + 2 Hkv) * hd) -> the same with q and k rotated: x * cos + rotate_half(x) * sin.
at::Tensor Rotary::apply(const at::Tensor& qkv, int64_t n_heads, int64_t kv_heads) const {
  const bool differentiated =
      at::GradMode::is_enabled() && (qkv.requires_grad() || cos.requires_grad() || sin.requires_grad());
  if (!differentiated && qkv.device().is_cpu()) {
    return kernels::rotary_qkv_cpu(qkv, cos, sin, n_heads, kv_heads);  // the same bits in one pass
  }
  const int64_t hd = cos.size(-1);
  const auto c = cos.unsqueeze(-2), s = sin.unsqueeze(-2);  // (..., 1, hd)
  const auto rotate = [&](const at::Tensor& part, int64_t heads) {
    auto sizes = part.sizes().vec();
    sizes.back() = heads;
    sizes.push_back(hd);
    const auto x = part.reshape(sizes);
    const auto half = at::cat({-x.narrow(-1, hd / 2, hd / 2), x.narrow(-1, 0, hd / 2)}, -1);
    return ((x * c) + (half * s)).flatten(-2);
  };
  const auto q = qkv.narrow(-1, 0, n_heads * hd), k = qkv.narrow(-1, n_heads * hd, kv_heads * hd);
  const auto v = qkv.narrow(-1, (n_heads + kv_heads) * hd, kv_heads * hd);
  return at::cat({rotate(q, n_heads), rotate(k, kv_heads), v}, -1);
}

at::Tensor inverse_frequencies(const GPTConfig& config) {
  const int64_t hd = config.head_dim();
  const auto steps = at::arange(0, hd, 2, at::kLong).to(at::kFloat);
  auto inv = 1.0 / at::pow(config.rope_theta, steps / static_cast<double>(hd));  // float32, as transformers
  if (!config.rope_scaling.has_value()) return inv.to(at::kFloat);
  const auto& r = *config.rope_scaling;
  const double low_wavelen = r.original_max_position_embeddings / r.low_freq_factor;
  const double high_wavelen = r.original_max_position_embeddings / r.high_freq_factor;
  const auto wavelen = 2 * M_PI / inv;
  const auto scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
  const auto smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) /
                      (r.high_freq_factor - r.low_freq_factor);
  const auto smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  const auto medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled).to(at::kFloat);
}

BlockImpl::BlockImpl(const GPTConfig& config, at::ScalarType dtype, Init init)
    : n_kv_heads_(config.n_kv_heads), window_(config.sliding_window) {
  config.validate();
  const bool rms = config.norm == "rmsnorm";
  const auto norm = [&] {
    LayerNorm ln(config.dim, config.layer_norm_eps, config.bias, rms);
    ln->to(dtype);
    return ln;
  };
  ln1 = register_module("ln1", norm());
  attn = register_module("attn", CausalSelfAttention(CausalSelfAttentionOptions(config.dim, config.n_heads)
                                                         .dropout(config.attn_dropout)
                                                         .bias(config.qkv_has_bias())
                                                         .n_kv_heads(config.n_kv_heads)
                                                         .dtype(dtype)
                                                         .init(init)));
  if (config.proj_has_bias() != config.qkv_has_bias()) {
    attn->proj = attn->replace_module(
        "proj", detail::make_linear(config.dim, config.dim, config.proj_has_bias(), dtype, init));
  }
  attn_drop = register_module("attn_drop", torch::nn::Dropout(config.resid_dropout));
  ln2 = register_module("ln2", norm());
  if (config.gated_mlp) {
    gated = register_module("mlp", GatedMLP(config, dtype, init));
    return;
  }
  const bool bias = config.mlp_has_bias();
  const auto approximate = config.activation == "gelu_tanh" ? "tanh" : "none";
  torch::nn::Sequential layers(detail::make_linear(config.dim, config.hidden(), bias, dtype, init));
  if (config.activation == "silu") {
    layers->push_back(torch::nn::SiLU());
  } else {
    layers->push_back(torch::nn::GELU(torch::nn::GELUOptions().approximate(approximate)));
  }
  layers->push_back(detail::make_linear(config.hidden(), config.dim, bias, dtype, init));
  layers->push_back(torch::nn::Dropout(config.resid_dropout));
  mlp = register_module("mlp", layers);
}

at::Tensor BlockImpl::mlp_of(const at::Tensor& x, bool step) {
  if (gated) return gated->forward(x, step);
  if (!step) return mlp_forward(x);
  // The MLP module by module, so that a decode step's few rows take few_rows_linear's W x^T path.
  const auto& fc = mlp[0]->as<torch::nn::LinearImpl>();
  const auto& out = mlp[2]->as<torch::nn::LinearImpl>();
  const auto inner = activate(few_rows_linear(x, fc->weight, fc->bias));
  return mlp[3]->as<torch::nn::DropoutImpl>()->forward(few_rows_linear(inner, out->weight, out->bias));
}

at::Tensor BlockImpl::attend_windowed(const at::Tensor& qkv, const std::optional<at::Tensor>& mask, KVCache* cache) {
  const int64_t B = qkv.size(0), t = qkv.size(1), H = attn->n_heads(), Hkv = attn->n_kv_heads();
  const auto [q, k, v] = kernels::split_heads(qkv, H, Hkv);
  if (cache == nullptr) {
    const double dropout_p = is_training() ? attn->dropout() : 0.0;
    if (at::GradMode::is_enabled() || !qkv.device().is_cpu()) {  // differentiable: the specification
      const auto keep = dropout_p > 0 ? std::optional<at::Tensor>(dropout_keep_mask(draw_dropout_seed(), B, H, t,
                                                                                    dropout_p).to(qkv.device()))
                                      : std::nullopt;
      return kernels::attention_math(qkv, mask, H, dropout_p, keep, Hkv, window_);
    }
    return std::get<0>(kernels::attention_heads_forward_cpu(q, k, v, mask, std::nullopt, window_, std::nullopt,
                                                            dropout_p))
        .reshape({B, t, -1});
  }
  // A prefill into empty caches attends its own tokens within the window; a step of one token per
  // sequence its last `window` cached keys (its own included). Several new tokens after a past would
  // each need a window of their own over a ragged cache: refused, as in Python.
  const auto start = cache->lengths;                                     // (B,)
  const auto end = cache_end(start, mask, t, cache->max_len());          // (B,), checked
  const bool empty = !start.any().item<bool>();
  TORCH_CHECK_VALUE(empty || t == 1, "a sliding-window model's cached step takes 1 token per sequence after the "
                    "prefill; got ", t);
  kernels::kv_cache_write_cpu(qkv, cache->k, cache->v, start, end, H, n_kv_heads_);
  at::Tensor out;
  if (empty) {
    out = std::get<0>(kernels::attention_heads_forward_cpu(q, k, v, mask, std::nullopt, window_));
  } else {
    const int64_t length = end.max().item<int64_t>();
    const auto keys = at::arange(length, at::kLong).unsqueeze(0);                             // (1, L)
    const auto in_window = (keys < end.unsqueeze(1)) & (keys >= end.unsqueeze(1) - *window_);  // (B, L)
    out = std::get<0>(kernels::attention_heads_forward_cpu(q, cache->k.narrow(2, 0, length),
                                                           cache->v.narrow(2, 0, length), in_window));
  }
  cache->lengths.copy_(end);
  return out.reshape({B, t, -1});
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& mask, KVCache* cache,
                              const Rotary* rotary) {
  const auto optional = [](const at::Tensor& b) { return b.defined() ? std::optional<at::Tensor>(b) : std::nullopt; };
  const auto h = ln1->forward(x);  // (B, T, dim)
  const int64_t H = attn->n_heads(), Hkv = attn->n_kv_heads();
  const auto rotate = [&](const at::Tensor& qkv) { return rotary == nullptr ? qkv : rotary->apply(qkv, H, Hkv); };
  at::Tensor y;
  if (cache == nullptr) {
    const auto qkv = rotate(project(h, attn->qkv->weight, optional(attn->qkv->bias)));
    const double dropout_p = is_training() ? attn->dropout() : 0.0;
    const auto heads = window_.has_value() ? attend_windowed(qkv, mask, nullptr)
                                           : attention(qkv, mask, H, dropout_p, std::nullopt, n_kv_heads_);
    y = project(heads, attn->proj->weight, optional(attn->proj->bias));
  } else {
    TORCH_CHECK_VALUE(x.device().is_cpu() && !at::GradMode::is_enabled(),
                      "the C++ KV cache path runs on CPU tensors under torch::NoGradGuard");
    const auto qkv = rotate(few_rows_linear(h, attn->qkv->weight, attn->qkv->bias));
    at::Tensor heads;
    if (window_.has_value()) {
      heads = attend_windowed(qkv, mask, cache);
    } else {
      const auto start = cache->lengths;                                             // (B,)
      const auto end = cache_end(start, mask, x.size(1), cache->max_len());          // (B,), checked
      kernels::kv_cache_write_cpu(qkv, cache->k, cache->v, start, end, H, n_kv_heads_);  // rotated keys
      heads = kernels::decode_attention_cpu(qkv, cache->k, cache->v, start, end, H, n_kv_heads_);
      cache->lengths.copy_(end);
    }
    y = few_rows_linear(heads, attn->proj->weight, attn->proj->bias);
  }
  const auto out = x + attn_drop->forward(y);
  return out + mlp_of(ln2->forward(out), cache != nullptr);
}

// The MLP's activation, mlp[1]: GELU (exact or tanh) or SiLU.
at::Tensor BlockImpl::activate(const at::Tensor& x) {
  if (auto* gelu = mlp[1]->as<torch::nn::GELUImpl>()) return gelu->forward(x);
  return mlp[1]->as<torch::nn::SiLUImpl>()->forward(x);
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& mask) {
  const auto h = x + attn_drop->forward(attn->forward(ln1->forward(x), mask));  // (B, T, dim)
  return h + mlp_of(ln2->forward(h), false);
}

// The MLP module by module, its linear layers by causal_attention::project (widened for half precision
// where the CPU has no half arithmetic). x (..., dim) -> (..., dim).
at::Tensor BlockImpl::mlp_forward(const at::Tensor& x) {
  const auto optional = [](const at::Tensor& b) { return b.defined() ? std::optional<at::Tensor>(b) : std::nullopt; };
  const auto& fc = mlp[0]->as<torch::nn::LinearImpl>();
  const auto& out = mlp[2]->as<torch::nn::LinearImpl>();
  const auto inner = activate(project(x, fc->weight, optional(fc->bias)));
  return mlp[3]->as<torch::nn::DropoutImpl>()->forward(project(inner, out->weight, optional(out->bias)));
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& mask, KVCache& cache) {
  const auto h = x + attn_drop->forward(attn->forward(ln1->forward(x), mask, cache));  // (B, t, dim)
  return h + mlp_of(ln2->forward(h), true);
}

GPTImpl::GPTImpl(GPTConfig config, std::optional<at::ScalarType> dtype, Init init) : config_(std::move(config)) {
  config_.validate();
  // Each module in dtype as it is built: a float32 twin of one module at a time, at most.
  const auto type = dtype.value_or(at::kFloat);
  tok = register_module("tok", detail::make_embedding(config_.vocab_size, config_.dim, type, init));
  if (config_.positions == "learned") {
    pos = register_module("pos", detail::make_embedding(config_.max_len, config_.dim, type, init));
  } else {
    inv_freq_ = inverse_frequencies(config_);
  }
  drop = register_module("drop", torch::nn::Dropout(config_.embd_dropout));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.n_layers; ++i) blocks->push_back(Block(config_, type, init));
  ln_f = register_module("ln_f", LayerNorm(config_.dim, config_.layer_norm_eps, config_.bias,
                                           config_.norm == "rmsnorm"));
  ln_f->to(type);
  if (!config_.tie_head) {
    head = register_module("head", detail::make_linear(config_.dim, config_.vocab_size, false, type, init));
  }
  if (init == Init::kRandom) {
    torch::NoGradGuard no_grad;
    torch::nn::init::normal_(tok->weight, 0.0, 0.02);
    if (pos) torch::nn::init::normal_(pos->weight, 0.0, 0.02);
  }
}

at::Tensor GPTImpl::head_weight() const { return config_.tie_head ? tok->weight : head->weight; }

std::vector<KVCache> GPTImpl::make_caches(int64_t batch_size, int64_t max_len) const {
  TORCH_CHECK_VALUE(max_len > 0 && max_len <= config_.max_len, "make_caches: max_len must be in 1..", config_.max_len,
                    "; got ", max_len);
  // A decode step streams every weight: on the CPU they move onto huge pages in place, as the
  // caches' buffers are (each layer's make_cache then finds its attention's weights moved).
  for (const auto& parameter : parameters()) {
    if (parameter.device().is_cpu()) {
      kernels::advise_huge_pages(parameter);
    }
  }
  std::vector<KVCache> caches;
  for (const auto& block : *blocks) caches.push_back(block->as<BlockImpl>()->attn->make_cache(batch_size, max_len));
  return caches;
}

at::Tensor GPTImpl::embed(const at::Tensor& tokens, const at::Tensor& offset) {
  TORCH_CHECK_VALUE(tokens.dim() == 2 && (tokens.scalar_type() == at::kLong || tokens.scalar_type() == at::kInt),
                    "tokens must be an int64 or int32 tensor of shape (B, T); got ", tokens.scalar_type(), " of shape ",
                    tokens.sizes());
  TORCH_CHECK_VALUE(tokens.size(1) > 0, "tokens must hold at least one token per sequence; got shape ", tokens.sizes());
  if (tokens.numel() > 0) {
    const auto low = tokens.min().item<int64_t>(), high = tokens.max().item<int64_t>();
    TORCH_CHECK_VALUE(low >= 0 && high < config_.vocab_size, "tokens must be in 0..", config_.vocab_size - 1,
                      " (vocab_size=", config_.vocab_size, "); got values in ", low, "..", high);
  }
  const auto at = positions(tokens, offset);  // (B, T)
  return drop->forward(pos ? tok->forward(tokens) + pos->forward(at) : tok->forward(tokens));  // (B, T, dim)
}

at::Tensor GPTImpl::positions(const at::Tensor& tokens, const at::Tensor& offset) const {
  const auto positions = offset.unsqueeze(1) + at::arange(tokens.size(1), offset.options());  // (B, T)
  const auto last = positions.numel() > 0 ? positions.max().item<int64_t>() : 0;
  TORCH_CHECK_VALUE(last < config_.max_len, "sequence longer than max_len=", config_.max_len, " (position ", last, ")");
  return positions;
}

at::Tensor GPTImpl::run_blocks(at::Tensor x, const std::optional<at::Tensor>& mask, const at::Tensor& positions,
                               std::vector<KVCache>* caches) {
  if (!inv_freq_.defined() && !config_.sliding_window.has_value()) {
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto* block = blocks[i]->as<BlockImpl>();
      x = caches == nullptr ? block->forward(x, mask) : block->forward(x, mask, (*caches)[i]);
    }
    return x;
  }
  std::optional<Rotary> rotary;
  if (inv_freq_.defined()) rotary = Rotary::at(positions, inv_freq_, x.scalar_type());  // (B, T, hd)
  for (size_t i = 0; i < blocks->size(); ++i) {
    x = blocks[i]->as<BlockImpl>()->forward(x, mask, caches == nullptr ? nullptr : &(*caches)[i],
                                            rotary.has_value() ? &*rotary : nullptr);
  }
  return x;
}

at::Tensor GPTImpl::logits(const at::Tensor& h, bool float32) const {
  const auto dtype = h.scalar_type();
  if (float32 && (dtype == at::kBFloat16 || dtype == at::kHalf)) {
    return unrounded_linear(h, head_weight(), at::Tensor());
  }
  return few_rows_linear(h, head_weight(), at::Tensor());
}

at::Tensor GPTImpl::forward(const at::Tensor& tokens, const std::optional<at::Tensor>& key_padding_mask,
                            bool float32_logits) {
  const auto offset = at::zeros({tokens.dim() == 2 ? tokens.size(0) : 0}, at::kLong);
  auto x = embed(tokens, offset);                                     // (B, T, dim)
  const auto mask = normalize_key_padding_mask(key_padding_mask, x);  // (B, T) bool or none
  x = run_blocks(x, mask, positions(tokens, offset), nullptr);
  const auto out = logits(ln_f->forward(x), float32_logits);  // (B, T, V)
  return mask.has_value() ? out.masked_fill(mask->logical_not().unsqueeze(-1), 0) : out;
}

at::Tensor GPTImpl::hidden_states(const at::Tensor& tokens, const std::optional<at::Tensor>& key_padding_mask,
                                  std::vector<KVCache>& caches) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(caches.size()) == config_.n_layers,
                    "caches must hold one KVCache per layer (", config_.n_layers, "); got ", caches.size());
  auto x = embed(tokens, caches.front().lengths);                     // (B, t, dim)
  const auto mask = normalize_key_padding_mask(key_padding_mask, x);  // (B, t) bool or none
  x = run_blocks(x, mask, positions(tokens, caches.front().lengths), &caches);
  return ln_f->forward(x);
}

GenerateResult GPTImpl::generate(const std::vector<std::vector<int64_t>>& prompts, const GenerateOptions& options) {
  TORCH_CHECK_VALUE(!prompts.empty() && std::none_of(prompts.begin(), prompts.end(), [](const auto& p) { return p.empty(); }),
                    "prompts must be a non-empty list of non-empty token lists");
  TORCH_CHECK_VALUE(options.max_new_tokens > 0, "max_new_tokens must be positive; got ", options.max_new_tokens);
  TORCH_CHECK_VALUE(!options.top_k.has_value() || (*options.top_k >= 1 && *options.top_k <= config_.vocab_size),
                    "top_k must be none or in 1..vocab_size=", config_.vocab_size, "; got ", options.top_k.value_or(0));
  TORCH_CHECK_VALUE(options.temperature > 0, "temperature must be positive; got ", options.temperature);
  TORCH_CHECK_VALUE(options.pad_id >= 0 && options.pad_id < config_.vocab_size, "pad_id must be in 0..",
                    config_.vocab_size - 1, "; got ", options.pad_id);
  torch::NoGradGuard no_grad;
  const auto B = static_cast<int64_t>(prompts.size());
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  // The last token chosen is never fed back: a prompt of max_len tokens gets one (as gpt.py).
  const int64_t positions = longest + options.max_new_tokens - 1;
  TORCH_CHECK_VALUE(positions <= config_.max_len, "prompt (", longest, ") + max_new_tokens (", options.max_new_tokens,
                    ") - 1 = ", positions, " positions exceeds max_len=", config_.max_len);

  auto tokens = at::full({B, longest}, options.pad_id, at::kLong);  // (B, longest), right-padded
  auto lengths = at::empty({B}, at::kLong);                         // (B,)
  for (int64_t b = 0; b < B; ++b) {
    const auto& p = prompts[b];
    tokens[b].narrow(0, 0, static_cast<int64_t>(p.size()))
        .copy_(at::tensor(at::ArrayRef<int64_t>(p.data(), p.size()), at::kLong));
    lengths[b] = static_cast<int64_t>(p.size());
  }
  const auto mask = at::arange(longest, at::kLong).unsqueeze(0) < lengths.unsqueeze(1);  // (B, longest)

  std::optional<at::Generator> generator;
  if (options.seed.has_value()) generator = at::make_generator<at::CPUGeneratorImpl>(*options.seed);
  const auto choose = [&](const at::Tensor& last) -> at::Tensor {  // (B, V) -> (B,)
    if (!options.top_k.has_value()) return last.argmax(-1);
    const auto [values, indices] = (last / options.temperature).topk(*options.top_k, -1);  // (B, k)
    const auto picks = at::multinomial(values.softmax(-1), 1, false, generator);         // (B, 1)
    return indices.gather(1, picks).select(1, 0);
  };

  GenerateResult result;
  result.tokens.resize(B);
  std::vector<bool> done(B, false);
  std::vector<at::Tensor> kept;
  auto caches = make_caches(B, positions);
  const auto h = hidden_states(tokens, mask, caches);                                    // (B, longest, dim)
  auto last = logits(h.index({at::arange(B, at::kLong), lengths - 1}), options.float32_logits);  // (B, V)
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    if (options.keep_logits) kept.push_back(last.clone());
    const auto next = choose(last).to(at::kLong).contiguous();  // (B,)
    const auto* chosen = next.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      if (done[b]) continue;
      result.tokens[b].push_back(chosen[b]);
      if (options.on_token) options.on_token(b, chosen[b]);
      done[b] = (options.eos_id.has_value() && chosen[b] == *options.eos_id) ||
                std::find(options.stop_ids.begin(), options.stop_ids.end(), chosen[b]) != options.stop_ids.end();
    }
    if (std::all_of(done.begin(), done.end(), [](bool d) { return d; }) || step == options.max_new_tokens - 1) break;
    const auto hs = hidden_states(next.unsqueeze(1), std::nullopt, caches);  // (B, 1, dim)
    last = logits(hs.select(1, 0), options.float32_logits);                  // (B, V)
  }
  if (options.keep_logits) result.step_logits = at::stack(kept, 1);  // (B, steps, V)
  return result;
}

}  // namespace causal_attention
