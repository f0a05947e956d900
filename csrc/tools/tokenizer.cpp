#include "tokenizer.h"

#include "causal_attention/safetensors.h"  // FormatError

#include <nlohmann/json.hpp>
#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/utf8.h>

#include <array>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <queue>
#include <unordered_map>
#include <unordered_set>

namespace causal_attention {

namespace {

using nlohmann::json;

// One pre-tokenization step over a piece of text: the pieces it splits it into.
struct Splitter {
  std::unique_ptr<icu::RegexPattern> pattern;  // null: no split (ByteLevel without its regex)
  bool add_prefix_space = false;               // ByteLevel's
};

struct AddedToken {
  std::string content;
  int64_t id;
  bool lstrip, rstrip, single_word, normalized, special;
};

// ICU's \s is [\t\n\f\r\p{Z}]; Oniguruma's (tokenizers') is Unicode White_Space, which adds \v and
// U+0085; ICU's \h is horizontal space, Oniguruma's a hexadecimal digit. The patterns are rewritten to
// name the properties, inside classes too.
std::string white_space_as_oniguruma(const std::string& pattern) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[i + 1];
      if (next == 's' || next == 'S') {
        out += next == 's' ? "\\p{White_Space}" : "\\P{White_Space}";
      } else if (next == 'h' || next == 'H') {  // Oniguruma's hexadecimal digit (ICU's is horizontal space)
        out += next == 'h' ? "\\p{ASCII_Hex_Digit}" : "\\P{ASCII_Hex_Digit}";
      } else {
        out += pattern.substr(i, 2);
      }
      ++i;
      continue;
    }
    out += pattern[i];
  }
  return out;
}

std::unique_ptr<icu::RegexPattern> compile(const std::string& pattern, bool literal, const std::string& source) {
  UErrorCode status = U_ZERO_ERROR;
  UParseError error;
  std::unique_ptr<icu::RegexPattern> compiled(icu::RegexPattern::compile(
      icu::UnicodeString::fromUTF8(literal ? pattern : white_space_as_oniguruma(pattern)), literal ? UREGEX_LITERAL : 0,
      error, status));
  if (U_FAILURE(status)) {
    throw FormatError(source + ": pre-tokenizer regex " + json(pattern).dump() + " does not compile (" +
                      u_errorName(status) + " at offset " + std::to_string(error.offset) + ")");
  }
  return compiled;
}

std::string utf8(const icu::UnicodeString& text) {
  std::string out;
  text.toUTF8String(out);
  return out;
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + n.
std::array<UChar32, 256> byte_chars() {
  std::array<UChar32, 256> chars{};
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    chars[b] = printable ? b : 256 + extra++;
  }
  return chars;
}

bool is_word_char(UChar32 c) {
  const auto type = u_charType(c);
  return u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || type == U_DECIMAL_DIGIT_NUMBER || type == U_LETTER_NUMBER ||
         type == U_OTHER_NUMBER;
}

bool is_space(UChar32 c) { return u_hasBinaryProperty(c, UCHAR_WHITE_SPACE); }

std::string nfc_of(const std::string& text) {
  UErrorCode status = U_ZERO_ERROR;
  const auto* normalizer = icu::Normalizer2::getNFCInstance(status);
  icu::UnicodeString normalized;
  if (U_SUCCESS(status)) normalized = normalizer->normalize(icu::UnicodeString::fromUTF8(text), status);
  if (U_FAILURE(status)) throw std::runtime_error(std::string("NFC normalization failed: ") + u_errorName(status));
  return utf8(normalized);
}

const json& member(const json& object, const char* key, const std::string& where) {
  if (!object.is_object() || !object.contains(key)) throw FormatError(where + " lacks '" + key + "'");
  return object.at(key);
}

}  // namespace

