// The C++ GPT against its pieces (the C++ layer, LayerNorm, Linear, GELU), the KV-cache
// generation against the full forward, and the strict loader on corrupt or mismatched files.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "causal_attention/attention.h"
#include "causal_attention/gpt.h"
#include "causal_attention/safetensors.h"

namespace {

namespace fs = std::filesystem;
using causal_attention::FormatError;
using causal_attention::GPT;
using causal_attention::GPTConfig;
using nlohmann::json;

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// A fresh directory, removed with everything in it at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path = fs::temp_directory_path() /
           ("ca_test_gpt_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

GPTConfig small_config(bool bias = true, bool tie_head = true) {
  GPTConfig config;
  config.vocab_size = 17;
  config.max_len = 24;
  config.dim = 16;
  config.n_layers = 2;
  config.n_heads = 4;
  config.mlp_hidden = 24;
  config.activation = "gelu_tanh";
  config.bias = bias;
  config.tie_head = tie_head;
  return config;
}

// A model with every parameter random (biases and LayerNorm weights too: the defaults would hide mistakes).
GPT random_model(const GPTConfig& config, torch::Dtype dtype = torch::kFloat64) {
  GPT model(config);
  model->to(dtype);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) p.copy_(torch::randn_like(p) * 0.3);
  model->eval();
  return model;
}

using Tensors = std::vector<std::pair<std::string, torch::Tensor>>;

Tensors state_of(GPT& model) {
  Tensors state;
  for (const auto& p : model->named_parameters()) state.emplace_back(p.key(), p.value().detach());
  return state;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

void save_model(const fs::path& dir, const GPTConfig& config, const Tensors& state) {
  write_text(dir / "config.json", config.to_json());
  causal_attention::save_safetensors(dir / "model.safetensors", state, {{"format", "causal_attention.gpt"}});
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The header and data of a safetensors file, to be edited and written back.
struct RawFile {
  json header;
  std::string data;

  explicit RawFile(const fs::path& path) {
    const auto bytes = read_bytes(path);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
    header = json::parse(bytes.substr(8, n));
    data = bytes.substr(8 + n);
  }
  void write(const fs::path& path, std::optional<uint64_t> size_field = std::nullopt) const {
    const auto text = header.dump();
    const uint64_t n = size_field.value_or(text.size());
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    write_text(path, bytes + text + data);
  }
};

// load_gpt must throw a FormatError whose message holds every piece.
void expect_load_error(const fs::path& dir, const std::vector<std::string>& pieces) {
  try {
    causal_attention::load_gpt(dir);
    ADD_FAILURE() << "load_gpt accepted the file; expected an error with '" << pieces.front() << "'";
  } catch (const FormatError& error) {
    for (const auto& piece : pieces) EXPECT_NE(std::string(error.what()).find(piece), std::string::npos) << error.what();
  }
}

// ---------------------------------------------------------------------------------------------

TEST(GPTConfig, JsonRoundTripAndStrictness) {
  const auto config = small_config(false, false);
  const auto back = GPTConfig::from_json(config.to_json());
  EXPECT_EQ(back.to_json(), config.to_json());
  const json written = json::parse(config.to_json());
  json full = written;
  for (const auto& [key, value] : written.items()) {
    if (key == "format") continue;
    json lacking = full;
    lacking.erase(key);
    EXPECT_THROW(GPTConfig::from_json(lacking.dump()), FormatError) << key;  // every option is required
  }
  full["colour"] = 1;
  EXPECT_THROW(GPTConfig::from_json(full.dump()), FormatError);
  EXPECT_THROW(GPTConfig::from_json(R"({"vocab_size": 5, "max_len": )"), FormatError);
}

// The Llama family's options: written only where they differ from GPT-2's (a GPT-2 config.json keeps
// its keys), read back equal, optional when absent, refused with gpt.py's words when out of range; a
// Llama-family GPT's parameter names are the Python ones.
TEST(GPTConfig, LlamaOptionsRoundTripAndChecks) {
  auto config = small_config(false, false);
  EXPECT_FALSE(json::parse(config.to_json()).contains("norm"));
  config.n_kv_heads = 2;
  config.norm = "rmsnorm";
  config.gated_mlp = true;
  config.activation = "silu";
  config.positions = "rope";
  config.rope_theta = 500000.0;
  config.rope_scaling = GPTConfig::RopeScaling{8.0, 1.0, 4.0, 16.0};
  config.qkv_bias = true;
  const auto back = GPTConfig::from_json(config.to_json());
  EXPECT_EQ(back.to_json(), config.to_json());
  EXPECT_EQ(back.kv_heads(), 2);
  EXPECT_TRUE(back.qkv_has_bias());
  EXPECT_FALSE(back.proj_has_bias());
  ASSERT_TRUE(back.rope_scaling.has_value());
  EXPECT_EQ(back.rope_scaling->factor, 8.0);

  const auto message_of = [](const GPTConfig& c) {
    try {
      c.validate();
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  auto bad = config;
  bad.n_kv_heads = 3;
  EXPECT_EQ(message_of(bad), "GPTConfig: n_kv_heads=3 must divide n_heads=4");
  bad = config;
  bad.norm = "batchnorm";
  EXPECT_EQ(message_of(bad), "GPTConfig.norm must be 'layernorm' or 'rmsnorm'; got 'batchnorm'");
  bad = config;
  bad.positions = "learned";
  EXPECT_EQ(message_of(bad), "GPTConfig.rope_scaling needs positions='rope'");
  json windowed = json::parse(config.to_json());
  windowed["sliding_window"] = 4;
  EXPECT_EQ(GPTConfig::from_json(windowed.dump()).sliding_window, 4);
  windowed["sliding_window"] = 0;
  EXPECT_THROW(GPTConfig::from_json(windowed.dump()), FormatError);
  json other = json::parse(config.to_json());
  other["rope_scaling"]["rope_type"] = "yarn";
  EXPECT_THROW(GPTConfig::from_json(other.dump()), FormatError);

  GPT model(config);
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  const std::vector<std::string> block0{"blocks.0.ln1.weight",       "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias",
                                        "blocks.0.attn.proj.weight", "blocks.0.ln2.weight",      "blocks.0.mlp.gate_up.weight",
                                        "blocks.0.mlp.down.weight"};
  EXPECT_EQ(names.front(), "tok.weight");  // no pos: rotary positions
  EXPECT_EQ(std::vector<std::string>(names.begin() + 1, names.begin() + 8), block0);
  EXPECT_EQ(model->named_parameters()["blocks.0.attn.qkv.weight"].sizes(), torch::IntArrayRef({(4 + 2 * 2) * 4, 16}));
}

// GPT(config, dtype): every parameter in dtype, the same names and shapes as GPT(config)->to(dtype).
TEST(GPT, BuiltInADtype) {
  auto config = small_config(false, false);
  GPT half(config, torch::kBFloat16);
  GPT plain(config);
  plain->to(torch::kBFloat16);
  const auto want = plain->named_parameters();
  ASSERT_EQ(half->named_parameters().size(), want.size());
  for (const auto& p : half->named_parameters()) {
    EXPECT_EQ(p.value().scalar_type(), torch::kBFloat16) << p.key();
    EXPECT_EQ(p.value().sizes(), want[p.key()].sizes()) << p.key();
  }
  // Drawn in float32, then converted (the embeddings' last draw is made in dtype).
  torch::manual_seed(12);
  GPT half_again(config, torch::kBFloat16);
  torch::manual_seed(12);
  GPT float_again(config);
  for (const auto& p : half_again->named_parameters()) {
    if (p.key() == "tok.weight" || p.key() == "pos.weight") continue;
    EXPECT_TRUE(torch::equal(p.value(), float_again->named_parameters()[p.key()].to(torch::kBFloat16))) << p.key();
  }
}

// Non-finite epsilons and thetas pass "> 0" but make every norm 0 or the rotary angles NaN: refused, as in Python.
TEST(GPTConfig, NonFiniteEpsilonAndThetaAreRefused) {
  for (const double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    auto config = small_config();
    config.layer_norm_eps = bad;
    EXPECT_THROW(
        {
          try {
            config.validate();
          } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("GPTConfig.layer_norm_eps must be a positive finite float"),
                      std::string::npos);
            throw;
          }
        },
        std::invalid_argument);
    config = small_config();
    config.positions = "rope";
    config.rope_theta = bad;
    EXPECT_THROW(
        {
          try {
            config.validate();
          } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("GPTConfig.rope_theta must be a positive finite number"),
                      std::string::npos);
            throw;
          }
        },
        std::invalid_argument);
  }
}

// GPT(config, dtype, Init::kSkip), load_gpt's: nothing drawn from the generator, every parameter
// there in dtype (uninitialised), the modules' options as GPT(config, dtype)'s.
TEST(GPT, SkippedInitialisationDrawsNothing) {
  for (const bool gated : {false, true}) {
    auto config = small_config(true, false);
    if (gated) {
      config.gated_mlp = true;
      config.activation = "silu";
    }
    GPT plain(config, torch::kHalf);
    torch::manual_seed(31);
    GPT skipped(config, torch::kHalf, causal_attention::Init::kSkip);
    const auto drawn_after = torch::randn({8});
    torch::manual_seed(31);
    EXPECT_TRUE(torch::equal(drawn_after, torch::randn({8}))) << "Init::kSkip drew from the generator";
    const auto want = plain->named_parameters();
    ASSERT_EQ(skipped->named_parameters().size(), want.size());
    for (const auto& p : skipped->named_parameters()) {
      EXPECT_EQ(p.value().scalar_type(), torch::kHalf) << p.key();
      EXPECT_EQ(p.value().sizes(), want[p.key()].sizes()) << p.key();
    }
    std::ostringstream printed_plain, printed_skipped;  // Linear and Embedding options
    printed_plain << *plain;
    printed_skipped << *skipped;
    EXPECT_EQ(printed_skipped.str(), printed_plain.str());
  }
}

TEST(GPT, ParameterNamesAreThePythonOnes) {
  GPT untied(small_config(true, false));
  const auto names = untied->named_parameters().keys();
  for (const std::string name : {"tok.weight", "pos.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias",
                                 "blocks.1.attn.qkv.weight", "blocks.1.attn.qkv.bias", "blocks.1.attn.proj.bias",
                                 "blocks.0.ln2.bias", "blocks.0.mlp.0.weight", "blocks.0.mlp.2.bias", "ln_f.weight",
                                 "head.weight"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
  EXPECT_EQ(names.size(), 2u + 2 * 12 + 2 + 1);
  GPT plain(small_config(false, true));
  for (const auto& name : plain->named_parameters().keys()) {
    EXPECT_EQ(name.find("bias"), std::string::npos) << name;
    EXPECT_NE(name, "head.weight");
  }
  EXPECT_EQ(plain->named_parameters().size(), 2u + 2 * 6 + 1);
}

// The GPT's forward against the same computation written out from the pieces.
TEST(GPT, ForwardEqualsItsPieces) {
  torch::manual_seed(7);
  for (const bool bias : {true, false}) {
    for (const bool tie : {true, false}) {
      const auto config = small_config(bias, tie);
      auto model = random_model(config);
      const auto tokens = torch::randint(0, config.vocab_size, {3, 9});
      const auto lengths = torch::tensor({9, 4, 1});
      const auto mask = torch::arange(9).unsqueeze(0) < lengths.unsqueeze(1);
      torch::NoGradGuard no_grad;
      const auto logits = model->forward(tokens, mask);  // (3, 9, V)

      auto x = model->tok->weight.index_select(0, tokens.flatten()).view({3, 9, config.dim}) +
               model->pos->weight.narrow(0, 0, 9).unsqueeze(0);
      const auto norm = [&](const torch::Tensor& h, causal_attention::LayerNorm& ln) {
        return torch::layer_norm(h, {config.dim}, ln->weight, ln->bias, config.layer_norm_eps);
      };
      for (const auto& module : *model->blocks) {
        auto* block = module->as<causal_attention::BlockImpl>();
        x = x + block->attn->forward(norm(x, block->ln1), mask);
        auto* fc = block->mlp[0]->as<torch::nn::LinearImpl>();
        auto* out = block->mlp[2]->as<torch::nn::LinearImpl>();
        x = x + torch::nn::functional::linear(
                    torch::gelu(torch::nn::functional::linear(norm(x, block->ln2), fc->weight, fc->bias), "tanh"),
                    out->weight, out->bias);
      }
      auto expected = torch::matmul(norm(x, model->ln_f), (tie ? model->tok->weight : model->head->weight).t());
      expected = expected.masked_fill(mask.logical_not().unsqueeze(-1), 0);
      EXPECT_LE(max_abs_diff(logits, expected), 1e-12) << "bias=" << bias << " tie=" << tie;
      EXPECT_EQ(logits.index({1, torch::indexing::Slice(4)}).abs().max().item<double>(), 0.0);
    }
  }
}

// Generation: each step's logits equal the full forward of prompt + tokens so far, at its last
// position; greedy picks their argmax; the ragged batch equals each prompt alone.
TEST(GPT, GenerateMatchesTheFullForward) {
  torch::manual_seed(11);
  const auto config = small_config();
  auto model = random_model(config);
  const std::vector<std::vector<int64_t>> prompts{{1, 2, 3, 4, 5}, {6}, {7, 8, 9}};
  causal_attention::GenerateOptions options;
  options.max_new_tokens = 6;
  options.keep_logits = true;
  const auto result = model->generate(prompts, options);
  ASSERT_EQ(result.step_logits.sizes(), torch::IntArrayRef({3, 6, config.vocab_size}));
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < prompts.size(); ++b) {
    ASSERT_EQ(result.tokens[b].size(), 6u);
    auto seq = prompts[b];
    for (int64_t s = 0; s < 6; ++s) {
      const auto full = model->forward(torch::tensor(seq).unsqueeze(0));  // (1, n, V)
      const auto last = full[0][static_cast<int64_t>(seq.size()) - 1];
      EXPECT_LE(max_abs_diff(result.step_logits[b][s], last), 1e-10) << "prompt " << b << " step " << s;
      EXPECT_EQ(result.tokens[b][s], last.argmax().item<int64_t>());
      seq.push_back(result.tokens[b][s]);
    }
    const auto alone = model->generate({prompts[b]}, options);
    EXPECT_EQ(alone.tokens[0], result.tokens[b]);
  }
}

// Mistral's sliding window: a window at least as long as the sequence is no window; a shorter one
// equals the specification (each position's last `window` keys, padding left out) in the kernel path,
// the autograd path and the cache path (a prefill, then one token per step).
TEST(GPT, SlidingWindowEqualsTheSpecification) {
  torch::manual_seed(12);
  auto config = small_config(false, false);
  config.n_kv_heads = 2;
  config.norm = "rmsnorm";
  config.gated_mlp = true;
  config.activation = "silu";
  config.positions = "rope";
  config.n_layers = 1;  // so that position t depends on tokens t-2..t alone (layers compound the window)
  auto plain = random_model(config);
  const auto tokens = torch::randint(0, config.vocab_size, {3, 11}, torch::kLong);
  auto mask = torch::ones({3, 11}, torch::kBool);
  mask[1].narrow(0, 6, 5).fill_(false);
  mask[2].narrow(0, 1, 10).fill_(false);
  const auto with_window = [&](int64_t window) {
    auto c = config;
    c.sliding_window = window;
    GPT model(c);
    model->to(torch::kFloat64);
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) p.value().copy_(plain->named_parameters()[p.key()]);
    model->eval();
    return model;
  };
  torch::NoGradGuard no_grad;
  const auto expected = plain->forward(tokens, mask);
  EXPECT_LE(max_abs_diff(with_window(11)->forward(tokens, mask), expected), 1e-12);
  auto windowed = with_window(3);
  const auto out = windowed->forward(tokens, mask);
  EXPECT_GT(max_abs_diff(out, expected), 1e-3);  // the window changes the answer
  {
    torch::AutoGradMode grad(true);  // the differentiable path: the same numbers
    EXPECT_LE(max_abs_diff(windowed->forward(tokens, mask), out), 1e-12);
  }
  // Position t with window 3 sees t-2..t: the logits at t equal those of the sequence cut to t-2..t
  // (rotary positions are relative: only the offsets between query and keys matter, up to the
  // float32 angles of cos and sin, as transformers computes them).
  for (int64_t t = 2; t < 11; ++t) {
    const auto cut = tokens[0].narrow(0, t - 2, 3).unsqueeze(0);
    EXPECT_LE(max_abs_diff(plain->forward(cut)[0][2], out[0][t]), 1e-6) << "position " << t;
  }
  causal_attention::GenerateOptions options;
  options.max_new_tokens = 7;
  options.keep_logits = true;
  const std::vector<std::vector<int64_t>> prompts{{1, 2, 3, 4, 5, 6}, {7}, {8, 9}};
  const auto result = windowed->generate(prompts, options);
  for (size_t b = 0; b < prompts.size(); ++b) {
    auto seq = prompts[b];
    for (int64_t s = 0; s < 7; ++s) {
      const auto full = windowed->forward(torch::tensor(seq).unsqueeze(0))[0][static_cast<int64_t>(seq.size()) - 1];
      EXPECT_LE(max_abs_diff(result.step_logits[b][s], full), 1e-10) << "prompt " << b << " step " << s;
      seq.push_back(result.tokens[b][s]);
    }
  }
  // Several new tokens after a past would each need a window of their own: refused.
  auto caches = windowed->make_caches(1, 12);
  windowed->hidden_states(torch::tensor({1, 2, 3}).unsqueeze(0), std::nullopt, caches);
  EXPECT_THROW(windowed->hidden_states(torch::tensor({4, 5}).unsqueeze(0), std::nullopt, caches), c10::ValueError);
}

// transformers' config.json read by convert.py's rules: the Llama family's names and defaults, and
// every option GPT lacks refused by name.
TEST(ConfigFromHuggingface, ReadsTheFamilyAndRefusesByName) {
  json llama{{"model_type", "llama"},      {"hidden_size", 32},     {"num_attention_heads", 4},
             {"num_key_value_heads", 2},   {"num_hidden_layers", 3}, {"intermediate_size", 40},
             {"vocab_size", 90},           {"rms_norm_eps", 1e-5},   {"attention_bias", true},
             {"rope_parameters", {{"rope_type", "llama3"}, {"rope_theta", 5e5}, {"factor", 8.0},
                                  {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                                  {"original_max_position_embeddings", 16}}}};
  const auto c = causal_attention::config_from_huggingface(llama.dump());
  EXPECT_EQ(c.dim, 32);
  EXPECT_EQ(c.kv_heads(), 2);
  EXPECT_EQ(c.n_layers, 3);
  EXPECT_EQ(c.hidden(), 40);
  EXPECT_EQ(c.max_len, 2048);  // LlamaConfig's default
  EXPECT_EQ(c.layer_norm_eps, 1e-5);
  EXPECT_TRUE(c.qkv_has_bias() && c.proj_has_bias() && !c.mlp_has_bias());
  EXPECT_FALSE(c.tie_head);
  EXPECT_EQ(c.rope_theta, 5e5);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 16.0);
  EXPECT_EQ(c.norm, "rmsnorm");
  EXPECT_EQ(c.positions, "rope");

  json qwen = llama;
  qwen["model_type"] = "qwen2";
  qwen.erase("rope_parameters");
  qwen["rope_theta"] = 1e6;  // transformers 4's spelling
  const auto q = causal_attention::config_from_huggingface(qwen.dump());
  EXPECT_TRUE(q.qkv_has_bias() && !q.proj_has_bias() && !q.mlp_has_bias());
  EXPECT_EQ(q.rope_theta, 1e6);
  EXPECT_FALSE(q.rope_scaling.has_value());

  json mistral = qwen;
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = 5;
  const auto m = causal_attention::config_from_huggingface(mistral.dump());
  EXPECT_EQ(m.sliding_window, 5);
  EXPECT_FALSE(m.qkv_has_bias());

  const auto gpt2 = causal_attention::config_from_huggingface(json{{"model_type", "gpt2"}, {"n_embd", 96}}.dump());
  EXPECT_EQ(gpt2.dim, 96);
  EXPECT_EQ(gpt2.n_heads, 12);
  EXPECT_EQ(gpt2.vocab_size, 50257);
  EXPECT_EQ(gpt2.activation, "gelu_tanh");
  EXPECT_TRUE(gpt2.tie_head && gpt2.bias);

  const auto message = [](const json& values) {
    try {
      causal_attention::config_from_huggingface(values.dump(), "dir/config.json");
    } catch (const FormatError& error) {
      return std::string(error.what());
    }
    return std::string("accepted");
  };
  auto bad = llama;
  bad["rope_parameters"]["rope_type"] = "yarn";
  EXPECT_EQ(message(bad), "dir/config.json: rope type 'yarn' is not supported (GPT implements 'default' and 'llama3')");
  bad = llama;
  bad["head_dim"] = 16;
  EXPECT_NE(message(bad).find("head_dim=16 is not supported"), std::string::npos);
  bad = llama;
  bad["hidden_size"] = 32.5;
  EXPECT_EQ(message(bad), "dir/config.json: hidden_size must be an int; got 32.5");
  bad = llama;
  bad.erase("vocab_size");
  EXPECT_EQ(message(bad), "dir/config.json: missing option vocab_size");
  bad = llama;
  bad["model_type"] = "gemma2";
  EXPECT_NE(message(bad).find("model_type \"gemma2\" is not supported"), std::string::npos);
  bad = qwen;
  bad["use_sliding_window"] = true;
  bad["max_window_layers"] = 1;
  EXPECT_NE(message(bad).find("use_sliding_window=true is not supported for Qwen2"), std::string::npos);
  bad["max_window_layers"] = 3;  // windows from layer 3 on: none of the 3 layers, so full attention
  EXPECT_EQ(message(bad), "accepted");
  EXPECT_NE(message(json{{"model_type", "gpt2"}, {"reorder_and_upcast_attn", true}}).find("reorder_and_upcast_attn"),
            std::string::npos);
  EXPECT_NE(message(json{{"model_type", "gpt2"}, {"n_head", 5}}).find("n_head=5 does not divide n_embd=768"),
            std::string::npos);
}

// A bfloat16/half model chooses from its head's float32 sums by default (GenerateOptions::float32_logits):
// float32 step logits that round to the model's own logits (the same hidden states, one rounding
// apart), each step's token their argmax; without the option, the model's dtype.
TEST(GPT, HalfModelsGenerateFromFloat32Logits) {
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    torch::manual_seed(12);
    auto model = random_model(small_config(true, false), dtype);
    const std::vector<std::vector<int64_t>> prompts{{1, 2, 3, 4, 5}, {6}, {7, 8, 9}};
    causal_attention::GenerateOptions options;
    options.max_new_tokens = 5;
    options.keep_logits = true;
    const auto wide = model->generate(prompts, options);
    ASSERT_EQ(wide.step_logits.scalar_type(), torch::kFloat32);
    options.float32_logits = false;
    const auto rounded = model->generate(prompts, options);
    ASSERT_EQ(rounded.step_logits.scalar_type(), dtype);
    for (size_t b = 0; b < prompts.size(); ++b) {
      for (size_t s = 0; s < wide.tokens[b].size(); ++s) {
        const auto step = wide.step_logits[static_cast<int64_t>(b)][static_cast<int64_t>(s)];
        EXPECT_EQ(wide.tokens[b][s], step.argmax().item<int64_t>()) << "prompt " << b << " step " << s;
      }
    }
    // The first step sees the same hidden states either way: the float32 logits round to the dtype's.
    EXPECT_TRUE(torch::equal(wide.step_logits.select(1, 0).to(dtype), rounded.step_logits.select(1, 0)));
    torch::NoGradGuard no_grad;
    const auto tokens = torch::tensor({1, 2, 3, 4, 5}).unsqueeze(0);
    const auto full = model->forward(tokens, std::nullopt, true);
    ASSERT_EQ(full.scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::allclose(full.to(dtype).to(torch::kFloat32), model->forward(tokens).to(torch::kFloat32), 0,
                                0));
  }
}

