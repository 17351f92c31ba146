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
//   read_fold read-only, several ranges side by side (one 64-byte line of each per step, as
//             gradavg reads its towers), folded with xor: the time an average spends reading
//             its inputs when writing its output costs nothing
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
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

/// The xor of the 8-byte words at offsets [begin, end) of every range in `ranges` (begin a
/// multiple of 8; a last partial word is zero-padded), read side by side: one 64-byte line of
/// each range per step, with the widest integer vector the compiler enables. The xor keeps every
/// load; the result does not depend on the vector width or the ranges' order, so that a scalar
/// loop over the same words checks it.
inline std::uint64_t read_fold(std::span<const std::byte* const> ranges, std::size_t begin, std::size_t end) {
  std::uint64_t fold = 0;
  std::size_t i = begin;
#if defined(__AVX512F__)
  __m512i acc = _mm512_setzero_si512();
  for (; i + 64 <= end; i += 64)
    for (const std::byte* r : ranges) acc = _mm512_xor_si512(acc, _mm512_loadu_si512(r + i));
  alignas(64) std::uint64_t lanes[8];
  _mm512_store_si512(lanes, acc);
#elif defined(__AVX2__)
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  for (; i + 64 <= end; i += 64)
    for (const std::byte* r : ranges) {
      acc0 = _mm256_xor_si256(acc0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i)));
      acc1 = _mm256_xor_si256(acc1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i + 32)));
    }
  alignas(32) std::uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(acc0, acc1));
#elif defined(__SSE2__)
  __m128i acc0 = _mm_setzero_si128(), acc1 = _mm_setzero_si128();
  for (; i + 64 <= end; i += 64)
    for (const std::byte* r : ranges)
      for (std::size_t u = 0; u < 64; u += 32) {
        acc0 = _mm_xor_si128(acc0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i + u)));
        acc1 = _mm_xor_si128(acc1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i + u + 16)));
      }
  alignas(16) std::uint64_t lanes[2];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), _mm_xor_si128(acc0, acc1));
#else
  std::uint64_t lanes[1] = {0};
#endif
  for (std::uint64_t lane : lanes) fold ^= lane;
  for (; i < end; i += 8)
    for (const std::byte* r : ranges) {
      std::uint64_t word = 0;
      std::memcpy(&word, r + i, std::min<std::size_t>(8, end - i));
      fold ^= word;
    }
  return fold;
}

/// A copy limit by name: one of copy, copy_nt, memcpy.
template <class S>
struct named_copy {
  const char* name;
  void (*fn)(S* dst, const S* src, std::size_t n);
};

}  // namespace gradavg_bench::limits
