// causal-attention-generate: runs a model that Python's GPT.save (or the demo) wrote, or a
// transformers save_pretrained directory as it is (GPT-2, Llama, Qwen2, Mistral), in C++.
//
//   causal-attention-generate --model demo_out --prompt 0123456789      # the demo: prints 9876543210
//   causal-attention-generate --model gpt2_dir --tokens 464,3290 --tokens 40 --max-new-tokens 20
//
// Bad arguments and corrupt or mismatched files: the error on stderr and exit code 2.
#include "causal_attention/gpt.h"
#include "causal_attention/safetensors.h"
#include "tokenizer.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

namespace {

using causal_attention::FormatError;

constexpr int kUsageError = 2;

// The demo's character tokenizer (tokenizer.json beside config.json): a prompt is
// [bos_id] + one token per character + [sep_id]; an answer is shown up to eos_id, special tokens left out.
struct CharTokenizer {
  std::map<std::string, int64_t> vocab;
  std::optional<int64_t> bos_id, sep_id, eos_id;

  // vocab_size: the model's (config.json); every id must index its embedding.
  static CharTokenizer load(const std::filesystem::path& path, int64_t vocab_size) {
    using nlohmann::json;
    std::ifstream in(path);
    if (!in) {
      throw FormatError(path.string() + " not found: --prompt needs the model's tokenizer.json (the demo writes "
                        "one); use --tokens for token ids");
    }
    std::stringstream text;
    text << in.rdbuf();
    const json values = json::parse(text.str(), nullptr, false);
    const auto bad = [&](const std::string& why) { return FormatError(path.string() + ": " + why); };
    if (values.is_discarded() || !values.is_object()) throw bad("not a well-formed JSON object");
    if (values.value("format", "") != "causal_attention.char_tokenizer") {
      throw bad("format must be \"causal_attention.char_tokenizer\"");
    }
    if (!values.contains("vocab") || !values["vocab"].is_object()) throw bad("vocab must be an object {text: id}");
    const auto in_vocabulary = [&](const std::string& what, const json& id) {
      if (!id.is_number_integer()) throw bad(what + " must be an int; got " + id.dump());
      const auto value = id.get<int64_t>();
      if (value < 0 || value >= vocab_size) {
        throw bad(what + " = " + std::to_string(value) + " is outside the model's vocabulary 0.." +
                  std::to_string(vocab_size - 1) + " (config.json vocab_size=" + std::to_string(vocab_size) + ")");
      }
      return value;
    };
    CharTokenizer tokenizer;
    for (const auto& [piece, id] : values["vocab"].items()) {
      tokenizer.vocab[piece] = in_vocabulary("vocab['" + piece + "']", id);
    }
    for (const auto& [key, slot] : {std::pair{"bos_id", &tokenizer.bos_id}, std::pair{"sep_id", &tokenizer.sep_id},
                                    std::pair{"eos_id", &tokenizer.eos_id}}) {
      if (!values.contains(key) || values[key].is_null()) continue;
      if (!values[key].is_number_integer()) throw bad(std::string(key) + " must be an int or null");
      *slot = in_vocabulary(key, values[key]);
    }
    return tokenizer;
  }

  // The UTF-8 character starting at text[at] (its bytes), for vocab pieces beyond ASCII.
  static std::string utf8_character(const std::string& text, size_t at) {
    const auto lead = static_cast<unsigned char>(text[at]);
    const size_t size = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 0;
    bool valid = size > 0 && at + size <= text.size();
    for (size_t i = 1; valid && i < size; ++i) valid = (static_cast<unsigned char>(text[at + i]) >> 6) == 0x2;
    if (!valid) {
      throw std::invalid_argument("--prompt: not valid UTF-8 at byte " + std::to_string(at) + " of the prompt");
    }
    return text.substr(at, size);
  }

