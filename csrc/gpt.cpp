#include "causal_attention/gpt.h"

#include "causal_attention/attention.h"
#include "causal_attention/safetensors.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/activation.h>
#include <torch/utils.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

namespace causal_attention {

namespace {

constexpr const char* kFormat = "causal_attention.gpt";

template <typename... Args>
std::string concat(const Args&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

std::string shape_string(at::IntArrayRef shape) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

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
  if (activation != "gelu" && activation != "gelu_tanh") {
    throw std::invalid_argument(concat("GPTConfig.activation must be 'gelu' or 'gelu_tanh'; got '", activation, "'"));
  }
  if (!(layer_norm_eps > 0)) {
    throw std::invalid_argument(concat("GPTConfig.layer_norm_eps must be a positive float; got ", layer_norm_eps));
  }
  const std::pair<const char*, double> probabilities[] = {
      {"attn_dropout", attn_dropout}, {"resid_dropout", resid_dropout}, {"embd_dropout", embd_dropout}};
  for (const auto& [name, p] : probabilities) {
    if (!(p >= 0.0 && p < 1.0)) {
      throw std::invalid_argument(concat("GPTConfig.", name, " must be a probability in [0, 1); got ", p));
    }
  }
}

GPTConfig GPTConfig::from_json(const std::string& text, const std::string& source) {
  using nlohmann::json;
  const json values = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (values.is_discarded()) throw FormatError(source + ": not well-formed JSON");
  if (!values.is_object()) throw FormatError(concat(source, ": must be a JSON object; got ", values.type_name()));
  GPTConfig config;
  const auto want_int = [&](const std::string& key, const json& value) -> int64_t {
    if (!value.is_number_integer()) throw FormatError(concat(source, ": ", key, " must be an int; got ", value.dump()));
    return value.get<int64_t>();
  };
  const auto want_number = [&](const std::string& key, const json& value) -> double {
    if (!value.is_number()) throw FormatError(concat(source, ": ", key, " must be a number; got ", value.dump()));
    return value.get<double>();
  };
  const auto want_bool = [&](const std::string& key, const json& value) -> bool {
    if (!value.is_boolean()) throw FormatError(concat(source, ": ", key, " must be true or false; got ", value.dump()));
    return value.get<bool>();
  };
  std::optional<int64_t> mlp_ratio;  // written by earlier versions of the demo
  bool has_vocab = false, has_max_len = false;
  for (const auto& [key, value] : values.items()) {
    if (key == "format") {
      if (!value.is_string() || value.get<std::string>() != kFormat) {
        throw FormatError(concat(source, ": format must be \"", kFormat, "\"; got ", value.dump()));
      }
    } else if (key == "vocab_size") {
      config.vocab_size = want_int(key, value);
      has_vocab = true;
    } else if (key == "max_len") {
      config.max_len = want_int(key, value);
      has_max_len = true;
    } else if (key == "dim") {
      config.dim = want_int(key, value);
    } else if (key == "n_layers") {
      config.n_layers = want_int(key, value);
    } else if (key == "n_heads") {
      config.n_heads = want_int(key, value);
    } else if (key == "mlp_hidden") {
      config.mlp_hidden = value.is_null() ? std::nullopt : std::optional<int64_t>(want_int(key, value));
    } else if (key == "mlp_ratio") {
      mlp_ratio = want_int(key, value);
    } else if (key == "layer_norm_eps") {
      config.layer_norm_eps = want_number(key, value);
    } else if (key == "activation") {
      if (!value.is_string()) throw FormatError(concat(source, ": activation must be a string; got ", value.dump()));
      config.activation = value.get<std::string>();
    } else if (key == "bias") {
      config.bias = want_bool(key, value);
    } else if (key == "tie_head") {
      config.tie_head = want_bool(key, value);
    } else if (key == "attn_dropout") {
      config.attn_dropout = want_number(key, value);
    } else if (key == "resid_dropout") {
      config.resid_dropout = want_number(key, value);
    } else if (key == "embd_dropout") {
      config.embd_dropout = want_number(key, value);
    } else {
      throw FormatError(concat(source, ": unknown option '", key,
                               "'; known: activation, attn_dropout, bias, dim, embd_dropout, format, layer_norm_eps, "
                               "max_len, mlp_hidden, n_heads, n_layers, resid_dropout, tie_head, vocab_size"));
    }
  }
  if (!has_vocab || !has_max_len) throw FormatError(source + ": vocab_size and max_len are required");
  if (mlp_ratio.has_value() && !config.mlp_hidden.has_value() && *mlp_ratio != 4) {
    config.mlp_hidden = *mlp_ratio * config.dim;
  }
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
  return out.dump(2);
}

// ---------------------------------------------------------------------------------------------
// Modules

LayerNormImpl::LayerNormImpl(int64_t dim, double eps, bool bias) : dim_(dim), eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
  if (bias) this->bias = register_parameter("bias", torch::zeros({dim}));
}

at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  return at::layer_norm(x, {dim_}, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, eps_);
}

