// Reading the files GPT.save writes (config.json + model.safetensors), every header checked
// against the config before anything is allocated; transformers' directories go to huggingface.cpp.
#include "causal_attention/gpt.h"
#include "causal_attention/safetensors.h"
#include "checkpoint.h"

#include <ATen/ATen.h>
#include <torch/utils.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

namespace causal_attention {

namespace detail {

std::string shape_string(at::IntArrayRef shape) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

std::string listing(const std::vector<std::string>& names) {
  std::string out = "[";
  for (size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  return out + (names.size() > 8 ? ", ...]" : "]");
}

namespace {

int64_t times(int64_t factor, int64_t size) {
  int64_t out = 0;
  return __builtin_mul_overflow(factor, size, &out) ? -1 : out;
}

}  // namespace

Layout parameter_layout(const GPTConfig& c) {
  const int64_t d = c.dim, h = c.mlp_hidden.value_or(times(4, c.dim));
  const auto with_bias = [&](std::vector<TensorShape>& out, const std::string& name, std::vector<int64_t> shape,
                             bool bias) {
    const int64_t rows = shape.front();
    out.push_back({name + ".weight", std::move(shape)});
    if (bias) out.push_back({name + ".bias", {rows}});
  };
  const bool norm_bias = c.bias && c.norm == "layernorm";
  const int64_t qkv_rows = times(c.n_heads + 2 * c.kv_heads(), c.head_dim());
  Layout layout;
  layout.before = {{"tok.weight", {c.vocab_size, d}}};
  if (c.positions == "learned") layout.before.push_back({"pos.weight", {c.max_len, d}});
  with_bias(layout.block, "ln1", {d}, norm_bias);
  with_bias(layout.block, "attn.qkv", {qkv_rows, d}, c.qkv_has_bias());
  with_bias(layout.block, "attn.proj", {d, d}, c.proj_has_bias());
  with_bias(layout.block, "ln2", {d}, norm_bias);
  if (c.gated_mlp) {
    with_bias(layout.block, "mlp.gate_up", {times(2, h), d}, c.mlp_has_bias());
    with_bias(layout.block, "mlp.down", {d, h}, c.mlp_has_bias());
  } else {
    with_bias(layout.block, "mlp.0", {h, d}, c.mlp_has_bias());
    with_bias(layout.block, "mlp.2", {d, h}, c.mlp_has_bias());
  }
  with_bias(layout.after, "ln_f", {d}, norm_bias);
  if (!c.tie_head) layout.after.push_back({"head.weight", {c.vocab_size, d}});
  return layout;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t size : shape) {
    if (size < 0 || __builtin_mul_overflow(n, size, &n)) return -1;
  }
  return n;
}

// The layer index of "blocks.{i}.{rest}" (canonical decimal, below n_layers) and rest, or none.
std::optional<std::pair<int64_t, std::string>> block_name(const std::string& name, int64_t n_layers) {
  const std::string prefix = "blocks.";
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  const auto dot = name.find('.', prefix.size());
  const auto digits = name.substr(prefix.size(), dot == std::string::npos ? std::string::npos : dot - prefix.size());
  if (dot == std::string::npos || digits.empty() || digits.size() > 18 || (digits.size() > 1 && digits[0] == '0') ||
      !std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
    return std::nullopt;
  }
  const int64_t index = std::stoll(digits);
  if (index >= n_layers) return std::nullopt;
  return std::pair(index, name.substr(dot + 1));
}

Count parameter_count(const Layout& layout, int64_t n_layers) {
  Count block;
  for (const auto& tensor : layout.block) block.add(static_cast<uint64_t>(numel(tensor.shape)));
  Count total = block.times(static_cast<uint64_t>(n_layers));
  for (const auto* part : {&layout.before, &layout.after}) {
    for (const auto& tensor : *part) total.add(static_cast<uint64_t>(numel(tensor.shape)));
  }
  return total;
}

}  // namespace detail

using detail::block_name;
using detail::concat;
using detail::Count;
using detail::Layout;
using detail::listing;
using detail::numel;
using detail::parameter_count;
using detail::parameter_layout;
using detail::shape_string;

namespace {

// Every tensor of one floating dtype.
void check_dtypes(const SafetensorsFile& file) {
  const auto source = file.path().string();
  const auto& entries = file.entries();  // sorted by name
  for (const auto& [name, entry] : entries) {
    if (!at::isFloatingType(entry.dtype)) {
      throw FormatError(concat(source, ": tensor '", name, "' has dtype ", safetensors_dtype_name(entry.dtype),
                               "; expected a floating dtype (F64, F32, F16 or BF16)"));
    }
  }
  for (const auto& [name, entry] : entries) {
    const auto& [first, first_entry] = *entries.begin();
    if (entry.dtype != first_entry.dtype) {
      throw FormatError(concat(source, ": tensors of different dtypes: '", first, "' is ",
                               safetensors_dtype_name(first_entry.dtype), ", '", name, "' is ",
                               safetensors_dtype_name(entry.dtype), " (every tensor must share one floating dtype)"));
    }
  }
}

// The tensors of the model that a config describes: their names and shapes, without listing the
// blocks' names one by one (n_layers may be anything a file claims).
class ModelTensors {
 public:
  ModelTensors(const GPTConfig& config, const std::string& config_source)
      : layout_(parameter_layout(config)), n_layers_(config.n_layers) {
    for (const auto* part : {&layout_.before, &layout_.block, &layout_.after}) {
      for (const auto& tensor : *part) {
        if (numel(tensor.shape) < 0) {
          throw FormatError(
              concat(config_source, " describes tensors too large to address (tensor '", tensor.name, "')"));
        }
      }
    }
    for (const auto* part : {&layout_.before, &layout_.after}) {
      for (const auto& tensor : *part) outside_[tensor.name] = &tensor.shape;
    }
    for (const auto& tensor : layout_.block) per_block_[tensor.name] = &tensor.shape;
  }

