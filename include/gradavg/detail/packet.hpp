// gradavg internals: the SIMD operations the kernel uses, and the only place gradavg touches
// Eigen's internal packet API (Eigen::internal::packet_traits, unpacket_traits, ploadu, pstoreu,
// pset1, padd, pmul, pmadd, pdiv, pcmp_eq, pselect) or compiler intrinsics (non-temporal
// stores, sfence). A change in Eigen's internals is a fix in this file alone. Checked with
// Eigen 3.4 and 5.0.
#pragma once

#include <Eigen/Core>

#if defined(EIGEN_VECTORIZE_SSE2) || defined(EIGEN_VECTORIZE_AVX) || defined(EIGEN_VECTORIZE_AVX512)
#include <immintrin.h>
#endif

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "isa.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// Packets of T (float or double) as Eigen vectorizes them in this translation unit; a scalar
/// T itself where Eigen does not vectorize.
template <class T>
struct packet_ops {
  using type = typename Eigen::internal::packet_traits<T>::type;
  static constexpr std::size_t width = static_cast<std::size_t>(Eigen::internal::unpacket_traits<type>::size);
  static constexpr std::size_t bytes = sizeof(type);

  static type load(const T* p) noexcept { return Eigen::internal::ploadu<type>(p); }
  static void store(T* p, const type& v) noexcept { Eigen::internal::pstoreu(p, v); }
  static type broadcast(T x) noexcept { return Eigen::internal::pset1<type>(x); }
  static type add(const type& a, const type& b) noexcept { return Eigen::internal::padd(a, b); }
  static type mul(const type& a, const type& b) noexcept { return Eigen::internal::pmul(a, b); }
  /// a * b + c, fused or not as Eigen's pmadd is on this target; every element of every tower
  /// goes through this same operation, so results never depend on an element's position.
  static type mul_add(const type& a, const type& b, const type& c) noexcept { return Eigen::internal::pmadd(a, b, c); }
  static type div(const type& a, const type& b) noexcept { return Eigen::internal::pdiv(a, b); }

  /// v with every NaN lane replaced by the default quiet NaN: which NaN operand an addition
  /// propagates depends on instruction operand order, which compilers may swap.
  static type canonical_nan(const type& v) noexcept {
    return Eigen::internal::pselect(Eigen::internal::pcmp_eq(v, v), v,
                                    broadcast(std::numeric_limits<T>::quiet_NaN()));
  }

  /// Stores v at p with a non-temporal store where the target has one and p is aligned to a
  /// packet; otherwise an ordinary store.
  static void stream(T* p, const type& v) noexcept {
    if (reinterpret_cast<std::uintptr_t>(p) % bytes == 0) {
#if defined(EIGEN_VECTORIZE_AVX512)
      if constexpr (bytes == 64) {
        if constexpr (std::is_same_v<T, float>) return _mm512_stream_ps(p, v);
        else return _mm512_stream_pd(p, v);
      }
#endif
#if defined(EIGEN_VECTORIZE_AVX)
      if constexpr (bytes == 32) {
        if constexpr (std::is_same_v<T, float>) return _mm256_stream_ps(p, v);
        else return _mm256_stream_pd(p, v);
      }
#endif
#if defined(EIGEN_VECTORIZE_SSE2)
      if constexpr (bytes == 16) {
        if constexpr (std::is_same_v<T, float>) return _mm_stream_ps(p, v);
        else return _mm_stream_pd(p, v);
      }
#endif
    }
    store(p, v);
  }
};

/// Orders non-temporal stores before what follows (they are weakly ordered).
inline void streaming_fence() noexcept {
#if defined(EIGEN_VECTORIZE_SSE2)
  _mm_sfence();
#endif
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