TEST(GPT, GenerateStopsAtEosAndSamplesReproducibly) {
  torch::manual_seed(3);
  const auto config = small_config();
  auto model = random_model(config, torch::kFloat32);
  const std::vector<std::vector<int64_t>> prompts{{1, 2}, {3, 4, 5, 6}};
  causal_attention::GenerateOptions greedy;
  greedy.max_new_tokens = 8;
  const auto free_run = model->generate(prompts, greedy).tokens;
  greedy.eos_id = free_run[0][2];
  const auto stopped = model->generate(prompts, greedy).tokens;
  const auto first_eos = std::find(free_run[0].begin(), free_run[0].end(), *greedy.eos_id) - free_run[0].begin();
  EXPECT_EQ(stopped[0], std::vector<int64_t>(free_run[0].begin(), free_run[0].begin() + first_eos + 1));

  causal_attention::GenerateOptions top1;
  top1.max_new_tokens = 8;
  top1.top_k = 1;
  top1.seed = 5;
  EXPECT_EQ(model->generate(prompts, top1).tokens, free_run);  // k = 1 is greedy
  causal_attention::GenerateOptions sample = top1;
  sample.top_k = 5;
  sample.temperature = 2.0;
  EXPECT_EQ(model->generate(prompts, sample).tokens, model->generate(prompts, sample).tokens);

  causal_attention::GenerateOptions bad;
  bad.max_new_tokens = config.max_len;
  EXPECT_THROW(model->generate(prompts, bad), c10::ValueError);
  EXPECT_THROW(model->generate({{1, 99}}, greedy), c10::ValueError);  // token outside the vocabulary
  EXPECT_THROW(model->generate({{}}, greedy), c10::ValueError);
  bad = greedy;
  bad.top_k = config.vocab_size + 1;
  EXPECT_THROW(model->generate(prompts, bad), c10::ValueError);
}