struct BpeTokenizer::State {
  std::string source;
  int64_t vocab_size_ = 0;  // the model's
  std::unordered_map<std::string, int64_t> vocab;
  std::unordered_map<int64_t, std::string> tokens;  // id -> token (the model's and the added ones)
  std::map<std::pair<int64_t, int64_t>, std::pair<int64_t, int64_t>> merges;  // pair -> (rank, merged id)
  bool ignore_merges = false;
  std::optional<int64_t> unk;
  std::vector<AddedToken> added;
  std::unordered_set<std::string> special_contents;  // the special added tokens' contents
  bool fuse_unk = false;
  bool nfc = false;
  std::vector<Splitter> splitters;
  bool byte_level = false;  // a ByteLevel pre-tokenizer was read (the last one)
  std::vector<std::vector<int64_t>> template_ids;  // the single template: ids, with an empty entry for $A
  std::array<UChar32, 256> to_char = byte_chars();
  std::unordered_map<UChar32, unsigned char> to_byte;
  std::array<std::string, 256> byte_text;             // each byte's character, UTF-8
  std::array<std::optional<int64_t>, 256> byte_id;    // its vocab id, if it has one

  void read_model(const json& model, int64_t vocab_size);
  void read_added(const json& added, int64_t vocab_size);
  void read_normalizer(const json& normalizer);
  void read_pre_tokenizer(const json& pre, bool nested = false);
  void read_post_processor(const json& post);
  int64_t checked_id(const json& id, const std::string& what, int64_t vocab_size) const;

  std::vector<std::pair<std::optional<int64_t>, std::string>> split_added(const std::string& text, bool normalized) const;
  void encode_piece(const icu::UnicodeString& piece, std::vector<int64_t>& ids) const;
  void encode_text(const std::string& text, std::vector<int64_t>& ids) const;
};

int64_t BpeTokenizer::State::checked_id(const json& id, const std::string& what, int64_t vocab_size) const {
  if (!id.is_number_integer() || id.get<int64_t>() < 0) {
    throw FormatError(source + ": " + what + " must be a non-negative int; got " + id.dump());
  }
  const auto value = id.get<int64_t>();
  if (value >= vocab_size) {
    throw FormatError(source + ": " + what + " = " + std::to_string(value) + " is outside the model's vocabulary 0.." +
                      std::to_string(vocab_size - 1) + " (config.json's vocab_size)");
  }
  return value;
}

void BpeTokenizer::State::read_model(const json& model, int64_t vocab_size) {
  const auto type = member(model, "type", source + ": model").get<std::string>();
  if (type != "BPE") throw FormatError(source + ": model type '" + type + "' is not supported (byte-level BPE only)");
  for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null() && model[key] != "") {
      throw FormatError(source + ": model." + key + " = " + model[key].dump() + " is not supported");
    }
  }
  if (model.value("byte_fallback", false)) throw FormatError(source + ": model.byte_fallback is not supported");
  ignore_merges = model.value("ignore_merges", false);
  for (const auto& [token, id] : member(model, "vocab", source + ": model").items()) {
    vocab[token] = checked_id(id, "vocab['" + token + "']", vocab_size);
    tokens[vocab[token]] = token;
  }
  fuse_unk = model.value("fuse_unk", false);
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    const auto found = vocab.find(model["unk_token"].get<std::string>());
    if (found == vocab.end()) throw FormatError(source + ": model.unk_token is not in the vocab");
    unk = found->second;
  }
  int64_t rank = 0;
  for (const auto& merge : member(model, "merges", source + ": model")) {
    std::string left, right;
    if (merge.is_string()) {
      const auto text = merge.get<std::string>();
      const auto space = text.find(' ', 1);
      if (space == std::string::npos) throw FormatError(source + ": merge " + merge.dump() + " is not 'a b'");
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      throw FormatError(source + ": merge " + merge.dump() + " is neither 'a b' nor [a, b]");
    }
    const auto a = vocab.find(left), b = vocab.find(right), joined = vocab.find(left + right);
    if (a == vocab.end() || b == vocab.end() || joined == vocab.end()) {
      throw FormatError(source + ": merge " + merge.dump() + " names tokens that are not in the vocab");
    }
    // A pair listed twice keeps its last rank, as tokenizers' map of merges does.
    merges.insert_or_assign(std::pair(a->second, b->second), std::pair(rank++, joined->second));
  }
}

