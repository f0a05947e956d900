// KV cache buffers on transparent huge pages, and weights moved onto them in place (see cache_zeros
// and advise_huge_pages in attention.h).
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "causal_attention/attention.h"

namespace causal_attention::kernels {
namespace {

constexpr size_t kDefaultHugePage = size_t{2} << 20;  // x86-64's (and arm64's with 4 KB pages)

// The transparent huge page size the kernel reports (hpage_pmd_size), else 2 MB.
size_t huge_page_bytes() {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
  unsigned long long bytes = 0;
  if (file >> bytes && bytes >= 4096 && (bytes & (bytes - 1)) == 0) {
    return static_cast<size_t>(bytes);
  }
  return kDefaultHugePage;
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

#if defined(__linux__)
// Whether the administrator turned transparent huge pages off (the mode "never"): then nothing is
// moved onto them (MADV_COLLAPSE would, whatever the mode).
bool thp_never() {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  const std::string modes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return modes.find("[never]") != std::string::npos;
}

// Whether every small page of [address, address + bytes) is present and mapped by this process
// alone (/proc/self/pagemap: bit 63 present, bit 56 exclusively mapped; Linux 4.2 and later).
bool mapped_here_alone(uintptr_t address, size_t bytes) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const struct File {
    int fd;
    ~File() {
      if (fd >= 0) {
        close(fd);
      }
    }
  } pagemap{open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC)};
  std::vector<uint64_t> entries(bytes / page);
  const auto want = static_cast<ssize_t>(entries.size() * sizeof(uint64_t));
  if (pagemap.fd < 0 ||
      pread(pagemap.fd, entries.data(), static_cast<size_t>(want), static_cast<off_t>(address / page * sizeof(uint64_t))) != want) {
    return false;
  }
  constexpr uint64_t kPresent = uint64_t{1} << 63, kExclusive = uint64_t{1} << 56;
  return std::all_of(entries.begin(), entries.end(),
                     [&](uint64_t entry) { return (entry & kPresent) != 0 && (entry & kExclusive) != 0; });
}
#endif

void release(void* p) { std::free(p); }

#if defined(__linux__)
// A mapping of our own (mmap), so that its pages are fresh: memory from malloc may have been touched
// before, on small pages that the advice does not replace.
struct Mapping {
  void* base;
  size_t bytes;
};

void unmap(void* ctx) {
  const std::unique_ptr<Mapping> mapping(static_cast<Mapping*>(ctx));
  munmap(mapping->base, mapping->bytes);
}

// n bytes from a huge-page boundary; the whole huge pages among them advised to be huge (the tail,
// less than one, stays on small pages: advised, it would take a whole huge page of memory).
at::DataPtr map_huge(size_t n, size_t huge) {
  const size_t bytes = round_up(n, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  // A huge page more than asked, then the ends trimmed: what is left starts at a huge-page boundary.
  void* raw = mmap(nullptr, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "could not map ", n, " bytes for huge pages (", std::strerror(errno), ")");
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + huge - 1) & ~(uintptr_t{huge} - 1);
  if (aligned > start) {
    munmap(raw, aligned - start);
  }
  if (const size_t tail = start + bytes + huge - (aligned + bytes); tail > 0) {
    munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  }
  void* p = reinterpret_cast<void*>(aligned);
#if defined(MADV_HUGEPAGE)
  madvise(p, n / huge * huge, MADV_HUGEPAGE);  // a hint: where it fails the pages stay small
#endif
  auto mapping = std::make_unique<Mapping>(Mapping{p, bytes});
  return {p, mapping.release(), &unmap, at::Device(at::kCPU)};
}
#endif

// CPU memory from a huge-page boundary, fresh, its whole huge pages advised to be huge (madvise
// MADV_HUGEPAGE): with the kernel's transparent huge pages in "madvise" mode (the common default)
// the pages are huge where torch's allocator leaves them small; in "always" mode they would be huge
// anyway, in "never" they stay small (the advice fails quietly). Elsewhere than Linux, memory
// aligned to 2 MB. Stateless: one instance serves every cache, and a storage that grows (resize_)
// asks it again.
class HugePageAllocator final : public at::Allocator {
 public:
  at::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return {nullptr, nullptr, &release, at::Device(at::kCPU)};
    }
#if defined(__linux__)
    return map_huge(n, huge_page_bytes());
#else
    void* p = std::aligned_alloc(kDefaultHugePage, round_up(n, kDefaultHugePage));
    TORCH_CHECK(p != nullptr, "could not allocate ", n, " bytes for huge pages");
    return {p, p, &release, at::Device(at::kCPU)};
#endif
  }
  at::DeleterFnPtr raw_deleter() const override { return nullptr; }  // the deleter needs its context
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