  std::vector<int64_t> encode(const std::string& text) const {
    std::vector<int64_t> ids;
    if (bos_id) ids.push_back(*bos_id);
    for (size_t at = 0; at < text.size();) {
      const auto character = utf8_character(text, at);
      const auto found = vocab.find(character);
      if (found == vocab.end()) {
        throw std::invalid_argument("--prompt: character '" + character + "' is not in the tokenizer's vocab");
      }
      ids.push_back(found->second);
      at += character.size();
    }
    if (sep_id) ids.push_back(*sep_id);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids) const {
    std::string text;
    for (const auto id : ids) {
      if (eos_id && id == *eos_id) break;
      for (const auto& [piece, piece_id] : vocab) {
        if (piece_id == id) text += piece;
      }
    }
    return text;
  }
};

// The tokenizer beside the model: the demo's characters or a transformers byte-level BPE.
class Tokenizer {
 public:
  // The directory's tokenizer.json; `needed`: --prompt or --tokenize use it. Unneeded, a transformers
  // tokenizer this program cannot read is left out with a note on stderr (--tokens still run).
  static std::optional<Tokenizer> load(const std::filesystem::path& directory, int64_t vocab_size, bool needed) {
    const auto path = directory / "tokenizer.json";
    if (!needed && !std::filesystem::exists(path)) return std::nullopt;
    std::ifstream in(path);
    std::stringstream text;
    if (in) text << in.rdbuf();
    const auto values = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (!in || !values.is_object() || !values.contains("model")) {
      // The demo's: its errors name what is wrong, --tokens too (its eos_id is their default)
      return Tokenizer{CharTokenizer::load(path, vocab_size)};
    }
    try {
      return Tokenizer{causal_attention::BpeTokenizer::load(path, vocab_size)};
    } catch (const FormatError& error) {
      if (needed) throw;
      std::cerr << "causal-attention-generate: note: tokenizer.json not read (" << error.what() << ")\n";
      return std::nullopt;
    }
  }

  std::vector<int64_t> encode(const std::string& text) const {
    return std::visit([&](const auto& t) { return t.encode(text); }, tokenizer_);
  }
  std::string decode(const std::vector<int64_t>& ids) const {
    return std::visit([&](const auto& t) { return t.decode(ids); }, tokenizer_);
  }
  std::optional<int64_t> eos_id() const {
    const auto* chars = std::get_if<CharTokenizer>(&tokenizer_);
    return chars != nullptr ? chars->eos_id : std::nullopt;  // a transformers model names it in its config
  }

 private:
  explicit Tokenizer(std::variant<CharTokenizer, causal_attention::BpeTokenizer> tokenizer)
      : tokenizer_(std::move(tokenizer)) {}
  std::variant<CharTokenizer, causal_attention::BpeTokenizer> tokenizer_;
};

// A transformers directory's end-of-sequence ids: generation_config.json's eos_token_id, else
// config.json's (an int or a list); none for our own files.
std::vector<int64_t> transformers_eos_ids(const std::filesystem::path& directory, int64_t vocab_size) {
  for (const char* name : {"generation_config.json", "config.json"}) {
    std::ifstream in(directory / name);
    if (!in) continue;
    std::stringstream text;
    text << in.rdbuf();
    const auto values = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (!values.is_object() || (std::string(name) == "config.json" && !values.contains("model_type"))) continue;
    if (!values.contains("eos_token_id") || values["eos_token_id"].is_null()) continue;
    const auto& eos = values["eos_token_id"];
    std::vector<int64_t> ids;
    for (const auto& id : eos.is_array() ? eos : nlohmann::json::array({eos})) {
      if (!id.is_number_integer()) {
        throw FormatError((directory / name).string() + ": eos_token_id must be an int or a list of ints; got " +
                          eos.dump());
      }
      // An id outside the vocabulary is never generated: leaving it out changes nothing (transformers
      // only warns of it too).
      if (id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab_size) {
        std::cerr << "causal-attention-generate: note: " << (directory / name).string() << ": eos_token_id "
                  << id.dump() << " is outside the model's vocabulary 0.." << vocab_size - 1 << " (never generated)\n";
        continue;
      }
      ids.push_back(id.get<int64_t>());
    }
    return ids;
  }
  return {};
}

std::vector<int64_t> parse_token_list(const std::string& text) {
  if (text.empty()) throw std::invalid_argument("--tokens: empty token list");
  std::vector<int64_t> ids;
  // Every item between commas, so that an empty one (a trailing comma: "1,2,") is refused.
  for (size_t start = 0; start <= text.size();) {
    const auto comma = std::min(text.find(',', start), text.size());
    const auto item = text.substr(start, comma - start);
    start = comma + 1;
    size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || id < 0) {
      throw std::invalid_argument("--tokens: expected comma-separated non-negative token ids; got '" + text + "'");
    }
    ids.push_back(id);
  }
  return ids;
}