// The rules gpt.py's generate keeps too: a prompt of max_len tokens gets one token (the logits at
// its last position need no new position); temperature must be positive, with the same message.
TEST(GPT, GenerateFitsMaxLenAndRefusesTemperatureZero) {
  torch::manual_seed(5);
  const auto config = small_config();
  auto model = random_model(config);
  std::vector<int64_t> full(static_cast<size_t>(config.max_len));
  for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<int64_t>(i % 7);
  causal_attention::GenerateOptions one;
  one.max_new_tokens = 1;
  const auto result = model->generate({full, {3, 4}}, one);
  torch::NoGradGuard no_grad;
  const auto last = model->forward(torch::tensor(full).unsqueeze(0))[0][config.max_len - 1];
  EXPECT_EQ(result.tokens[0], std::vector<int64_t>{last.argmax().item<int64_t>()});
  causal_attention::GenerateOptions rest;
  rest.max_new_tokens = 5;
  const std::vector<int64_t> shorter(full.begin(), full.end() - 4);
  EXPECT_EQ(model->generate({shorter}, rest).tokens[0].size(), 5u);
  rest.max_new_tokens = 6;
  try {
    model->generate({shorter}, rest);
    ADD_FAILURE() << "a prompt + max_new_tokens - 1 beyond max_len was accepted";
  } catch (const c10::ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("- 1 = 25 positions exceeds max_len=24"), std::string::npos) << error.what();
  }
  causal_attention::GenerateOptions cold;
  cold.top_k = 2;
  cold.temperature = 0.0;
  try {
    model->generate({{1, 2}}, cold);
    ADD_FAILURE() << "temperature 0 was accepted";
  } catch (const c10::ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("temperature must be positive; got 0"), std::string::npos) << error.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Files