// As tokenizers rebuilds them when it reads the file (add_tokens, in order): a content already in the
// vocab (or added) keeps that id; a new one takes the next id after the vocab and the added tokens. The
// file's "id" fields are not read (tokenizers only warns where they differ). Special is by content.
void BpeTokenizer::State::read_added(const json& list, int64_t vocab_size) {
  if (list.is_null()) return;
  if (!list.is_array()) throw FormatError(source + ": added_tokens must be a list");
  const auto flag = [&](const json& entry, const char* key) {
    if (!entry.contains(key)) return false;
    if (!entry[key].is_boolean()) {
      throw FormatError(source + ": added token " + entry.dump() + ": " + key + " must be true or false");
    }
    return entry[key].get<bool>();
  };
  const int64_t model_size = static_cast<int64_t>(vocab.size());
  std::optional<int64_t> max_added;
  for (const auto& entry : list) {
    const auto& content = member(entry, "content", source + ": added token");
    if (!content.is_string() || content.get<std::string>().empty()) {
      throw FormatError(source + ": added token " + entry.dump() + ": content must be a non-empty string");
    }
    AddedToken token{content.get<std::string>(), 0,
                     flag(entry, "lstrip"), flag(entry, "rstrip"), flag(entry, "single_word"),
                     flag(entry, "normalized"), flag(entry, "special")};
    if (std::any_of(added.begin(), added.end(), [&](const AddedToken& t) { return t.content == token.content; })) {
      continue;  // tokenizers adds a content once
    }
    if (const auto found = vocab.find(token.content); found != vocab.end()) {
      token.id = found->second;
    } else {
      token.id = max_added.has_value() && *max_added >= model_size ? *max_added + 1 : model_size;
    }
    checked_id(json(token.id), "added token '" + token.content + "''s id", vocab_size);
    max_added = std::max(max_added.value_or(token.id), token.id);
    tokens[token.id] = token.content;
    if (token.special) special_contents.insert(token.content);
    added.push_back(std::move(token));
  }
}

void BpeTokenizer::State::read_normalizer(const json& normalizer) {
  if (normalizer.is_null()) return;
  const auto type = member(normalizer, "type", source + ": normalizer").get<std::string>();
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    for (const auto& inner : member(normalizer, "normalizers", source + ": normalizer")) read_normalizer(inner);
  } else {
    throw FormatError(source + ": normalizer '" + type + "' is not supported (NFC, or none)");
  }
}

void BpeTokenizer::State::read_pre_tokenizer(const json& pre, bool nested) {
  if (pre.is_null() && !nested) throw FormatError(source + ": a byte-level BPE needs a ByteLevel pre-tokenizer");
  const auto type = member(pre, "type", source + ": pre_tokenizer").get<std::string>();
  if (type == "Sequence") {
    for (const auto& inner : member(pre, "pretokenizers", source + ": pre_tokenizer")) read_pre_tokenizer(inner, true);
  } else if (type == "ByteLevel") {
    if (byte_level) throw FormatError(source + ": two ByteLevel pre-tokenizers");
    byte_level = true;
    Splitter split;
    split.add_prefix_space = pre.value("add_prefix_space", false);
    if (pre.value("use_regex", true)) {
      split.pattern = compile(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", false, source);
    }
    splitters.push_back(std::move(split));
  } else if (type == "Split") {
    // After ByteLevel, a Split would see byte-level characters: not a layout any model uses.
    if (byte_level) throw FormatError(source + ": a Split after the ByteLevel pre-tokenizer is not supported");
    const auto& pattern = member(pre, "pattern", source + ": Split");
    const auto behavior = pre.value("behavior", std::string("Isolated"));
    if (behavior != "Isolated" || pre.value("invert", false)) {
      throw FormatError(source + ": Split with behavior '" + behavior + "'" + (pre.value("invert", false) ? " inverted" : "") +
                        " is not supported (Isolated)");
    }
    Splitter split;
    if (pattern.contains("Regex")) {
      split.pattern = compile(pattern["Regex"].get<std::string>(), false, source);
    } else if (pattern.contains("String")) {
      split.pattern = compile(pattern["String"].get<std::string>(), true, source);
    } else {
      throw FormatError(source + ": Split pattern " + pattern.dump() + " is neither Regex nor String");
    }
    splitters.push_back(std::move(split));
  } else {
    throw FormatError(source + ": pre-tokenizer '" + type + "' is not supported (ByteLevel, Split, Sequence)");
  }
}

void BpeTokenizer::State::read_post_processor(const json& post) {
  if (post.is_null()) return;
  const auto type = member(post, "type", source + ": post_processor").get<std::string>();
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    for (const auto& inner : member(post, "processors", source + ": post_processor")) read_post_processor(inner);
    return;
  }
  if (type != "TemplateProcessing") {
    throw FormatError(source + ": post-processor '" + type + "' is not supported (TemplateProcessing, ByteLevel)");
  }
  if (!template_ids.empty()) throw FormatError(source + ": two TemplateProcessing post-processors");
  const auto& specials = member(post, "special_tokens", source + ": TemplateProcessing");
  const auto& single = member(post, "single", source + ": TemplateProcessing");
  if (!single.is_array()) throw FormatError(source + ": TemplateProcessing.single must be a list");
  for (const auto& piece : single) {
    if (piece.is_object() && piece.contains("Sequence") && piece["Sequence"].value("id", "") == "A") {
      template_ids.emplace_back();  // $A
    } else if (piece.is_object() && piece.contains("SpecialToken")) {
      const auto name = piece["SpecialToken"].value("id", "");
      if (!specials.contains(name) || !specials[name].contains("ids") || !specials[name]["ids"].is_array()) {
        throw FormatError(source + ": template token '" + name + "' has no ids");
      }
      std::vector<int64_t> ids;
      for (const auto& id : specials[name]["ids"]) ids.push_back(checked_id(id, "template token '" + name + "'", vocab_size_));
      template_ids.push_back(std::move(ids));
    } else {
      throw FormatError(source + ": TemplateProcessing piece " + piece.dump() + " is not supported (SpecialToken, $A)");
    }
  }
}

