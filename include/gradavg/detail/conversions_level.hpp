// gradavg internals: at one instruction-set level, the 16-bit bit patterns of float packets and
// back (bits16) and float packets widened to double (widen_ops): the conversions storage_ops and
// the fused statistics build on. Included by storage_level.hpp, once per level, in the same target
// region and with the same GRADAVG_LEVEL_* macros (no include guard).

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {
namespace GRADAVG_LEVEL_NS_ {

/// 16-bit bit patterns from and to float packets, where the level has the instructions. The
/// AVX-512 conversions are the zero-masked forms: GCC 12 warns about the unmasked ones' undefined
/// pass-through operand (-Wuninitialized).
struct bits16 {
#if defined(GRADAVG_LEVEL_AVX512_)
  /// bfloat16 bit patterns of v's floats, rounded to nearest even, in 32-bit lanes; NaN -> 0x7fc0.
  static __m512i bfloat16_bits(const __m512& v) noexcept {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_maskz_srli_epi32(0xffff, _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7fc0));
  }
#if defined(GRADAVG_LEVEL_AVX512_)
  /// A pair of packets in lane order as its 32 bfloat16 values in memory order, each rounded to
  /// nearest even; NaN -> 0x7fc0 where it is the default quiet NaN.
  static __m512i bfloat16_pair_bits(const __m512& first, const __m512& second) noexcept {
#if defined(GRADAVG_LEVEL_BF16_)
    // The bfloat16 conversion rounds to nearest even but flushes subnormal floats to zero: it
    // serves pairs without one (fpclass 0x20: subnormal).
    if ((_mm512_fpclass_ps_mask(first, 0x20) | _mm512_fpclass_ps_mask(second, 0x20)) == 0) {
      // first's sixteen words, then second's: 64-bit blocks 0-3 and 4-7, interleaved into memory order.
      const auto blocks = (__m512i)_mm512_cvtne2ps_pbh(second, first);
      return _mm512_maskz_permutexvar_epi64(0xff, _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), blocks);
    }
#endif
    return _mm512_packus_epi32(bfloat16_bits(first), bfloat16_bits(second));
  }
#endif
#elif defined(GRADAVG_LEVEL_SSE2_)
  /// The four 16-bit values in the low halves of v's 32-bit lanes (words 0, 2, 4, 6), in the low
  /// 64 bits.
  static __m128i low_words(const __m128i& v) noexcept {
    __m128i words = _mm_shufflelo_epi16(v, _MM_SHUFFLE(2, 0, 2, 0));
    words = _mm_shufflehi_epi16(words, _MM_SHUFFLE(2, 0, 2, 0));
    return _mm_shuffle_epi32(words, _MM_SHUFFLE(3, 1, 2, 0));
  }

  /// Four halves (zero-extended in 32-bit lanes) as floats: exact, the bits of Eigen's scalar
  /// half_to_float for every input (without F16C), in SSE2 integer operations and one exact
  /// subtraction (subnormal halves; other lanes subtract a value from itself: no flag raised).
  static __m128 half_to_float(const __m128i& h) noexcept {
    const __m128i shifted_exp = _mm_set1_epi32(0x7c00 << 13);
    const __m128i magic = _mm_set1_epi32(113 << 23);
    __m128i o = _mm_add_epi32(_mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7fff)), 13),
                              _mm_set1_epi32((127 - 15) << 23));
    const __m128i exp = _mm_and_si128(_mm_slli_epi32(h, 13), shifted_exp);
    const __m128i inf_nan = _mm_cmpeq_epi32(exp, shifted_exp);
    const __m128i small = _mm_cmpeq_epi32(exp, _mm_setzero_si128());
    const __m128i renormalise = _mm_or_si128(_mm_and_si128(small, _mm_add_epi32(o, _mm_set1_epi32(1 << 23))),
                                             _mm_andnot_si128(small, magic));
    const __m128i subnormal =
        _mm_castps_si128(_mm_sub_ps(_mm_castsi128_ps(renormalise), _mm_castsi128_ps(magic)));
    o = _mm_add_epi32(o, _mm_and_si128(inf_nan, _mm_set1_epi32((128 - 16) << 23)));
    o = _mm_or_si128(_mm_and_si128(small, subnormal), _mm_andnot_si128(small, o));
    return _mm_castsi128_ps(_mm_or_si128(o, _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16)));
  }

  /// Half bit patterns of v's floats in 32-bit lanes: the bits of Eigen's scalar float_to_half_rtne
  /// (to nearest even; NaN -> 0x7e00 with the sign kept, overflow -> infinity) for every input,
  /// in SSE2 integer operations and one addition (lanes below the smallest normal half; other
  /// lanes add to zero: no flag raised by a NaN).
  static __m128i half_bits(const __m128& v) noexcept {
    const __m128i bits = _mm_castps_si128(v);
    const __m128i sign = _mm_and_si128(bits, _mm_set1_epi32(static_cast<int>(0x80000000u)));
    const __m128i f = _mm_xor_si128(bits, sign);
    const __m128i denorm_magic = _mm_set1_epi32(((127 - 15) + (23 - 10) + 1) << 23);
    const __m128i big = _mm_cmpgt_epi32(f, _mm_set1_epi32(((127 + 16) << 23) - 1));
    const __m128i nan = _mm_cmpgt_epi32(f, _mm_set1_epi32(255 << 23));
    const __m128i big_value = _mm_or_si128(_mm_set1_epi32(0x7c00), _mm_and_si128(nan, _mm_set1_epi32(0x0200)));
    const __m128i small = _mm_cmplt_epi32(f, _mm_set1_epi32(113 << 23));
    const __m128i small_sum = _mm_castps_si128(
        _mm_add_ps(_mm_castsi128_ps(_mm_and_si128(small, f)), _mm_castsi128_ps(denorm_magic)));
    const __m128i small_value = _mm_sub_epi32(small_sum, denorm_magic);
    const __m128i odd = _mm_and_si128(_mm_srli_epi32(f, 13), _mm_set1_epi32(1));
    const __m128i normal_value = _mm_srli_epi32(
        _mm_add_epi32(_mm_add_epi32(f, _mm_set1_epi32(static_cast<int>(0xc8000fffu))), odd), 13);
    __m128i o = _mm_or_si128(_mm_and_si128(small, small_value), _mm_andnot_si128(small, normal_value));
    o = _mm_or_si128(_mm_and_si128(big, big_value), _mm_andnot_si128(big, o));
    return _mm_or_si128(o, _mm_srli_epi32(sign, 16));
  }

  static __m128i bfloat16_bits(const __m128& v) noexcept {
    const __m128i u = _mm_castps_si128(v);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb), 16);
    const __m128i is_nan = _mm_castps_si128(_mm_cmpunord_ps(v, v));
    return _mm_or_si128(_mm_andnot_si128(is_nan, rounded), _mm_and_si128(is_nan, _mm_set1_epi32(0x7fc0)));
  }
