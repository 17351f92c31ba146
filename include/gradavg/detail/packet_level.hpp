// gradavg internals: the SIMD operations the kernel uses at one instruction-set level (packets of
// float and double: loads, stores, arithmetic, non-temporal stores). With storage_level.hpp (the
// 16-bit types and the conversions), the only place gradavg touches compiler intrinsics (the one
// sfence is kernel.hpp's); and the only place it touches Eigen's internal packet API (the generic
// level: Eigen::internal::packet_traits, unpacket_traits, ploadu, pstoreu, pset1, padd, pmul,
// pdiv, pcmp_eq, pselect). A change in Eigen's internals is a fix in this file alone.
//
// Included by kernel.hpp once per level this translation unit compiles (no include guard),
// inside that level's target region, with exactly one of these defined:
//   GRADAVG_LEVEL_SSE2_, GRADAVG_LEVEL_AVX2_ (with F16C), GRADAVG_LEVEL_AVX512_ (F, BW, VL, DQ;
//   and GRADAVG_LEVEL_BF16_ where the unit's flags have AVX-512 BF16): x86-64 intrinsics;
//   GRADAVG_LEVEL_GENERIC_: Eigen's packets for the unit's flags (NEON, scalar, ...);
// and GRADAVG_LEVEL_NS_, the namespace (in gradavg::detail) that holds the level's definitions.

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {
namespace GRADAVG_LEVEL_NS_ {

/// The level's vector of T (float or double): its register type, width and element-wise
/// operations. canonical_nan: v with every NaN lane the default quiet NaN (which NaN operand an
/// addition propagates depends on instruction operand order, which compilers may swap).
/// stream_aligned: a non-temporal store to p aligned to the vector (an ordinary store where the
/// level has none).
template <class T>
struct simd_vec;

#if defined(GRADAVG_LEVEL_SSE2_)
template <>
struct simd_vec<float> {
  using type = __m128;
  static constexpr std::size_t width = 4;
  static type load(const float* p) noexcept { return _mm_loadu_ps(p); }
  static void store(float* p, type v) noexcept { _mm_storeu_ps(p, v); }
  static void stream_aligned(float* p, type v) noexcept { _mm_stream_ps(p, v); }
  static type broadcast(float x) noexcept { return _mm_set1_ps(x); }
  static type add(type a, type b) noexcept { return _mm_add_ps(a, b); }
  static type mul(type a, type b) noexcept { return _mm_mul_ps(a, b); }
  static type div(type a, type b) noexcept { return _mm_div_ps(a, b); }
  static type canonical_nan(type v) noexcept {
    const type ordered = _mm_cmpord_ps(v, v);
    return _mm_or_ps(_mm_and_ps(ordered, v),
                     _mm_andnot_ps(ordered, broadcast(std::numeric_limits<float>::quiet_NaN())));
  }
  static bool any_nan(type v) noexcept { return _mm_movemask_ps(_mm_cmpunord_ps(v, v)) != 0; }
};
template <>
struct simd_vec<double> {
  using type = __m128d;
  static constexpr std::size_t width = 2;
  static type load(const double* p) noexcept { return _mm_loadu_pd(p); }
  static void store(double* p, type v) noexcept { _mm_storeu_pd(p, v); }
  static void stream_aligned(double* p, type v) noexcept { _mm_stream_pd(p, v); }
  static type broadcast(double x) noexcept { return _mm_set1_pd(x); }
  static type add(type a, type b) noexcept { return _mm_add_pd(a, b); }
  static type mul(type a, type b) noexcept { return _mm_mul_pd(a, b); }
  static type div(type a, type b) noexcept { return _mm_div_pd(a, b); }
  static type canonical_nan(type v) noexcept {
    const type ordered = _mm_cmpord_pd(v, v);
    return _mm_or_pd(_mm_and_pd(ordered, v),
                     _mm_andnot_pd(ordered, broadcast(std::numeric_limits<double>::quiet_NaN())));
  }
  static bool any_nan(type v) noexcept { return _mm_movemask_pd(_mm_cmpunord_pd(v, v)) != 0; }
};
#elif defined(GRADAVG_LEVEL_AVX2_)
template <>
struct simd_vec<float> {
  using type = __m256;
  static constexpr std::size_t width = 8;
  static type load(const float* p) noexcept { return _mm256_loadu_ps(p); }
  static void store(float* p, type v) noexcept { _mm256_storeu_ps(p, v); }
  static void stream_aligned(float* p, type v) noexcept { _mm256_stream_ps(p, v); }
  static type broadcast(float x) noexcept { return _mm256_set1_ps(x); }
  static type add(type a, type b) noexcept { return _mm256_add_ps(a, b); }
  static type mul(type a, type b) noexcept { return _mm256_mul_ps(a, b); }
  static type div(type a, type b) noexcept { return _mm256_div_ps(a, b); }
  static type canonical_nan(type v) noexcept {
    return _mm256_blendv_ps(broadcast(std::numeric_limits<float>::quiet_NaN()), v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
  }
  static bool any_nan(type v) noexcept { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
};
template <>
struct simd_vec<double> {
  using type = __m256d;
  static constexpr std::size_t width = 4;
  static type load(const double* p) noexcept { return _mm256_loadu_pd(p); }
  static void store(double* p, type v) noexcept { _mm256_storeu_pd(p, v); }
  static void stream_aligned(double* p, type v) noexcept { _mm256_stream_pd(p, v); }
  static type broadcast(double x) noexcept { return _mm256_set1_pd(x); }
  static type add(type a, type b) noexcept { return _mm256_add_pd(a, b); }
  static type mul(type a, type b) noexcept { return _mm256_mul_pd(a, b); }
  static type div(type a, type b) noexcept { return _mm256_div_pd(a, b); }
  static type canonical_nan(type v) noexcept {
    return _mm256_blendv_pd(broadcast(std::numeric_limits<double>::quiet_NaN()), v, _mm256_cmp_pd(v, v, _CMP_ORD_Q));
  }
  static bool any_nan(type v) noexcept { return _mm256_movemask_pd(_mm256_cmp_pd(v, v, _CMP_UNORD_Q)) != 0; }
};
#elif defined(GRADAVG_LEVEL_AVX512_)
// One compare into a mask register and one masked move for the NaN lanes.
template <>
struct simd_vec<float> {
  using type = __m512;
  static constexpr std::size_t width = 16;
  static type load(const float* p) noexcept { return _mm512_loadu_ps(p); }
  static void store(float* p, type v) noexcept { _mm512_storeu_ps(p, v); }
  static void stream_aligned(float* p, type v) noexcept { _mm512_stream_ps(p, v); }
  static type broadcast(float x) noexcept { return _mm512_set1_ps(x); }
  static type add(type a, type b) noexcept { return _mm512_add_ps(a, b); }
  static type mul(type a, type b) noexcept { return _mm512_mul_ps(a, b); }
  static type div(type a, type b) noexcept { return _mm512_div_ps(a, b); }
  static type canonical_nan(type v) noexcept {
    return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              broadcast(std::numeric_limits<float>::quiet_NaN()));
  }
  static bool any_nan(type v) noexcept { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
};
template <>
struct simd_vec<double> {
  using type = __m512d;
  static constexpr std::size_t width = 8;
  static type load(const double* p) noexcept { return _mm512_loadu_pd(p); }
  static void store(double* p, type v) noexcept { _mm512_storeu_pd(p, v); }
  static void stream_aligned(double* p, type v) noexcept { _mm512_stream_pd(p, v); }
  static type broadcast(double x) noexcept { return _mm512_set1_pd(x); }
  static type add(type a, type b) noexcept { return _mm512_add_pd(a, b); }
  static type mul(type a, type b) noexcept { return _mm512_mul_pd(a, b); }
  static type div(type a, type b) noexcept { return _mm512_div_pd(a, b); }
  static type canonical_nan(type v) noexcept {
    return _mm512_mask_mov_pd(v, _mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q),
                              broadcast(std::numeric_limits<double>::quiet_NaN()));
  }
  static bool any_nan(type v) noexcept { return _mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q) != 0; }
};
#else
/// Eigen's packets of T for this unit's flags; T itself where Eigen does not vectorise.
template <class T>
struct simd_vec {
  using type = typename Eigen::internal::packet_traits<T>::type;
  static constexpr std::size_t width = static_cast<std::size_t>(Eigen::internal::unpacket_traits<type>::size);
  static type load(const T* p) noexcept { return Eigen::internal::ploadu<type>(p); }
  static void store(T* p, const type& v) noexcept { Eigen::internal::pstoreu(p, v); }
  static void stream_aligned(T* p, const type& v) noexcept { store(p, v); }
  static type broadcast(T x) noexcept { return Eigen::internal::pset1<type>(x); }
  static type add(const type& a, const type& b) noexcept { return Eigen::internal::padd(a, b); }
  static type mul(const type& a, const type& b) noexcept { return Eigen::internal::pmul(a, b); }
  static type div(const type& a, const type& b) noexcept { return Eigen::internal::pdiv(a, b); }
  static type canonical_nan(const type& v) noexcept {
    return Eigen::internal::pselect(Eigen::internal::pcmp_eq(v, v), v, broadcast(std::numeric_limits<T>::quiet_NaN()));
  }
  static bool any_nan(const type& v) noexcept {
    alignas(64) T lanes[width];
    store(lanes, v);
    bool found = false;
    for (T x : lanes) found = found || x != x;
    return found;
  }
};
#endif

/// Packets of T (float or double) at this level, and the kernel's operations on them.
template <class T>
struct packet_ops : simd_vec<T> {
  using base = simd_vec<T>;
  using type = typename base::type;
  using base::width;
  static constexpr std::size_t bytes = sizeof(type);
  using base::add;
  using base::mul;

  /// a * b rounded to T, then + c: two roundings on every target, never one fused multiply-add
  /// (whatever the compiler's -ffp-contract), so that results are the same bits on a target with
  /// FMA and one without.
  static type mul_add(const type& a, const type& b, const type& c) noexcept { return add(rounded(mul(a, b)), c); }
  /// v, opaque to the optimiser: a product passed through it is rounded to T before any later
  /// sum (it cannot be contracted into one). No instruction on x86 and Arm.
  static type rounded(type v) noexcept {
#if defined(__GNUC__) && defined(GRADAVG_LEVEL_AVX512_)
    __asm__("" : "+v"(v));  // any of the 32 vector registers
#elif defined(__GNUC__) && (defined(GRADAVG_LEVEL_SSE2_) || defined(GRADAVG_LEVEL_AVX2_))
    __asm__("" : "+x"(v));
#elif defined(__GNUC__) && (defined(__aarch64__) || defined(__ARM_NEON))
    __asm__("" : "+w"(v));
#else
    volatile type kept = v;
    v = kept;
#endif
    return v;
  }

  /// Stores v at p with a non-temporal store where the level has one and p is aligned to a
  /// packet; otherwise an ordinary store.
  static void stream(T* p, const type& v) noexcept {
    if (reinterpret_cast<std::uintptr_t>(p) % bytes == 0) base::stream_aligned(p, v); else base::store(p, v);
  }
};

}  // namespace GRADAVG_LEVEL_NS_
}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