// The text cut at the added tokens (those matched on normalized text, or on the raw text): pieces
// of plain text (no id) and added tokens (their id), as tokenizers' AddedVocabulary splits them:
// leftmost-longest matches, lstrip / rstrip taking the whitespace beside them, single_word only
// between non-word characters.
std::vector<std::pair<std::optional<int64_t>, std::string>> BpeTokenizer::State::split_added(const std::string& text,
                                                                                           bool normalized) const {
  std::vector<std::pair<std::optional<int64_t>, std::string>> out;
  size_t done = 0, at = 0;
  const auto char_before = [&](size_t i) {
    UChar32 c = 0;
    int32_t offset = static_cast<int32_t>(i);
    U8_PREV(reinterpret_cast<const uint8_t*>(text.data()), 0, offset, c);
    return std::pair(c, static_cast<size_t>(offset));
  };
  const auto char_at = [&](size_t i) {
    UChar32 c = 0;
    int32_t offset = static_cast<int32_t>(i);
    U8_NEXT(reinterpret_cast<const uint8_t*>(text.data()), offset, static_cast<int32_t>(text.size()), c);
    return std::pair(c, static_cast<size_t>(offset));
  };
  while (at < text.size()) {
    const AddedToken* best = nullptr;
    for (const auto& token : added) {
      if (token.normalized != normalized) continue;
      if (text.compare(at, token.content.size(), token.content) == 0 &&
          (best == nullptr || token.content.size() > best->content.size())) {
        best = &token;
      }
    }
    size_t start = at, stop = best == nullptr ? at : at + best->content.size();
    if (best == nullptr) {
      at = char_at(at).second;  // the next character: matches start on character boundaries
      continue;
    }
    if (best->single_word) {
      const bool word_before = start > 0 && is_word_char(char_before(start).first);
      const bool word_after = stop < text.size() && is_word_char(char_at(stop).first);
      if (word_before || word_after) {  // skipped whole, as tokenizers' match iterator moves past it
        at = stop;
        continue;
      }
    }
    const size_t match_end = stop;
    if (best->lstrip) {
      while (start > done && is_space(char_before(start).first)) start = char_before(start).second;
    }
    if (best->rstrip) {
      while (stop < text.size() && is_space(char_at(stop).first)) stop = char_at(stop).second;
    }
    if (start > done) out.emplace_back(std::nullopt, text.substr(done, start - done));
    out.emplace_back(best->id, text.substr(start, stop - start));
    // The search goes on from the match's end, inside what rstrip took too (tokenizers' match
    // iterator does not know of it): a token there is still matched.
    done = stop;
    at = match_end;
  }
  if (done < text.size()) out.emplace_back(std::nullopt, text.substr(done));
  return out;
}