#elif defined(GRADAVG_LEVEL_AVX2_)
  static __m256i bfloat16_bits(const __m256& v) noexcept {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
  }
#endif
};

/// Packets of float widened to packets of double, for statistics summed in double: parts double
/// packets per float packet, lane order kept.
struct widen_ops {
  using F = packet_ops<float>;
  using D = packet_ops<double>;
  static constexpr std::size_t parts = F::width / D::width;
  static_assert(parts >= 1 && parts * D::width == F::width);

  GRADAVG_INLINE_ static void widen(const typename F::type& v, typename D::type (&out)[parts]) noexcept {
#if defined(GRADAVG_LEVEL_AVX512_)
    if constexpr (parts == 2 && F::width == 16) {
      out[0] = _mm512_maskz_cvtps_pd(0xff, _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xf, _mm512_castps_pd(v), 0)));
      out[1] = _mm512_maskz_cvtps_pd(0xff, _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xf, _mm512_castps_pd(v), 1)));
      return;
    }
#elif defined(GRADAVG_LEVEL_AVX2_)
    if constexpr (parts == 2 && F::width == 8) {
      out[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
      out[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      return;
    }
#elif defined(GRADAVG_LEVEL_SSE2_)
    if constexpr (parts == 2 && F::width == 4) {
      out[0] = _mm_cvtps_pd(v);
      out[1] = _mm_cvtps_pd(_mm_movehl_ps(v, v));
      return;
    }
#endif
    alignas(64) float narrow[F::width];
    alignas(64) double wide[F::width];
    F::store(narrow, v);
    for (std::size_t i = 0; i < F::width; ++i) wide[i] = static_cast<double>(narrow[i]);
    for (std::size_t part = 0; part < parts; ++part) out[part] = D::load(wide + part * D::width);
  }
};

}  // namespace GRADAVG_LEVEL_NS_
}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