// A tensor larger than a read range is read in ranges on torch's threads: every byte where it belongs,
// for any thread count, into a fresh tensor or a row slice of a larger one; a file cut short after its
// header was read is an error naming the tensor, not a partial tensor.
TEST(Safetensors, ReadsLargeTensorsInRanges) {
  TempDir dir;
  const auto big = torch::randint(0, 1 << 15, {5, 1 << 20}, torch::kInt16);  // 10 MB: two ranges and a part
  const auto odd = torch::randn({3, 7});
  causal_attention::save_safetensors(dir.path / "big.safetensors", {{"odd", odd}, {"big", big}}, {});
  const causal_attention::SafetensorsFile file(dir.path / "big.safetensors");
  const int before = at::get_num_threads();
  for (const int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    EXPECT_TRUE(torch::equal(file.read("big"), big)) << threads << " threads";
    EXPECT_TRUE(torch::equal(file.read("odd"), odd));
    auto rows = torch::zeros({7, 1 << 20}, torch::kInt16);
    file.read_into("big", rows.narrow(0, 1, 5));
    EXPECT_TRUE(torch::equal(rows.narrow(0, 1, 5), big));
    EXPECT_EQ(rows[0].abs().sum().item<int64_t>() + rows[6].abs().sum().item<int64_t>(), 0);
  }
  at::set_num_threads(before);
  fs::resize_file(dir.path / "big.safetensors", fs::file_size(dir.path / "big.safetensors") - 100);
  try {
    file.read("big");
    FAIL() << "expected an error";
  } catch (const causal_attention::FormatError& error) {
    EXPECT_NE(std::string(error.what()).find("tensor 'big': could not read its bytes"), std::string::npos)
        << error.what();
  }
}

