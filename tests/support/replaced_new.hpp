// Test helper: replaces the global allocation functions of the program that includes it (include
// it in exactly one translation unit) with malloc-based ones that first call
// gradavg_test::on_allocation(), which that unit defines: to count allocations, or to make one
// fail by throwing std::bad_alloc.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

namespace gradavg_test {

/// Called at the start of every replaced operator new, on whichever thread allocates.
void on_allocation();

namespace replaced_new_detail {

inline void* allocate(std::size_t n, std::size_t alignment) {
  on_allocation();
  if (n == 0) n = 1;
  void* p = alignment <= alignof(std::max_align_t)
                ? std::malloc(n)
                : std::aligned_alloc(alignment, (n + alignment - 1) / alignment * alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

/// Out of line, so the compiler does not pair an inlined free() with operator new and warn.
[[gnu::noinline]] inline void release(void* p) noexcept { std::free(p); }

}  // namespace replaced_new_detail
}  // namespace gradavg_test

void* operator new(std::size_t n) { return gradavg_test::replaced_new_detail::allocate(n, 0); }
void* operator new[](std::size_t n) { return gradavg_test::replaced_new_detail::allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return gradavg_test::replaced_new_detail::allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return gradavg_test::replaced_new_detail::allocate(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return gradavg_test::replaced_new_detail::allocate(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p) noexcept { gradavg_test::replaced_new_detail::release(p); }
void operator delete[](void* p) noexcept { gradavg_test::replaced_new_detail::release(p); }
void operator delete(void* p, std::size_t) noexcept { gradavg_test::replaced_new_detail::release(p); }
void operator delete[](void* p, std::size_t) noexcept { gradavg_test::replaced_new_detail::release(p); }
void operator delete(void* p, std::align_val_t) noexcept { gradavg_test::replaced_new_detail::release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { gradavg_test::replaced_new_detail::release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  gradavg_test::replaced_new_detail::release(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  gradavg_test::replaced_new_detail::release(p);
}