BlockImpl::BlockImpl(const GPTConfig& config) {
  config.validate();
  ln1 = register_module("ln1", LayerNorm(config.dim, config.layer_norm_eps, config.bias));
  attn = register_module("attn", CausalSelfAttention(CausalSelfAttentionOptions(config.dim, config.n_heads)
                                                         .dropout(config.attn_dropout)
                                                         .bias(config.bias)));
  attn_drop = register_module("attn_drop", torch::nn::Dropout(config.resid_dropout));
  ln2 = register_module("ln2", LayerNorm(config.dim, config.layer_norm_eps, config.bias));
  const auto approximate = config.activation == "gelu_tanh" ? "tanh" : "none";
  mlp = register_module(
      "mlp", torch::nn::Sequential(torch::nn::Linear(torch::nn::LinearOptions(config.dim, config.hidden()).bias(config.bias)),
                                   torch::nn::GELU(torch::nn::GELUOptions().approximate(approximate)),
                                   torch::nn::Linear(torch::nn::LinearOptions(config.hidden(), config.dim).bias(config.bias)),
                                   torch::nn::Dropout(config.resid_dropout)));
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& mask) {
  const auto h = x + attn_drop->forward(attn->forward(ln1->forward(x), mask));  // (B, T, dim)
  return h + mlp->forward(ln2->forward(h));
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& mask, KVCache& cache) {
  const auto h = x + attn_drop->forward(attn->forward(ln1->forward(x), mask, cache));  // (B, t, dim)
  // The MLP module by module, so that a decode step's few rows take few_rows_linear's W x^T path.
  const auto& fc = mlp[0]->as<torch::nn::LinearImpl>();
  const auto& out = mlp[2]->as<torch::nn::LinearImpl>();
  const auto inner = mlp[1]->as<torch::nn::GELUImpl>()->forward(few_rows_linear(ln2->forward(h), fc->weight, fc->bias));
  return h + mlp[3]->as<torch::nn::DropoutImpl>()->forward(few_rows_linear(inner, out->weight, out->bias));
}

GPTImpl::GPTImpl(GPTConfig config) : config_(std::move(config)) {
  config_.validate();
  tok = register_module("tok", torch::nn::Embedding(config_.vocab_size, config_.dim));
  pos = register_module("pos", torch::nn::Embedding(config_.max_len, config_.dim));
  drop = register_module("drop", torch::nn::Dropout(config_.embd_dropout));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.n_layers; ++i) blocks->push_back(Block(config_));
  ln_f = register_module("ln_f", LayerNorm(config_.dim, config_.layer_norm_eps, config_.bias));
  if (!config_.tie_head) {
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(config_.dim, config_.vocab_size).bias(false)));
  }
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(tok->weight, 0.0, 0.02);
  torch::nn::init::normal_(pos->weight, 0.0, 0.02);
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
  const auto positions = offset.unsqueeze(1) + at::arange(tokens.size(1), offset.options());  // (B, T)
  const auto last = positions.numel() > 0 ? positions.max().item<int64_t>() : 0;
  TORCH_CHECK_VALUE(last < config_.max_len, "sequence longer than max_len=", config_.max_len, " (position ", last, ")");
  return drop->forward(tok->forward(tokens) + pos->forward(positions));  // (B, T, dim)
}

at::Tensor GPTImpl::logits(const at::Tensor& h) const { return few_rows_linear(h, head_weight(), at::Tensor()); }

at::Tensor GPTImpl::forward(const at::Tensor& tokens, const std::optional<at::Tensor>& key_padding_mask) {
  auto x = embed(tokens, at::zeros({tokens.dim() == 2 ? tokens.size(0) : 0}, at::kLong));  // (B, T, dim)
  const auto mask = normalize_key_padding_mask(key_padding_mask, x);                        // (B, T) bool or none
  for (const auto& block : *blocks) x = block->as<BlockImpl>()->forward(x, mask);
  const auto out = logits(ln_f->forward(x));  // (B, T, V)
  return mask.has_value() ? out.masked_fill(mask->logical_not().unsqueeze(-1), 0) : out;
}