TEST(LoadGPT, RoundTripsEveryConfiguration) {
  torch::manual_seed(5);
  for (const bool bias : {true, false}) {
    for (const bool tie : {true, false}) {
      TempDir dir;
      const auto config = small_config(bias, tie);
      auto model = random_model(config, torch::kFloat32);
      save_model(dir.path, config, state_of(model));
      auto loaded = causal_attention::load_gpt(dir.path);
      EXPECT_EQ(loaded->config().to_json(), config.to_json());
      const auto tokens = torch::randint(0, config.vocab_size, {2, 7});
      torch::NoGradGuard no_grad;
      EXPECT_EQ(max_abs_diff(loaded->forward(tokens), model->forward(tokens)), 0.0);
      EXPECT_EQ(loaded->tok->weight.scalar_type(), torch::kFloat32);
    }
  }
}

class CorruptFile : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(9);
    config = small_config();
    auto model = random_model(config, torch::kFloat32);
    state = state_of(model);
    save_model(dir.path, config, state);
  }
  fs::path weights() const { return dir.path / "model.safetensors"; }
  void replace(const std::string& name, const torch::Tensor& value) {
    for (auto& [key, tensor] : state) {
      if (key == name) tensor = value;
    }
    save_model(dir.path, config, state);
  }

  TempDir dir;
  GPTConfig config;
  Tensors state;
};

