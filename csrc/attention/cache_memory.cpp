// KV cache buffers on transparent huge pages (see cache_zeros in attention.h).
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "causal_attention/attention.h"

namespace causal_attention::kernels {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;  // the x86-64 transparent huge page

#if defined(__linux__)
// A mapping of our own (mmap), so that its pages are fresh: memory from malloc may have been touched
// before, on 4 KB pages that the advice does not replace.
struct Mapping {
  void* base;
  size_t bytes;
};

void unmap(void* ctx) {
  const std::unique_ptr<Mapping> mapping(static_cast<Mapping*>(ctx));
  munmap(mapping->base, mapping->bytes);
}

at::DataPtr map_huge(size_t n) {
  const size_t bytes = (n + kHugePage - 1) / kHugePage * kHugePage;
  // A huge page more than asked, then the ends trimmed: what is left starts at a 2 MB boundary.
  void* raw = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "KV cache: could not map ", n, " bytes (", std::strerror(errno), ")");
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) & ~(uintptr_t{kHugePage} - 1);
  if (aligned > start) {
    munmap(raw, aligned - start);
  }
  if (const size_t tail = start + bytes + kHugePage - (aligned + bytes); tail > 0) {
    munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  }
  void* p = reinterpret_cast<void*>(aligned);
#if defined(MADV_HUGEPAGE)
  madvise(p, bytes, MADV_HUGEPAGE);  // a hint: where it fails the pages stay small
#endif
  auto mapping = std::make_unique<Mapping>(Mapping{p, bytes});
  return {p, mapping.release(), &unmap, at::Device(at::kCPU)};
}
#endif

void release(void* p) { std::free(p); }

// CPU memory in whole huge pages, fresh and advised to take them (madvise MADV_HUGEPAGE): with the
// kernel's transparent huge pages in "madvise" mode (the common default) the pages are 2 MB where
// torch's allocator leaves them 4 KB; in "always" mode they would be huge anyway, in "never" they
// stay 4 KB (the advice fails quietly). Elsewhere than Linux, memory aligned to 2 MB. Stateless:
// one instance serves every cache, and a storage that grows (resize_) asks it again.
class HugePageAllocator final : public at::Allocator {
 public:
  at::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return {nullptr, nullptr, &release, at::Device(at::kCPU)};
    }
#if defined(__linux__)
    return map_huge(n);
#else
    void* p = std::aligned_alloc(kHugePage, (n + kHugePage - 1) / kHugePage * kHugePage);
    TORCH_CHECK(p != nullptr, "KV cache: could not allocate ", n, " bytes");
    return {p, p, &release, at::Device(at::kCPU)};
#endif
  }
  at::DeleterFnPtr raw_deleter() const override { return nullptr; }  // the deleter needs its context
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

}  // namespace

at::Tensor cache_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  for (const int64_t s : sizes) {
    TORCH_CHECK_VALUE(s >= 0, "cache_zeros: sizes must be non-negative; got ", sizes);
  }
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  // Below a huge page the advice has nothing to act on: torch's own allocation.
  if (c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype)) <
      static_cast<int64_t>(kHugePage)) {
    return at::zeros(sizes, options);
  }
  static HugePageAllocator allocator;  // stateless (see above)
  at::Tensor out = at::detail::empty_generic(sizes, &allocator, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                             std::nullopt);
  return out.zero_();  // the first touch: the pages are made here, huge where the advice took
}

}  // namespace causal_attention::kernels