// huge_page_empty's memory; errors name caller.
at::Tensor empty_on_huge_pages(at::IntArrayRef size, at::ScalarType dtype, const char* caller) {
  for (const int64_t s : size) {
    TORCH_CHECK_VALUE(s >= 0, caller, ": size must be non-negative; got ", size);
  }
  uint64_t numel = 0;
  uint64_t bytes = 0;
  TORCH_CHECK_VALUE(!c10::safe_multiplies_u64(size, &numel) &&
                        !c10::mul_overflows(numel, static_cast<uint64_t>(c10::elementSize(dtype)), &bytes),
                    caller, ": size ", size, " of ", dtype, " overflows a byte count");
  // Below a huge page the advice has nothing to act on: torch's own allocation.
  if (bytes < huge_page_bytes()) {
    return at::empty(size, at::TensorOptions().dtype(dtype).device(at::kCPU));
  }
  static HugePageAllocator allocator;  // stateless (see above)
  return at::detail::empty_generic(size, &allocator, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, std::nullopt);
}

}  // namespace

at::Tensor huge_page_empty(at::IntArrayRef size, at::ScalarType dtype) {
  return empty_on_huge_pages(size, dtype, "huge_page_empty");
}

at::Tensor cache_zeros(at::IntArrayRef size, at::ScalarType dtype, std::optional<at::Device> device) {
  if (device.has_value() && !device->is_cpu()) {
    return at::zeros(size, at::TensorOptions().dtype(dtype).device(*device));
  }
  // The first touch: the pages are made here, huge where the advice took.
  return empty_on_huge_pages(size, dtype, "cache_zeros").zero_();
}

int64_t advise_huge_pages(const at::Tensor& tensor) {
  TORCH_CHECK_VALUE(tensor.defined(), "advise_huge_pages: tensor must be defined");
  TORCH_CHECK_VALUE(tensor.device().is_cpu(), "advise_huge_pages: tensor must be on the CPU; got one on ",
                    tensor.device());
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // A strided tensor's own storage only (a sparse or MKLDNN tensor has none to advise).
  if (!tensor.has_storage() || tensor.layout() != at::kStrided) {
    return 0;
  }
  const at::Storage& storage = tensor.storage();
  const auto first = reinterpret_cast<uintptr_t>(storage.data());
  const size_t huge = huge_page_bytes();
  if (first == 0 || storage.nbytes() < huge || thp_never()) {
    return 0;
  }
  // The whole huge pages inside the storage's bytes: its neighbours' memory is never advised.
  const uintptr_t begin = (first + huge - 1) & ~(uintptr_t{huge} - 1);
  const uintptr_t end = (first + storage.nbytes()) & ~(uintptr_t{huge} - 1);
  if (end <= begin || madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) != 0) {
    return 0;  // a hint: a kernel without transparent huge pages refuses it, and the pages stay small
  }
#if defined(MADV_COLLAPSE)
  constexpr int kCollapse = MADV_COLLAPSE;
#else
  constexpr int kCollapse = 25;  // Linux 6.1's MADV_COLLAPSE; older headers lack it, older kernels refuse it
#endif
  // The pages already there (the advice acts on pages made after it) copied onto huge pages now, one
  // huge page at a time, the values unchanged; where the kernel cannot (an older kernel, no huge
  // page free), as they were. Not pages this process shares copy-on-write (a fork's): the collapse
  // would copy them into memory of this process's own.
  int64_t moved = 0;
  for (uintptr_t page = begin; page < end; page += huge) {
    if (mapped_here_alone(page, huge) && madvise(reinterpret_cast<void*>(page), huge, kCollapse) == 0) {
      moved += static_cast<int64_t>(huge);
    }
  }
  return moved;
#else
  return 0;
#endif
}

}  // namespace causal_attention::kernels