TEST_F(CorruptFile, Truncated) {
  const auto bytes = read_bytes(weights());
  write_text(weights(), bytes.substr(0, bytes.size() - 10));
  expect_load_error(dir.path, {"model.safetensors", "outside the data section"});
}

TEST_F(CorruptFile, TruncatedInsideTheHeader) {
  write_text(weights(), read_bytes(weights()).substr(0, 40));
  expect_load_error(dir.path, {"runs past the end of the file"});
  write_text(weights(), "abc");
  expect_load_error(dir.path, {"too short"});
}

TEST_F(CorruptFile, WrongShape) {
  replace("blocks.1.attn.qkv.weight", torch::zeros({3 * config.dim, config.dim + 1}));
  expect_load_error(dir.path, {"'blocks.1.attn.qkv.weight'", "shape (48, 17)", "expects (48, 16)"});
}

TEST_F(CorruptFile, WrongDtype) {
  replace("ln_f.weight", torch::ones({config.dim}, torch::kFloat64));
  expect_load_error(dir.path, {"'ln_f.weight'", "F64", "F32"});
  replace("ln_f.weight", torch::ones({config.dim}, torch::kLong));
  expect_load_error(dir.path, {"'ln_f.weight'", "I64", "floating dtype"});
}

TEST_F(CorruptFile, MissingTensor) {
  std::erase_if(state, [](const auto& item) { return item.first == "blocks.0.mlp.2.bias"; });
  save_model(dir.path, config, state);
  expect_load_error(dir.path, {"missing", "'blocks.0.mlp.2.bias'"});
}