at::Tensor GPTImpl::hidden_states(const at::Tensor& tokens, const std::optional<at::Tensor>& key_padding_mask,
                                  std::vector<KVCache>& caches) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(caches.size()) == config_.n_layers,
                    "caches must hold one KVCache per layer (", config_.n_layers, "); got ", caches.size());
  auto x = embed(tokens, caches.front().lengths);                     // (B, t, dim)
  const auto mask = normalize_key_padding_mask(key_padding_mask, x);  // (B, t) bool or none
  for (size_t i = 0; i < caches.size(); ++i) x = blocks[i]->as<BlockImpl>()->forward(x, mask, caches[i]);
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
  auto last = logits(h.index({at::arange(B, at::kLong), lengths - 1}));                  // (B, V)
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    if (options.keep_logits) kept.push_back(last.clone());
    const auto next = choose(last).to(at::kLong).contiguous();  // (B,)
    const auto* chosen = next.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      if (!done[b]) result.tokens[b].push_back(chosen[b]);
      if (options.eos_id.has_value() && chosen[b] == *options.eos_id) done[b] = true;
    }
    if (std::all_of(done.begin(), done.end(), [](bool d) { return d; }) || step == options.max_new_tokens - 1) break;
    const auto hs = hidden_states(next.unsqueeze(1), std::nullopt, caches);  // (B, 1, dim)
    last = logits(hs.select(1, 0));                                          // (B, V)
  }
  if (options.keep_logits) result.step_logits = at::stack(kept, 1);  // (B, steps, V)
  return result;
}

// ---------------------------------------------------------------------------------------------
// Loading GPT.save's files

GPT load_gpt(const std::filesystem::path& directory) {
  const auto config_path = directory / "config.json";
  const auto weights_path = directory / "model.safetensors";
  for (const auto& path : {config_path, weights_path}) {
    if (!std::filesystem::is_regular_file(path)) {
      throw FormatError(path.string() + " not found: load_gpt takes a directory written by GPT.save (or the demo)");
    }
  }
  std::ifstream in(config_path);
  std::stringstream text;
  text << in.rdbuf();
  GPT model(GPTConfig::from_json(text.str(), config_path.string()));

  const SafetensorsFile file(weights_path);
  const auto params = model->named_parameters();
  std::vector<std::string> missing, unexpected;
  for (const auto& param : params) {
    if (!file.contains(param.key())) missing.push_back(param.key());
  }
  for (const auto& [name, _] : file.entries()) {
    if (!params.contains(name)) unexpected.push_back(name);
  }
  const auto listing = [](const std::vector<std::string>& names) {
    std::string out;
    for (size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", '" : "'") + names[i] + "'";
    return names.size() > 8 ? out + " ..." : out;
  };
  if (!missing.empty()) throw FormatError(concat(weights_path.string(), ": missing tensor(s) ", listing(missing)));
  if (!unexpected.empty()) {
    throw FormatError(concat(weights_path.string(), ": unexpected tensor(s) ", listing(unexpected),
                             " (not in the model that config.json describes)"));
  }
  // The model takes the dtype of its token embedding; every tensor must share it.
  const auto dtype = file.entries().at("tok.weight").dtype;
  for (const auto& param : params) {
    const auto& entry = file.entries().at(param.key());
    if (!at::isFloatingType(entry.dtype)) {
      throw FormatError(concat(weights_path.string(), ": tensor '", param.key(), "' has dtype ",
                               safetensors_dtype_name(entry.dtype), "; expected a floating-point dtype"));
    }
    if (entry.dtype != dtype) {
      throw FormatError(concat(weights_path.string(), ": tensor '", param.key(), "' has dtype ",
                               safetensors_dtype_name(entry.dtype), " but the model's dtype is ",
                               safetensors_dtype_name(dtype), " (that of 'tok.weight')"));
    }
    if (at::IntArrayRef(entry.shape) != param.value().sizes()) {
      throw FormatError(concat(weights_path.string(), ": tensor '", param.key(), "' has shape ",
                               shape_string(entry.shape), "; the model (", config_path.string(), ") expects ",
                               shape_string(param.value().sizes())));
    }
  }
  model->to(dtype);
  torch::NoGradGuard no_grad;
  for (auto& param : model->named_parameters()) param.value().copy_(file.read(param.key()));
  model->eval();
  return model;
}

}  // namespace causal_attention
