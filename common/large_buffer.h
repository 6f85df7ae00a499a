// LargeBufferAllocator: for big, long-lived arrays whose memory must leave
// the process when they are freed, whichever thread allocated them.
//
// Blocks of at least kLargeBufferBytes come straight from mmap and go back
// with munmap; smaller ones use operator new. Why not malloc: glibc keeps
// freed memory at the top of a thread's arena while it is below the arena's
// (dynamic) trim threshold, and malloc_trim does not trim the tops of
// non-main arenas, so tables built or parsed on pool threads stayed resident
// after their last user was gone (the csa index of a context, loaded on
// ThreadPool::Default() by service::LoadContextIndex).
//
// Thread-safety: stateless; any thread may allocate and free.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <new>
#include <vector>

namespace ctxcache {

inline constexpr size_t kLargeBufferBytes = size_t{1} << 20;

template <typename T>
struct LargeBufferAllocator {
  using value_type = T;
  LargeBufferAllocator() noexcept = default;
  template <typename U>
  LargeBufferAllocator(const LargeBufferAllocator<U>&) noexcept {}  // NOLINT: rebind

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes >= kLargeBufferBytes) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      return static_cast<T*>(p);
    }
    return static_cast<T*>(::operator new(bytes));
  }
  void deallocate(T* p, size_t n) noexcept {
    const size_t bytes = n * sizeof(T);
    if (bytes >= kLargeBufferBytes) {
      munmap(p, bytes);
    } else {
      ::operator delete(p);
    }
  }
  friend bool operator==(const LargeBufferAllocator&, const LargeBufferAllocator&) { return true; }
};

template <typename T>
using LargeVector = std::vector<T, LargeBufferAllocator<T>>;

// MappedBytes: an uninitialized block of bytes straight from mmap, returned
// with munmap, with transparent huge pages advised (MADV_HUGEPAGE) where the
// kernel allows them: a buffer of GiBs that is written once, in order (an
// ingest's K and V), then takes one page fault per 2 MiB instead of per
// 4 KiB, and no zero fill beyond the kernel's. Move-only.
class MappedBytes {
 public:
  MappedBytes() = default;
  // Throws std::bad_alloc when mmap fails. 0 bytes: empty, no mapping.
  explicit MappedBytes(size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);  // advice only: ignored where THP is off
#endif
    data_ = static_cast<unsigned char*>(p);
  }
  ~MappedBytes() { Reset(); }
  MappedBytes(MappedBytes&& o) noexcept : data_(o.data_), size_(o.size_) {
    o.data_ = nullptr;
    o.size_ = 0;
  }
  MappedBytes& operator=(MappedBytes&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = o.data_;
      size_ = o.size_;
      o.data_ = nullptr;
      o.size_ = 0;
    }
    return *this;
  }
  MappedBytes(const MappedBytes&) = delete;
  MappedBytes& operator=(const MappedBytes&) = delete;

  unsigned char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void Reset() {
    if (data_ != nullptr) munmap(data_, size_);
    data_ = nullptr;
    size_ = 0;
  }
  unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ctxcache
