// Internal to the C++ GPT's readers (gpt.cpp, load.cpp, huggingface.cpp): message helpers and the
// model's parameter layout, computed from a config without building the model.
#pragma once

#include "causal_attention/gpt.h"

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <utility>
#include <sstream>
#include <string>
#include <vector>

namespace causal_attention::detail {

template <typename... Args>
std::string concat(const Args&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// (2, 3) or (4,), as Python prints a shape.
std::string shape_string(at::IntArrayRef shape);

// ['a', 'b'] (at most 8 names, then ', ...'), as gpt.py's _listing.
std::string listing(const std::vector<std::string>& names);

struct TensorShape {
  std::string name;
  std::vector<int64_t> shape;  // a size of -1: factor x size leaves int64 (the tensor is too large)
};

// GPT(config)'s parameters without building it, in named_parameters' order (as checkpoints.py's
// parameter_layout): before the blocks, one block's (names after "blocks.{i}."), after the blocks.
struct Layout {
  std::vector<TensorShape> before, block, after;
};
Layout parameter_layout(const GPTConfig& config);

// The layer index of "blocks.{i}.{rest}" (canonical decimal, below n_layers) and rest, or none.
std::optional<std::pair<int64_t, std::string>> block_name(const std::string& name, int64_t n_layers);

// Element count, or -1 when it (or a size) leaves int64.
int64_t numel(const std::vector<int64_t>& shape);

// A count in 64 bits that saturates: printed as checkpoints.py's _count_text prints it.
struct Count {
  uint64_t value = 0;
  bool over = false;
  Count& add(uint64_t n) {
    over = over || __builtin_add_overflow(value, n, &value);
    return *this;
  }
  Count times(uint64_t n) const {
    Count out = *this;
    out.over = out.over || __builtin_mul_overflow(value, n, &out.value);
    return out;
  }
  std::string text() const { return over ? "more than 18446744073709551615" : std::to_string(value); }
};

// The parameters of the model a layout describes (n_layers blocks), saturating.
Count parameter_count(const Layout& layout, int64_t n_layers);

// A transformers save_pretrained directory whose config.json holds config_text (huggingface.cpp).
GPT load_huggingface(const std::filesystem::path& directory, const std::string& config_text);

}  // namespace causal_attention::detail
