// The tokenizer of a build without ICU: every transformers tokenizer.json is refused with the reason.
#include "tokenizer.h"

#include "causal_attention/safetensors.h"  // FormatError

namespace causal_attention {

struct BpeTokenizer::State {};

BpeTokenizer::BpeTokenizer(std::unique_ptr<State> state) : state_(std::move(state)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

BpeTokenizer BpeTokenizer::load(const std::filesystem::path& path, int64_t /*vocab_size*/) {
  throw FormatError(path.string() + ": this causal-attention-generate was built without ICU (Debian: libicu-dev), "
                    "so it reads no transformers tokenizer; use --tokens, or rebuild with ICU");
}

std::vector<int64_t> BpeTokenizer::encode(const std::string& /*text*/, bool /*add_special_tokens*/) const { return {}; }
std::string BpeTokenizer::decode(const std::vector<int64_t>& /*ids*/, bool /*skip_special_tokens*/) const { return {}; }
std::optional<int64_t> BpeTokenizer::token_id(const std::string& /*content*/) const { return std::nullopt; }

std::string utf8_lossy(const std::string& bytes) { return bytes; }

}  // namespace causal_attention