void BpeTokenizer::State::encode_piece(const icu::UnicodeString& piece, std::vector<int64_t>& ids) const {
  // The piece's UTF-8 bytes as byte-level characters: their vocab ids, looked up once at load.
  const std::string bytes = utf8(piece);
  if (ignore_merges) {
    std::string mapped;
    for (const unsigned char b : bytes) mapped += byte_text[b];
    const auto whole = vocab.find(mapped);
    if (whole != vocab.end()) {
      ids.push_back(whole->second);
      return;
    }
  }
  std::vector<int64_t> word;
  bool last_unk = false;
  for (const unsigned char b : bytes) {
    if (byte_id[b].has_value()) {
      word.push_back(*byte_id[b]);
      last_unk = false;
    } else if (unk.has_value() && !(fuse_unk && last_unk)) {
      word.push_back(*unk);
      last_unk = true;
    }  // else dropped, as tokenizers drops a character it cannot name
  }
  // The lowest-ranked adjacent pair first (the leftmost among equals), until none merges: a heap of
  // candidate pairs over a linked list of symbols, as tokenizers' merge_all (a long word costs n log n).
  struct Candidate {
    int64_t rank;
    size_t pos;
    bool operator>(const Candidate& other) const { return std::pair(rank, pos) > std::pair(other.rank, other.pos); }
  };
  const size_t n = word.size();
  std::vector<size_t> next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i == 0 ? n : i - 1;  // n: none
  }
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  const auto consider = [&](size_t pos) {
    if (pos >= n || next[pos] >= n) return;
    const auto found = merges.find({word[pos], word[next[pos]]});
    if (found != merges.end()) queue.push({found->second.first, pos});
  };
  for (size_t i = 0; i + 1 < n; ++i) consider(i);
  while (!queue.empty()) {
    const auto top = queue.top();
    queue.pop();
    if (!alive[top.pos] || next[top.pos] >= n) continue;
    const auto found = merges.find({word[top.pos], word[next[top.pos]]});
    if (found == merges.end() || found->second.first != top.rank) continue;  // stale: the pair changed
    const size_t right = next[top.pos];
    word[top.pos] = found->second.second;
    alive[right] = false;
    next[top.pos] = next[right];
    if (next[right] < n) prev[next[right]] = top.pos;
    if (prev[top.pos] < n) consider(prev[top.pos]);
    consider(top.pos);
  }
  for (size_t i = 0; i < n; ++i) {
    if (alive[i]) ids.push_back(word[i]);
  }
}

void BpeTokenizer::State::encode_text(const std::string& raw, std::vector<int64_t>& ids) const {
  const std::string text = nfc ? nfc_of(raw) : raw;
  for (const auto& [id, part] : split_added(text, /*normalized=*/true)) {
    if (id.has_value()) {
      ids.push_back(*id);
      continue;
    }
    std::vector<icu::UnicodeString> pieces{icu::UnicodeString::fromUTF8(part)};
    for (const auto& splitter : splitters) {
      std::vector<icu::UnicodeString> next;
      for (auto& piece : pieces) {
        if (splitter.add_prefix_space && !piece.startsWith(icu::UnicodeString(" "))) piece.insert(0, ' ');
        if (!splitter.pattern) {
          next.push_back(piece);
          continue;
        }
        UErrorCode status = U_ZERO_ERROR;
        std::unique_ptr<icu::RegexMatcher> matcher(splitter.pattern->matcher(piece, status));
        int32_t last = 0;
        while (U_SUCCESS(status) && matcher->find(status)) {
          const int32_t start = matcher->start(status), end = matcher->end(status);
          if (start == end) continue;
          if (start > last) next.emplace_back(piece, last, start - last);  // copies: piece dies with pieces
          next.emplace_back(piece, start, end - start);
          last = end;
        }
        if (U_FAILURE(status)) throw std::runtime_error(std::string("pre-tokenizer regex failed: ") + u_errorName(status));
        if (last < piece.length()) next.emplace_back(piece, last);
      }
      pieces = std::move(next);
    }
    for (const auto& piece : pieces) {
      if (piece.length() > 0) encode_piece(piece, ids);
    }
  }
}

