// The bandwidth limits' kernels over one contiguous range: what the memory system gives a
// trivially simple loop. The benchmarks run them per chunk on a chunk_pool (parallel.hpp).
//
//   copy      dst = src through Eigen's packet loop: ordinary stores (each written line is
//             first read for ownership)
//   copy_nt   dst = src with non-temporal (streaming) stores and an sfence: no read for
//             ownership, the written lines bypass the caches
//   memcpy    the C library's copy (glibc switches to non-temporal stores above a size it
//             derives from the cache sizes)
//   sum       read-only reduction, Eigen's vectorised redux
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <Eigen/Core>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace gradavg_bench::limits {

template <class S>
using vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;

/// dst[0, n) = src[0, n) with Eigen's packet loop (ordinary stores).
template <class S>
void copy(S* dst, const S* src, std::size_t n) {
  const auto len = static_cast<Eigen::Index>(n);
  Eigen::Map<vec<S>>(dst, len) = Eigen::Map<const vec<S>>(src, len);
}

/// The widest non-temporal store the compiler enables for S ("none" without SSE2).
template <class S>
constexpr const char* streaming_store_name() {
#if defined(__AVX512F__)
  return std::is_same_v<S, float> ? "_mm512_stream_ps" : "_mm512_stream_pd";
#elif defined(__AVX__)
  return std::is_same_v<S, float> ? "_mm256_stream_ps" : "_mm256_stream_pd";
#elif defined(__SSE2__)
  return std::is_same_v<S, float> ? "_mm_stream_ps" : "_mm_stream_pd";
#else
  return "none (ordinary stores)";
#endif
}

/// dst[0, n) = src[0, n) with non-temporal stores of the widest vector the compiler enables
/// (AVX-512, AVX or SSE2), one 64-byte line per step; scalar stores up to dst's vector alignment
/// and for the tail; then an sfence, since streaming stores are weakly ordered. Without SSE2:
/// ordinary stores.
template <class S>
void copy_nt(S* dst, const S* src, std::size_t n) {
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>);
  std::size_t i = 0;
#if defined(__SSE2__)
#if defined(__AVX512F__)
  constexpr std::size_t vector_bytes = 64;
#elif defined(__AVX__)
  constexpr std::size_t vector_bytes = 32;
#else
  constexpr std::size_t vector_bytes = 16;
#endif
  constexpr std::size_t W = vector_bytes / sizeof(S);  // elements per vector
  constexpr std::size_t L = 64 / sizeof(S);            // elements per cache line
  for (; i < n && reinterpret_cast<std::uintptr_t>(dst + i) % vector_bytes != 0; ++i) dst[i] = src[i];
  for (; i + L <= n; i += L) {
    for (std::size_t u = 0; u < L; u += W) {
      S* d = dst + i + u;
      const S* s = src + i + u;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<S, float>) _mm512_stream_ps(d, _mm512_loadu_ps(s));
      else _mm512_stream_pd(d, _mm512_loadu_pd(s));
#elif defined(__AVX__)
      if constexpr (std::is_same_v<S, float>) _mm256_stream_ps(d, _mm256_loadu_ps(s));
      else _mm256_stream_pd(d, _mm256_loadu_pd(s));
#else
      if constexpr (std::is_same_v<S, float>) _mm_stream_ps(d, _mm_loadu_ps(s));
      else _mm_stream_pd(d, _mm_loadu_pd(s));
#endif
    }
  }
#endif
  for (; i < n; ++i) dst[i] = src[i];
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/// dst[0, n) = src[0, n) with the C library's memcpy.
template <class S>
void memcpy(S* dst, const S* src, std::size_t n) {
  std::memcpy(dst, src, n * sizeof(S));
}

/// The sum of src[0, n) with Eigen's vectorised redux.
template <class S>
S sum(const S* src, std::size_t n) {
  return Eigen::Map<const vec<S>>(src, static_cast<Eigen::Index>(n)).sum();
}

/// A copy limit by name: one of copy, copy_nt, memcpy.
template <class S>
struct named_copy {
  const char* name;
  void (*fn)(S* dst, const S* src, std::size_t n);
};

}  // namespace gradavg_bench::limits