// --seed as torch's manual_seed takes it: an integer in -2^63 .. 2^64 - 1, a negative one as its
// two's complement (manual_seed(-1) is manual_seed(2^64 - 1)).
uint64_t parse_seed(const std::string& text) {
  const auto bad = [&] {
    return std::invalid_argument("--seed: expected an integer in -9223372036854775808..18446744073709551615 (as "
                                 "torch's manual_seed); got '" + text + "'");
  };
  const bool negative = !text.empty() && text[0] == '-';
  const auto digits = text.substr(negative ? 1 : 0);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
    throw bad();
  }
  try {
    return negative ? static_cast<uint64_t>(std::stoll(text)) : static_cast<uint64_t>(std::stoull(text));
  } catch (const std::out_of_range&) {
    throw bad();
  }
}

std::string join(const std::vector<int64_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out;
}

// One prompt as given: text for the tokenizer (--prompt) or token ids (--tokens).
struct Input {
  bool text;
  std::string value;
};

struct Arguments {
  std::string model;
  std::vector<std::string> prompts, token_lists;
  std::vector<Input> inputs;  // prompts and token lists in command-line order
  std::optional<int64_t> max_new_tokens, top_k, eos, threads;
  std::optional<std::string> seed;  // parse_seed's
  double temperature = 1.0;
  std::string dump_logits;
  bool bench = false;
  bool rounded_logits = false;
  bool tokenize = false;
  bool no_eos = false;
  int bench_runs = 3;
};

// The options of generate: the command line's, with defaults from the model and the tokenizer.
causal_attention::GenerateOptions generate_options(const Arguments& args, const causal_attention::GPTConfig& config,
                                                   const std::optional<Tokenizer>& tokenizer,
                                                   const std::vector<int64_t>& model_eos, int64_t longest) {
  causal_attention::GenerateOptions options;
  // The last token is never fed back, so a prompt of max_len tokens still gets one.
  options.max_new_tokens =
      args.max_new_tokens.value_or(std::max<int64_t>(1, std::min<int64_t>(32, config.max_len - longest + 1)));
  options.top_k = args.top_k;
  options.temperature = args.temperature;
  if (args.no_eos) {
    // every sequence runs max_new_tokens (Python's eos_id=None)
  } else if (args.eos.has_value()) {
    options.eos_id = args.eos;
  } else if (tokenizer && tokenizer->eos_id()) {
    options.eos_id = tokenizer->eos_id();
  } else {
    options.stop_ids = model_eos;
  }
  if (args.seed) options.seed = parse_seed(*args.seed);
  options.keep_logits = !args.dump_logits.empty();
  options.float32_logits = !args.rounded_logits;
  return options;
}

