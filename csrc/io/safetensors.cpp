#include "causal_attention/safetensors.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <fstream>
#include <sstream>

namespace causal_attention {

static_assert(std::endian::native == std::endian::little, "the safetensors reader assumes a little-endian host");

namespace {

using nlohmann::json;

constexpr std::array<std::pair<const char*, at::ScalarType>, 10> kDtypes{{
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
    {"I64", at::kLong}, {"I32", at::kInt}, {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte}, {"BOOL", at::kBool},
}};

template <typename... Args>
[[noreturn]] void fail(const std::filesystem::path& path, const Args&... parts) {
  std::ostringstream message;
  message << path.string() << ": ";
  (message << ... << parts);
  throw FormatError(message.str());
}

uint64_t checked_u64(const json& value, const std::filesystem::path& path, const std::string& name, const char* what) {
  if (!value.is_number_unsigned()) {
    fail(path, "tensor '", name, "': ", what, " must be non-negative integers; got ", value.dump());
  }
  return value.get<uint64_t>();
}

SafetensorsEntry parse_entry(const json& value, const std::filesystem::path& path, const std::string& name,
                             uint64_t data_bytes) {
  if (!value.is_object()) fail(path, "tensor '", name, "': header entry must be an object; got ", value.dump());
  for (const auto& [key, _] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      fail(path, "tensor '", name, "': unknown header field '", key, "'");
    }
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(key)) fail(path, "tensor '", name, "': header entry lacks '", key, "'");
  }
  SafetensorsEntry entry{};
  const auto& dtype = value.at("dtype");
  const auto found = std::find_if(kDtypes.begin(), kDtypes.end(), [&](const auto& d) {
    return dtype.is_string() && dtype.get<std::string>() == d.first;
  });
  if (found == kDtypes.end()) fail(path, "tensor '", name, "': unsupported dtype ", dtype.dump());
  entry.dtype = found->second;

  const auto& shape = value.at("shape");
  if (!shape.is_array()) fail(path, "tensor '", name, "': shape must be a list; got ", shape.dump());
  uint64_t bytes = c10::elementSize(entry.dtype);
  for (const auto& size : shape) {
    const uint64_t n = checked_u64(size, path, name, "shape entries");
    if (n > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(bytes, n, &bytes)) {
      fail(path, "tensor '", name, "': shape ", shape.dump(), " is too large");
    }
    entry.shape.push_back(static_cast<int64_t>(n));
  }

  const auto& offsets = value.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2) {
    fail(path, "tensor '", name, "': data_offsets must be [begin, end]; got ", offsets.dump());
  }
  entry.begin = checked_u64(offsets[0], path, name, "data_offsets");
  entry.end = checked_u64(offsets[1], path, name, "data_offsets");
  if (entry.begin > entry.end || entry.end > data_bytes) {
    fail(path, "tensor '", name, "': data_offsets [", entry.begin, ", ", entry.end,
         "] are outside the data section (", data_bytes, " bytes)");
  }
  if (entry.end - entry.begin != bytes) {
    fail(path, "tensor '", name, "': data_offsets [", entry.begin, ", ", entry.end, "] hold ", entry.end - entry.begin,
         " bytes but dtype ", dtype.get<std::string>(), " x shape ", shape.dump(), " needs ", bytes);
  }
  return entry;
}

}  // namespace

std::string safetensors_dtype_name(at::ScalarType dtype) {
  for (const auto& [name, type] : kDtypes) {
    if (type == dtype) return name;
  }
  throw FormatError(std::string("safetensors has no dtype for ") + c10::toString(dtype));
}