BpeTokenizer::BpeTokenizer(std::unique_ptr<State> state) : state_(std::move(state)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

BpeTokenizer BpeTokenizer::load(const std::filesystem::path& path, int64_t vocab_size) {
  std::ifstream in(path);
  if (!in) throw FormatError(path.string() + " not found");
  std::stringstream text;
  text << in.rdbuf();
  const json values = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  auto state = std::make_unique<State>();
  state->source = path.string();
  state->vocab_size_ = vocab_size;
  if (values.is_discarded() || !values.is_object()) throw FormatError(state->source + ": not a well-formed JSON object");
  try {
    state->read_model(member(values, "model", state->source), vocab_size);
    state->read_added(values.value("added_tokens", json()), vocab_size);
    state->read_normalizer(values.value("normalizer", json()));
    // Normalized tokens match the normalized text: tokenizers keeps their content normalized (it is
    // also what they decode to).
    for (auto& token : state->added) {
      if (!token.normalized || !state->nfc) continue;
      const bool special = state->special_contents.erase(token.content) > 0;
      token.content = nfc_of(token.content);
      state->tokens[token.id] = token.content;
      if (special) state->special_contents.insert(token.content);
    }
    state->read_pre_tokenizer(values.value("pre_tokenizer", json()));
    if (!state->byte_level) throw FormatError(state->source + ": a byte-level BPE needs a ByteLevel pre-tokenizer");
    state->read_post_processor(values.value("post_processor", json()));
    const auto decoder = values.value("decoder", json());
    if (!decoder.is_object() || decoder.value("type", "") != "ByteLevel") {
      throw FormatError(state->source + ": decoder " + decoder.dump() + " is not supported (ByteLevel)");
    }
  } catch (const json::exception& error) {
    throw FormatError(state->source + ": " + error.what());
  }
  for (int b = 0; b < 256; ++b) {
    state->to_byte[state->to_char[b]] = static_cast<unsigned char>(b);
    state->byte_text[b] = utf8(icu::UnicodeString(state->to_char[b]));
    if (const auto found = state->vocab.find(state->byte_text[b]); found != state->vocab.end()) {
      state->byte_id[b] = found->second;
    }
  }
  return BpeTokenizer(std::move(state));
}

std::vector<int64_t> BpeTokenizer::encode(const std::string& text, bool add_special_tokens) const {
  for (int32_t i = 0, n = static_cast<int32_t>(text.size()); i < n;) {
    const int32_t at = i;
    UChar32 c = 0;
    U8_NEXT(reinterpret_cast<const uint8_t*>(text.data()), i, n, c);
    if (c < 0) throw std::invalid_argument("--prompt: not valid UTF-8 at byte " + std::to_string(at) + " of the prompt");
  }
  std::vector<int64_t> body;
  for (const auto& [id, part] : state_->split_added(text, /*normalized=*/false)) {
    if (id.has_value()) {
      body.push_back(*id);
    } else {
      state_->encode_text(part, body);
    }
  }
  if (!add_special_tokens || state_->template_ids.empty()) return body;
  std::vector<int64_t> out;
  for (const auto& piece : state_->template_ids) {
    out.insert(out.end(), piece.empty() ? body.begin() : piece.begin(), piece.empty() ? body.end() : piece.end());
  }
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const auto id : ids) {
    const auto token = state_->tokens.find(id);
    if (token == state_->tokens.end()) continue;  // no token (the model's padding rows): nothing, as tokenizers
    if (skip_special_tokens && state_->special_contents.count(token->second)) continue;
    // Each token's characters back to their bytes; a token with a character outside the byte map
    // (an added token's text) stays as it is.
    const auto chars = icu::UnicodeString::fromUTF8(token->second);
    std::string mapped;
    bool all = true;
    for (int32_t i = 0; i < chars.length() && all;) {
      const UChar32 c = chars.char32At(i);
      const auto byte = state_->to_byte.find(c);
      all = byte != state_->to_byte.end();
      if (all) mapped += static_cast<char>(byte->second);
      i += U16_LENGTH(c);
    }
    bytes += all ? mapped : token->second;
  }
  return utf8_lossy(bytes);
}

std::optional<int64_t> BpeTokenizer::token_id(const std::string& content) const {
  for (const auto& token : state_->added) {
    if (token.content == content) return token.id;
  }
  return std::nullopt;
}

std::string utf8_lossy(const std::string& bytes) {
  std::string out;
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  const int32_t n = static_cast<int32_t>(bytes.size());
  for (int32_t i = 0; i < n;) {
    const int32_t start = i;
    UChar32 c = 0;
    U8_NEXT(data, i, n, c);  // on an ill-formed sequence, i moves past its maximal subpart
    out += c < 0 ? std::string("\xEF\xBF\xBD") : bytes.substr(start, i - start);
  }
  return out;
}

}  // namespace causal_attention