// Prints one sequence's text as its tokens come: what decodes so far, less a last character whose
// bytes have not all arrived (U+FFFD until they do).
class TextStream {
 public:
  explicit TextStream(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  void add(int64_t token) {
    ids_.push_back(token);
    auto text = tokenizer_.decode(ids_);
    const std::string replacement = "\xEF\xBF\xBD";
    while (text.size() >= 3 && text.compare(text.size() - 3, 3, replacement) == 0) text.resize(text.size() - 3);
    emit(text);
  }
  void finish() {
    emit(tokenizer_.decode(ids_));
    std::cout << "\n" << std::flush;
  }

 private:
  void emit(const std::string& text) {
    if (text.size() > printed_ && text.compare(0, printed_, printed_text_) == 0) {
      std::cout << text.substr(printed_) << std::flush;
      printed_text_ = text;
      printed_ = text.size();
    }
  }
  const Tokenizer& tokenizer_;
  std::vector<int64_t> ids_;
  std::string printed_text_;
  size_t printed_ = 0;
};

// --dump-logits: the right-padded prompts, their mask, the full forward's logits (zero at padding),
// each generation step's logits and the generated tokens (padded with -1), for the parity tests.
void dump_logits(const std::string& path, causal_attention::GPT& model,
                 const std::vector<std::vector<int64_t>>& prompts, int64_t longest,
                 const causal_attention::GenerateResult& result) {
  const auto B = static_cast<int64_t>(prompts.size());
  auto tokens = at::zeros({B, longest}, at::kLong);
  auto mask = at::zeros({B, longest}, at::kBool);
  int64_t most = 0;
  for (const auto& t : result.tokens) most = std::max<int64_t>(most, static_cast<int64_t>(t.size()));
  auto generated = at::full({B, most}, -1, at::kLong);
  for (int64_t b = 0; b < B; ++b) {
    for (size_t t = 0; t < prompts[b].size(); ++t) {
      tokens[b][static_cast<int64_t>(t)] = prompts[b][t];
      mask[b][static_cast<int64_t>(t)] = true;
    }
    for (size_t t = 0; t < result.tokens[b].size(); ++t) generated[b][static_cast<int64_t>(t)] = result.tokens[b][t];
  }
  at::Tensor forward_logits;
  {
    torch::NoGradGuard no_grad;
    forward_logits = model->forward(tokens, mask);
  }
  causal_attention::save_safetensors(path, {{"prompt_tokens", tokens},
                                            {"prompt_mask", mask},
                                            {"forward_logits", forward_logits},
                                            {"step_logits", result.step_logits},
                                            {"generated", generated}});
}

// --bench: the best of `runs` generations in tokens per second, and the prefill (the prompts' tokens
// up to the first chosen token) and the decode steps after it, each in its own tokens per second.
void bench(causal_attention::GPT& model, const std::vector<std::vector<int64_t>>& prompts,
           causal_attention::GenerateOptions options, int runs) {
  using Clock = std::chrono::steady_clock;
  options.keep_logits = false;
  int64_t prompt_tokens = 0;
  for (const auto& p : prompts) prompt_tokens += static_cast<int64_t>(p.size());
  double best = 0.0, best_prefill = 0.0, best_decode = 0.0;
  int64_t count = 0, decoded = 0;
  for (int run = 0; run < runs; ++run) {
    const auto start = Clock::now();
    std::optional<Clock::time_point> first;  // the first token chosen: the prefill is done
    options.on_token = [&](int64_t, int64_t) {
      if (!first) first = Clock::now();
    };
    const auto out = model->generate(prompts, options);
    const auto end = Clock::now();
    const auto seconds = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    count = 0;
    for (const auto& t : out.tokens) count += static_cast<int64_t>(t.size());
    decoded = count - static_cast<int64_t>(prompts.size());  // the tokens of the steps after the first
    best = std::max(best, static_cast<double>(count) / seconds(start, end));
    best_prefill = std::max(best_prefill, static_cast<double>(prompt_tokens) / seconds(start, *first));
    if (decoded > 0) best_decode = std::max(best_decode, static_cast<double>(decoded) / seconds(*first, end));
  }
  const int threads = at::get_num_threads();
  std::cout << "bench: " << count << " tokens for " << prompts.size() << " prompt(s), best of " << runs
            << (runs == 1 ? " run: " : " runs: ") << std::fixed << std::setprecision(1) << best << " tokens/s ("
            << threads << (threads == 1 ? " thread)\n" : " threads)\n");
  std::cout << "bench: prefill " << prompt_tokens << " tokens: " << best_prefill << " tokens/s; decode " << decoded
            << " tokens: " << best_decode << " tokens/s\n";
}

int run(const Arguments& args) {
  if (args.threads) {
    if (*args.threads <= 0) throw std::invalid_argument("--threads must be positive");
    at::set_num_threads(static_cast<int>(*args.threads));
  }
  if (args.seed) parse_seed(*args.seed);  // before the model loads: a bad --seed is a usage error
  if (!args.dump_logits.empty()) {  // before generating: the file is written last
    const std::filesystem::path path(args.dump_logits);
    const auto parent = path.parent_path();
    if (std::filesystem::is_directory(path) || (!parent.empty() && !std::filesystem::is_directory(parent))) {
      throw std::invalid_argument("--dump-logits: cannot write '" + args.dump_logits + "' (" +
                                  (std::filesystem::is_directory(path) ? "a directory" : "no such directory") + ")");
    }
  }
  const std::filesystem::path directory(args.model);
  auto model = causal_attention::load_gpt(directory);
  const auto& config = model->config();
  if (args.eos && (*args.eos < 0 || *args.eos >= config.vocab_size)) {
    throw std::invalid_argument("--eos: " + std::to_string(*args.eos) + " is outside the model's vocabulary 0.." +
                                std::to_string(config.vocab_size - 1));
  }

  // The tokenizer encodes --prompt and, for the demo's files, gives --prompt and --tokens alike their
  // default EOS; a transformers directory names its own.
  const auto tokenizer = Tokenizer::load(directory, config.vocab_size, !args.prompts.empty() || args.tokenize);
  // Read only where it decides: --eos and the demo's tokenizer come first.
  const auto model_eos = args.no_eos || args.eos.has_value() || (tokenizer && tokenizer->eos_id())
                             ? std::vector<int64_t>{}
                             : transformers_eos_ids(directory, config.vocab_size);
  std::vector<std::vector<int64_t>> prompts;
  for (const auto& input : args.inputs) {
    prompts.push_back(input.text ? tokenizer->encode(input.value) : parse_token_list(input.value));
  }
  for (size_t b = 0; b < prompts.size(); ++b) {
    for (const auto id : prompts[b]) {
      if (id >= config.vocab_size) {
        throw std::invalid_argument("--tokens: id " + std::to_string(id) + " (input " + std::to_string(b + 1) +
                                    ") is outside the model's vocabulary 0.." + std::to_string(config.vocab_size - 1));
      }
    }
  }
  if (args.tokenize) {  // each input's ids and text, one JSON line each; no generation
    for (const auto& ids : prompts) {
      std::cout << nlohmann::json{{"ids", ids}, {"text", tokenizer->decode(ids)}}.dump() << "\n";
    }
    return 0;
  }
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));

  auto options = generate_options(args, config, tokenizer, model_eos, longest);
  // One text prompt: its answer is printed as it comes.
  std::optional<TextStream> stream;
  if (args.inputs.size() == 1 && args.inputs[0].text) {
    stream.emplace(*tokenizer);
    options.on_token = [&](int64_t, int64_t token) { stream->add(token); };
  }
  const auto result = model->generate(prompts, options);
  options.on_token = nullptr;
  for (size_t b = 0; b < prompts.size(); ++b) {
    if (stream) {
      stream->finish();
    } else {
      std::cout << (args.inputs[b].text ? tokenizer->decode(result.tokens[b]) : join(result.tokens[b])) << "\n";
    }
  }
  if (!args.dump_logits.empty()) dump_logits(args.dump_logits, model, prompts, longest, result);
  if (args.bench) bench(model, prompts, options, args.bench_runs);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Generate with a causal_attention GPT saved by Python (GPT.save or the demo) or by transformers: "
               "greedy or top-k, ragged batches, the C++ KV cache.",
               "causal-attention-generate"};
  Arguments args;
  // CLI11's PositiveNumber names its range as two doubles; this says what is expected.
  const CLI::Validator positive_integer(
      [](const std::string& text) -> std::string {
        size_t used = 0;
        long long value = 0;
        try {
          value = std::stoll(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        return used == text.size() && used > 0 && value > 0 ? "" : "expected a positive integer; got '" + text + "'";
      },
      "POSITIVE");
  app.add_option("--model", args.model,
                 "directory with config.json and model.safetensors (GPT.save, the demo's --out), or a transformers "
                 "save_pretrained directory (GPT-2, Llama, Qwen2, Mistral; sharded or not)")
      ->required();
  auto* prompt = app.add_option("--prompt", args.prompts,
                                "text prompt, encoded by the model's tokenizer.json (the demo's characters, or a "
                                "transformers byte-level BPE: GPT-2, Llama 3, Qwen2); repeat for a batch (one "
                                "prompt's answer is printed as it comes)");
  auto* tokens = app.add_option("--tokens", args.token_lists, "comma-separated token ids; repeat for a ragged batch");
  app.add_option("--max-new-tokens", args.max_new_tokens, "tokens to generate per prompt (default: up to 32, within max_len)");
  app.add_option("--top-k", args.top_k, "sample among the k most likely tokens (default: greedy)");
  app.add_option("--temperature", args.temperature, "divides the logits before top-k sampling; must be positive")
      ->capture_default_str();
  app.add_option("--seed", args.seed, "seed for top-k sampling (as torch.Generator().manual_seed)");
  auto* eos = app.add_option("--eos", args.eos,
                              "stop a sequence after this token id (default: the demo tokenizer's eos_id, or a "
                              "transformers model's eos_token_id)");
  app.add_flag("--no-eos", args.no_eos, "no end token: every sequence gets --max-new-tokens (Python's eos_id=None)")
      ->excludes(eos);
  app.add_option("--dump-logits", args.dump_logits,
                 "write prompt_tokens, prompt_mask, forward_logits, step_logits and generated to this safetensors file");
  app.add_flag("--rounded-logits", args.rounded_logits,
               "a bfloat16/float16 model chooses from logits rounded to its dtype (default: the head's float32 sums)");
  app.add_flag("--tokenize", args.tokenize,
               "print each input's token ids and text as a JSON line ({\"ids\": [...], \"text\": ...}) and exit");
  app.add_flag("--bench", args.bench, "time generation and print tokens/s");
  app.add_option("--bench-runs", args.bench_runs, "runs timed by --bench (the best is printed)")
      ->check(positive_integer)
      ->capture_default_str();
  app.add_option("--threads", args.threads, "intra-op threads (default: torch's, OMP_NUM_THREADS)")->check(positive_integer);
  try {
    app.parse(argc, argv);
    if (prompt->count() == 0 && tokens->count() == 0) throw CLI::RequiredError("--prompt or --tokens");
    // Each value of --prompt or --tokens is one entry of parse_order: the rows keep that order.
    size_t next_prompt = 0, next_tokens = 0;
    for (const auto* option : app.parse_order()) {
      if (option == prompt) args.inputs.push_back({true, args.prompts.at(next_prompt++)});
      if (option == tokens) args.inputs.push_back({false, args.token_lists.at(next_tokens++)});
    }
  } catch (const CLI::ParseError& error) {
    const int code = app.exit(error);
    return code == 0 ? 0 : kUsageError;
  }
  try {
    return run(args);
  } catch (const c10::Error& error) {
    std::cerr << "causal-attention-generate: error: " << error.what_without_backtrace() << "\n";
  } catch (const std::exception& error) {
    std::cerr << "causal-attention-generate: error: " << error.what() << "\n";
  }
  return kUsageError;
}