  // The shape the model expects of tensor `name`, or nullptr where it has no such tensor.
  const std::vector<int64_t>* shape_of(const std::string& name) const {
    if (const auto found = outside_.find(name); found != outside_.end()) return found->second;
    const auto in_block = block_name(name, n_layers_);
    if (!in_block.has_value()) return nullptr;
    const auto found = per_block_.find(in_block->second);
    return found == per_block_.end() ? nullptr : found->second;
  }

  // Calls visit(name) for the model's tensor names in order until it returns false.
  template <typename Visit>
  void for_each_name(const Visit& visit) const {
    for (const auto& tensor : layout_.before) {
      if (!visit(tensor.name)) return;
    }
    for (int64_t i = 0; i < n_layers_; ++i) {
      for (const auto& tensor : layout_.block) {
        if (!visit(concat("blocks.", i, ".", tensor.name))) return;
      }
    }
    for (const auto& tensor : layout_.after) {
      if (!visit(tensor.name)) return;
    }
  }

  Count tensors() const { return Count{per_block_.size()}.times(static_cast<uint64_t>(n_layers_)).add(outside_.size()); }

  Count parameters() const { return parameter_count(layout_, n_layers_); }

 private:
  const Layout layout_;
  const int64_t n_layers_;
  std::map<std::string, const std::vector<int64_t>*> outside_, per_block_;
};

// The file lacks some of the model's tensors: names the first of them, and says so first where the
// config asks for more bytes than the file holds (n_layers = 10**6, say).
[[noreturn]] void missing_tensors(const ModelTensors& model, const SafetensorsFile& file,
                                  const std::string& config_source) {
  const auto source = file.path().string();
  std::vector<std::string> missing;
  model.for_each_name([&](const std::string& name) {
    if (!file.contains(name)) missing.push_back(name);
    return missing.size() < 9;
  });
  uint64_t held = 0;
  for (const auto& [_, entry] : file.entries()) held += entry.end - entry.begin;
  const auto dtype = file.entries().empty() ? at::kFloat : file.entries().begin()->second.dtype;
  const Count n_params = model.parameters();
  const Count needed = n_params.times(c10::elementSize(dtype));
  if (needed.over || needed.value > held) {
    throw FormatError(concat(config_source, " describes a model of ", n_params.text(), " parameters (", needed.text(),
                             " bytes as ", safetensors_dtype_name(dtype), ") but ", source, " holds ", held,
                             " bytes; missing tensor(s) ", listing(missing)));
  }
  throw FormatError(concat(source, ": missing tensor(s) ", listing(missing)));
}

// Checks the file's header against config (checkpoints.py's check_header: the same rules, order and
// messages); returns the model's dtype. Costs time and memory in the header's size only.
at::ScalarType check_header(const GPTConfig& config, const SafetensorsFile& file, const std::string& config_source) {
  const auto source = file.path().string();
  const auto& entries = file.entries();  // sorted by name
  check_dtypes(file);
  const ModelTensors model(config, config_source);
  std::vector<std::string> unexpected;
  for (const auto& [name, _] : entries) {
    if (model.shape_of(name) == nullptr) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    throw FormatError(concat(source, ": unexpected tensor(s) ", listing(unexpected), " (not in the model that ",
                             config_source, " describes)"));
  }
  // Every name in the file is expected: the missing ones are found within entries.size() + 9 names.
  const Count n_tensors = model.tensors();
  if (n_tensors.over || entries.size() < n_tensors.value) missing_tensors(model, file, config_source);
  // Now the file holds every name of the model and no other: a shape that differs is the only way
  // left for it to hold fewer (or more) bytes than the model needs.
  model.for_each_name([&](const std::string& name) {
    const auto& shape = entries.at(name).shape;
    const auto* want = model.shape_of(name);
    if (shape != *want) {
      throw FormatError(concat(source, ": tensor '", name, "' has shape ", shape_string(shape), "; the model (",
                               config_source, ") expects ", shape_string(*want)));
    }
    return true;
  });
  return entries.begin()->second.dtype;
}

}  // namespace

GPT load_gpt(const std::filesystem::path& directory) {
  const auto config_path = directory / "config.json";
  if (!std::filesystem::is_regular_file(config_path)) {
    throw FormatError(config_path.string() + " not found: load_gpt takes a directory written by GPT.save (or the "
                      "demo) or by transformers' save_pretrained");
  }
  std::ifstream in(config_path);
  std::stringstream text;
  text << in.rdbuf();
  // transformers' configs name their model_type; GPT.save's never do (it is no option of theirs).
  const auto values = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (values.is_object() && values.contains("model_type")) return detail::load_huggingface(directory, text.str());
  const auto weights_path = directory / "model.safetensors";
  if (!std::filesystem::is_regular_file(weights_path)) {
    throw FormatError(weights_path.string() + " not found: load_gpt takes a directory written by GPT.save (or the demo)");
  }
  const auto config = GPTConfig::from_json(text.str(), config_path.string());
  // The header against the config before anything is allocated: a config that asks for more than
  // the file holds is refused here, whatever its size.
  const SafetensorsFile file(weights_path);
  const auto dtype = check_header(config, file, config_path.string());

  GPT model(config, dtype, Init::kSkip);  // every parameter read below
  torch::NoGradGuard no_grad;
  for (auto& param : model->named_parameters()) {
    const auto value = file.read(param.key());
    TORCH_CHECK(value.sizes() == param.value().sizes(), "load_gpt: parameter_layout disagrees with the model at '",
                param.key(), "'");
    param.value().copy_(value);
  }
  model->eval();
  return model;
}

}  // namespace causal_attention
