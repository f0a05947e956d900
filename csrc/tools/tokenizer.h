// The byte-level BPE tokenizers of transformers' tokenizer.json (GPT-2, Llama 3, Qwen2 and the
// models that share their format), for causal-attention-generate's --prompt: token-equal to the
// `tokenizers` package (tested on a corpus of each kind, tests/tools/test_cpp_tokenizer.py).
//
//   auto tokenizer = causal_attention::BpeTokenizer::load("dir/tokenizer.json", vocab_size);
//   std::vector<int64_t> ids = tokenizer.encode("Hello world");   // with the template's BOS
//   std::string text = tokenizer.decode(ids);                      // special tokens left out
//
// Read: model BPE (merges as "a b" or ["a", "b"], ignore_merges), added tokens (lstrip, rstrip,
// single_word), the NFC normalizer, the pre-tokenizers ByteLevel (GPT-2's regex or none) and Split
// (a regex, Isolated) in a Sequence, the ByteLevel and TemplateProcessing post-processors and the
// ByteLevel decoder; regexes run on ICU with \s as Unicode White_Space (as Oniguruma's). Anything
// else (WordPiece, Unigram, byte_fallback, other normalizers or pre-tokenizers) is a FormatError
// naming it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace causal_attention {

class BpeTokenizer {
 public:
  // vocab_size: the model's; every id the tokenizer can produce must index its embedding.
  static BpeTokenizer load(const std::filesystem::path& path, int64_t vocab_size);
  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  // text (UTF-8; std::invalid_argument naming the byte where it is not) -> ids, as
  // tokenizers' encode(text, add_special_tokens=add_special_tokens).ids.
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = true) const;
  // ids -> text, as tokenizers' decode(ids, skip_special_tokens=...): bytes that are no UTF-8 become U+FFFD.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = true) const;
  // The id of an added token's content, if there is one ("<|endoftext|>", "<|eot_id|>").
  std::optional<int64_t> token_id(const std::string& content) const;

 private:
  struct State;
  explicit BpeTokenizer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// bytes with each ill-formed UTF-8 subsequence replaced by U+FFFD (Rust's from_utf8_lossy, which
// tokenizers' decode uses: one U+FFFD per maximal subpart).
std::string utf8_lossy(const std::string& bytes);

}  // namespace causal_attention
