// A small, strict reader (and a writer) for the safetensors format: an 8-byte little-endian header
// size N, N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {str: str}}, then the data, offsets relative to its start.
//
//   causal_attention::SafetensorsFile file("model.safetensors");  // the header, validated
//   at::Tensor w = file.read("tok.weight");                        // one tensor, read from disk
//
// Every violation is a causal_attention::FormatError whose message names the file and, where there
// is one, the tensor: header size beyond the file or above 100 MB, JSON not well-formed, an
// unknown dtype, a negative shape, a byte range that does not hold dtype x shape, offsets outside
// the data or not packed back to back (holes, overlaps, bytes after the last tensor).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace causal_attention {

// A file that does not hold what it should (a corrupt safetensors file, a config or checkpoint
// that does not match the model). The message names the file and the tensor or option.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct SafetensorsEntry {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  static constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // as the safetensors library

  explicit SafetensorsFile(std::filesystem::path path);

  const std::filesystem::path& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }

  // The entry of tensor `name` (a FormatError naming it where the file has none).
  const SafetensorsEntry& entry(const std::string& name) const;
  // The tensor, read from the file (a fresh CPU tensor of the stored dtype and shape).
  at::Tensor read(const std::string& name) const;
  // The tensor read into out: a contiguous CPU tensor of its dtype and shape (a row slice of a
  // larger one, say), with no copy in between.
  void read_into(const std::string& name, const at::Tensor& out) const;

 private:
  std::filesystem::path path_;
  uint64_t data_start_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// The safetensors name of a dtype ("F32", ...); a FormatError for dtypes the format lacks.
std::string safetensors_dtype_name(at::ScalarType dtype);

// Writes tensors (CPU; any layout, written contiguous) in the given order, with string metadata.
void save_safetensors(const std::filesystem::path& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace causal_attention