TEST_F(CorruptFile, UnexpectedTensor) {
  state.emplace_back("head.weight", torch::zeros({config.vocab_size, config.dim}));  // the head is tied
  save_model(dir.path, config, state);
  expect_load_error(dir.path, {"unexpected", "'head.weight'"});
}

TEST_F(CorruptFile, HeaderLiesAboutSizes) {
  RawFile raw(weights());
  raw.header["pos.weight"]["shape"] = {config.max_len + 1, config.dim};  // bytes no longer match
  raw.write(weights());
  expect_load_error(dir.path, {"'pos.weight'", "needs"});
}

TEST_F(CorruptFile, HeaderLiesAboutOffsets) {
  const RawFile original(weights());
  RawFile shifted = original;
  const auto offsets = original.header["blocks.0.ln1.weight"]["data_offsets"];
  shifted.header["blocks.0.ln1.weight"]["data_offsets"] = {offsets[0].get<uint64_t>() + 4, offsets[1].get<uint64_t>() + 4};
  shifted.write(weights());
  expect_load_error(dir.path, {"'blocks.0.ln1.weight'", "not packed"});

  RawFile past = original;
  past.header["tok.weight"]["data_offsets"] = {past.data.size() + 100, past.data.size() + 100 + 17 * 16 * 4};
  past.write(weights());
  expect_load_error(dir.path, {"'tok.weight'", "outside the data section"});

  RawFile negative = original;
  negative.header["tok.weight"]["data_offsets"] = {-4, 10};
  negative.write(weights());
  expect_load_error(dir.path, {"'tok.weight'", "non-negative"});

  RawFile trailing = original;  // bytes after the last tensor
  trailing.data += "junk";
  trailing.write(weights());
  expect_load_error(dir.path, {"unexplained bytes"});

  original.write(weights());
  EXPECT_NO_THROW(causal_attention::load_gpt(dir.path));
}

TEST_F(CorruptFile, HeaderSizeHugeOrWrong) {
  RawFile raw(weights());
  raw.write(weights(), uint64_t{1} << 62);
  expect_load_error(dir.path, {"header size", "above the limit"});
  raw.write(weights(), raw.header.dump().size() + raw.data.size() + 1);
  expect_load_error(dir.path, {"runs past the end of the file"});
  raw.write(weights(), raw.header.dump().size() - 1);  // cuts the JSON short
  expect_load_error(dir.path, {"not well-formed JSON"});
}

TEST_F(CorruptFile, UnknownDtypeAndBadEntries) {
  RawFile raw(weights());
  raw.header["ln_f.weight"]["dtype"] = "F128";
  raw.write(weights());
  expect_load_error(dir.path, {"'ln_f.weight'", "unsupported dtype"});
  RawFile extra(weights());
  extra.header["ln_f.weight"]["dtype"] = "F32";
  extra.header["ln_f.weight"]["colour"] = "red";
  extra.write(weights());
  expect_load_error(dir.path, {"'ln_f.weight'", "unknown header field"});
}

TEST_F(CorruptFile, MismatchedConfig) {
  auto other = config;
  other.dim = 32;
  write_text(dir.path / "config.json", other.to_json());
  expect_load_error(dir.path, {"'tok.weight'", "shape (17, 16)", "expects (17, 32)"});
  write_text(dir.path / "config.json", R"({"vocab_size": 17, "max_len": 24, "layers": 2})");
  expect_load_error(dir.path, {"config.json", "unknown option(s) ['layers']"});
  fs::remove(dir.path / "config.json");
  expect_load_error(dir.path, {"config.json not found"});
}

}  // namespace