SafetensorsFile::SafetensorsFile(std::filesystem::path path) : path_(std::move(path)) {
  std::error_code error;
  const uint64_t file_bytes = std::filesystem::file_size(path_, error);
  if (error) fail(path_, "cannot read the file (", error.message(), ")");
  std::ifstream in(path_, std::ios::binary);
  if (!in) fail(path_, "cannot open the file");
  if (file_bytes < 8) fail(path_, "the file is ", file_bytes, " bytes, too short for the 8-byte header size");

  std::array<unsigned char, 8> size_bytes{};
  in.read(reinterpret_cast<char*>(size_bytes.data()), 8);
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | size_bytes[i];
  if (header_bytes > kMaxHeaderBytes) {
    fail(path_, "header size ", header_bytes, " bytes is above the limit of ", kMaxHeaderBytes);
  }
  if (header_bytes > file_bytes - 8) {
    fail(path_, "header size ", header_bytes, " bytes runs past the end of the file (", file_bytes,
         " bytes): truncated or corrupt");
  }
  std::string header(header_bytes, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_bytes));
  if (!in) fail(path_, "could not read the ", header_bytes, "-byte header");
  data_start_ = 8 + header_bytes;
  const uint64_t data_bytes = file_bytes - data_start_;

  const json parsed = json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) fail(path_, "the header is not well-formed JSON");
  if (!parsed.is_object()) fail(path_, "the header must be a JSON object; got ", parsed.type_name());
  for (const auto& [name, value] : parsed.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) fail(path_, "__metadata__ must be an object of strings");
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) fail(path_, "__metadata__ value for '", key, "' must be a string; got ", text.dump());
        metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    entries_.emplace(name, parse_entry(value, path_, name, data_bytes));
  }

  // The data section is the tensors back to back: no holes, no overlaps, nothing after the last.
  std::vector<std::pair<std::string, const SafetensorsEntry*>> by_offset;
  for (const auto& [name, entry] : entries_) by_offset.emplace_back(name, &entry);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto& a, const auto& b) {
    return std::pair(a.second->begin, a.second->end) < std::pair(b.second->begin, b.second->end);
  });
  uint64_t expected = 0;
  for (const auto& [name, entry] : by_offset) {
    if (entry->begin != expected) {
      fail(path_, "tensor '", name, "': data_offsets begin at ", entry->begin, " but the previous tensor ends at ",
           expected, " (overlapping or not packed)");
    }
    expected = entry->end;
  }
  if (expected != data_bytes) {
    fail(path_, "the tensors end at byte ", expected, " of the data section but it holds ", data_bytes,
         " bytes (truncated, or unexplained bytes)");
  }
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  const auto found = entries_.find(name);
  if (found == entries_.end()) fail(path_, "no tensor '", name, "'");
  return found->second;
}

at::Tensor SafetensorsFile::read(const std::string& name) const {
  const auto& stored = entry(name);
  auto tensor = at::empty(stored.shape, at::TensorOptions().dtype(stored.dtype));
  read_into(name, tensor);
  return tensor;
}

void SafetensorsFile::read_into(const std::string& name, const at::Tensor& out) const {
  const auto& stored = entry(name);
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == stored.dtype &&
                        out.sizes() == at::IntArrayRef(stored.shape),
                    "SafetensorsFile::read_into: out must be a contiguous CPU tensor of tensor '", name, "''s dtype ",
                    stored.dtype, " and shape ", at::IntArrayRef(stored.shape), "; got ", out.scalar_type(), " of shape ",
                    out.sizes());
  const auto bytes = static_cast<int64_t>(stored.end - stored.begin);
  // A large tensor in ranges on torch's threads: reading into fresh memory faults its pages in, and the
  // kernel zeroes each page on the thread that faults it (most of a loaded model's start-up).
  constexpr int64_t kRangeBytes = int64_t{8} << 20;
  char* data = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, bytes, kRangeBytes, [&](int64_t begin, int64_t end) {
    std::ifstream in(path_, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(data_start_ + stored.begin + static_cast<uint64_t>(begin)));
    in.read(data + begin, static_cast<std::streamsize>(end - begin));
    if (!in || in.gcount() != end - begin) fail(path_, "tensor '", name, "': could not read its bytes");
  });
}

void save_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK_VALUE(tensor.device().is_cpu(), "save_safetensors: tensor '", name, "' must be on the CPU");
    TORCH_CHECK_VALUE(!header.contains(name), "save_safetensors: tensor name '", name, "' appears twice");
    const auto contiguous = tensor.contiguous();
    const uint64_t bytes = contiguous.nbytes();
    header[name] = {{"dtype", safetensors_dtype_name(tensor.scalar_type())},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(contiguous);
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');  // the data starts 8-byte aligned, as the library writes
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw FormatError(path.string() + ": cannot open for writing");
  std::array<char, 8> size_bytes{};
  for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  out.write(size_bytes.data(), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& tensor : data) {
    out.write(static_cast<const char*>(tensor.const_data_ptr()), static_cast<std::streamsize>(tensor.nbytes()));
  }
  if (!out) throw FormatError(path.string() + ": write failed");
}

}  // namespace causal_attention