namespace {

// ---------------------------------------------------------------------------------------------
// The corpus of good and bad directories shared with the Python tests (tests/data/checkpoint_cases.json;
// tests/checkpoint_cases.py writes the same directories for GPT.load and the program).

json checkpoint_corpus() {
  return json::parse(read_bytes(fs::path(CA_TESTS_DATA_DIR) / "checkpoint_cases.json"));
}

torch::Dtype corpus_dtype(const std::string& name) {
  const std::map<std::string, torch::Dtype> dtypes{
      {"F64", torch::kFloat64}, {"F32", torch::kFloat32}, {"F16", torch::kFloat16}, {"BF16", torch::kBFloat16},
      {"I64", torch::kLong}};
  return dtypes.at(name);
}

// case's config.json and model.safetensors in dir (as checkpoint_cases.write does); returns the tensors.
Tensors write_case(const json& corpus, const json& item, const fs::path& dir) {
  const auto& base = corpus["base_config"];
  std::string config_text;
  if (item.contains("config_text")) {
    config_text = item["config_text"].get<std::string>();
  } else {
    json config = base;
    const auto edits = item.value("config", json::object());
    const json set = edits.value("set", json::object()), remove = edits.value("remove", json::array());
    for (const auto& [key, value] : set.items()) config[key] = value;
    for (const auto& key : remove) config.erase(key.get<std::string>());
    config_text = config.dump(2);
  }
  write_text(dir / "config.json", config_text);

  auto model = random_model(GPTConfig::from_json(base.dump()), torch::kFloat32);
  Tensors state = state_of(model);
  const auto spec = item.value("tensors", json::object());
  const auto find = [&](const std::string& name) -> torch::Tensor& {
    for (auto& [key, tensor] : state) {
      if (key == name) return tensor;
    }
    throw std::out_of_range("no tensor " + name);
  };
  if (spec.contains("all_dtype")) {
    for (auto& [_, tensor] : state) tensor = tensor.to(corpus_dtype(spec["all_dtype"]));
  }
  // (each part copied out first: a range-for over a temporary's items() would dangle)
  const json dtypes = spec.value("dtype", json::object()), shapes = spec.value("shape", json::object());
  const json removed = spec.value("remove", json::array()), added_tensors = spec.value("add", json::object());
  for (const auto& [name, dtype] : dtypes.items()) {
    find(name) = find(name).to(corpus_dtype(dtype));
  }
  for (const auto& [name, shape] : shapes.items()) {
    find(name) = torch::zeros(shape.get<std::vector<int64_t>>(), find(name).options());
  }
  for (const auto& name : removed) {
    std::erase_if(state, [&](const auto& entry) { return entry.first == name.get<std::string>(); });
  }
  for (const auto& [name, added] : added_tensors.items()) {
    state.emplace_back(name, torch::zeros(added["shape"].get<std::vector<int64_t>>(), corpus_dtype(added["dtype"])));
  }
  causal_attention::save_safetensors(dir / "model.safetensors", state, {{"format", "causal_attention.gpt"}});
  return state;
}

// Each case loads (with the warning it lists on stderr, or none) or is refused with a one-line
// FormatError holding every listed piece, as tests/test_checkpoints.py checks GPT.load.
TEST(LoadGPT, SharedCorpus) {
  const auto corpus = checkpoint_corpus();
  ASSERT_GE(corpus["cases"].size(), 40u);
  for (const auto& item : corpus["cases"]) {
    const auto name = item["name"].get<std::string>();
    SCOPED_TRACE(name);
    TempDir dir;
    const auto written = write_case(corpus, item, dir.path);
    ::testing::internal::CaptureStderr();
    std::optional<GPT> model;
    std::string error;
    try {
      model = causal_attention::load_gpt(dir.path);
    } catch (const FormatError& e) {
      error = e.what();
    }
    const auto warnings = ::testing::internal::GetCapturedStderr();
    if (item.contains("error")) {
      EXPECT_FALSE(model.has_value()) << "loaded; expected an error";
      EXPECT_EQ(error.find('\n'), std::string::npos) << error;
      for (const auto& piece : item["error"]) {
        EXPECT_NE(error.find(piece.get<std::string>()), std::string::npos) << error << "\n  lacks: " << piece;
      }
      continue;
    }
    ASSERT_TRUE(model.has_value()) << error;
    if (item["warning"].empty()) {
      EXPECT_EQ(warnings, "");
    } else {
      EXPECT_EQ(std::count(warnings.begin(), warnings.end(), '\n'), 1) << warnings;
      for (const auto& piece : item["warning"]) {
        EXPECT_NE(warnings.find(piece.get<std::string>()), std::string::npos) << warnings << "\n  lacks: " << piece;
      }
    }
    const auto params = (*model)->named_parameters();
    ASSERT_EQ(params.size(), written.size());
    for (const auto& [key, tensor] : written) EXPECT_TRUE(torch::equal(params[key], tensor)) << key;
  }
}

TEST(Rotary, WithoutAGradientOnePassGivesTheCompositionsBits) {
  // Rotary::apply under NoGradGuard (kernels::rotary_qkv_cpu) against itself while a gradient is wanted
  // (the ATen composition): every dtype, GQA, a head size with a vector tail, values in the hundreds.
  torch::manual_seed(31);
  const int64_t H = 4, Hkv = 2, hd = 48, B = 2, T = 37;
  const auto inv_freq = 1.0 / torch::pow(500000.0, torch::arange(0, hd, 2).to(torch::kFloat) / hd);
  for (const auto dtype : {torch::kFloat64, torch::kFloat32, torch::kBFloat16, torch::kHalf}) {
    const auto rot = causal_attention::Rotary::at(torch::randint(0, 100000, {B, T}), inv_freq, dtype);
    const auto qkv = (torch::randn({B, T, (H + 2 * Hkv) * hd}) * 200).to(dtype);
    torch::Tensor fused, composed;
    {
      torch::NoGradGuard no_grad;
      fused = rot.apply(qkv, H, Hkv);
    }
    const auto x = qkv.clone().requires_grad_();
    composed = rot.apply(x, H, Hkv);
    ASSERT_TRUE(composed.requires_grad());
    EXPECT_TRUE(torch::equal(fused, composed.detach())) << dtype;
  }
  const auto bad = [&](const torch::Tensor& qkv, const torch::Tensor& cos, int64_t heads) {
    return causal_attention::kernels::rotary_qkv_cpu(qkv, cos, cos, heads, 1);
  };
  EXPECT_THROW(bad(torch::randn({2, 4 * 7}), torch::randn({2, 7}), 2), c10::ValueError);  // odd head_dim
  EXPECT_THROW(bad(torch::randn({2, 32}), torch::randn({2, 8}).to(torch::kDouble), 2), c10::TypeError);
  EXPECT_THROW(bad(torch::randn({2, 32}), torch::randn({3, 8}), 2), c10::ValueError);  // cos (3, 8) vs (2, 8)
}

}  // namespace
