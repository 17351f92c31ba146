// gradavg internals: elements stored as float, double, Eigen::half or Eigen::bfloat16 loaded into
// and stored from the accumulator's packets at one instruction-set level (storage_ops), and float
// packets widened to double (widen_ops).
//
// Conversions are exact (widening) or round to nearest even (narrowing, in the caller's
// floating-point rounding mode for float <-> double, always to nearest even for 16-bit), on every
// path: the intrinsics where the level has them, else Eigen's scalar conversions, which round
// alike. A NaN narrows to the target's default quiet NaN when it is the default quiet NaN of the
// source (the kernel's results are).
//
// Included by levels.hpp right after packet_level.hpp, once per level, in the same target region
// and with the same GRADAVG_LEVEL_* macros (no include guard); includes conversions_level.hpp
// (the 16-bit bit patterns, float packets widened to double) the same way.

#include "conversions_level.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {
namespace GRADAVG_LEVEL_NS_ {

/// Elements stored as S, loaded into and stored from packets of the accumulator Acc:
/// load(p) reads packet_ops<Acc>::width elements and converts each exactly; store(p, v) rounds
/// each to S (to nearest even). S == Acc: plain loads and stores.
template <class S, class Acc>
struct storage_ops {
  using ops = packet_ops<Acc>;
  using P = typename ops::type;
  static constexpr std::size_t width = ops::width;

  static P load(const S* p) noexcept {
    if constexpr (std::is_same_v<S, Acc>) {
      return ops::load(p);
    } else {
#if defined(GRADAVG_LEVEL_AVX512_)
      if constexpr (std::is_same_v<S, float> && std::is_same_v<Acc, double> && width == 8)
        return _mm512_maskz_cvtps_pd(0xff, _mm256_loadu_ps(p));
      if constexpr (std::is_same_v<S, Eigen::half> && width == 16)
        return _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      if constexpr (std::is_same_v<S, Eigen::bfloat16> && width == 16)
        return _mm512_castsi512_ps(
            _mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(GRADAVG_LEVEL_AVX2_)
      if constexpr (std::is_same_v<S, float> && std::is_same_v<Acc, double> && width == 4)
        return _mm256_cvtps_pd(_mm_loadu_ps(p));
      if constexpr (std::is_same_v<S, Eigen::half> && width == 8)
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      if constexpr (std::is_same_v<S, Eigen::bfloat16> && width == 8)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#elif defined(GRADAVG_LEVEL_SSE2_)
      if constexpr (std::is_same_v<S, float> && std::is_same_v<Acc, double> && width == 2)
        return _mm_cvtps_pd(_mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
      if constexpr (std::is_same_v<S, Eigen::bfloat16> && width == 4)
        return _mm_castsi128_ps(
            _mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
      if constexpr (std::is_same_v<S, Eigen::half> && width == 4)
        return bits16::half_to_float(
            _mm_unpacklo_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), _mm_setzero_si128()));
#endif
      alignas(64) Acc wide[width];
      for (std::size_t i = 0; i < width; ++i) wide[i] = static_cast<Acc>(p[i]);
      return ops::load(wide);
    }
  }

  static void store(S* p, const P& v) noexcept {
    if constexpr (std::is_same_v<S, Acc>) {
      ops::store(p, v);
    } else {
#if defined(GRADAVG_LEVEL_AVX512_)
      if constexpr (std::is_same_v<S, float> && std::is_same_v<Acc, double> && width == 8)
        return _mm256_storeu_ps(p, _mm512_maskz_cvtpd_ps(0xff, v));
      if constexpr (std::is_same_v<S, Eigen::half> && width == 16)
        return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                                   _mm512_maskz_cvtps_ph(0xffff, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      if constexpr (std::is_same_v<S, Eigen::bfloat16> && width == 16)
        return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                                   _mm512_maskz_cvtepi32_epi16(0xffff, bits16::bfloat16_bits(v)));
#elif defined(GRADAVG_LEVEL_AVX2_)
      if constexpr (std::is_same_v<S, float> && std::is_same_v<Acc, double> && width == 4)
        return _mm_storeu_ps(p, _mm256_cvtpd_ps(v));
      if constexpr (std::is_same_v<S, Eigen::half> && width == 8)
        return _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                                _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      if constexpr (std::is_same_v<S, Eigen::bfloat16> && width == 8) {
        const __m256i bits = bits16::bfloat16_bits(v);  // eight 16-bit values in 32-bit lanes
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
        return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
      }
#elif defined(GRADAVG_LEVEL_SSE2_)
      if constexpr (std::is_same_v<S, float> && std::is_same_v<Acc, double> && width == 2)
        return _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_castps_si128(_mm_cvtpd_ps(v)));
      if constexpr (std::is_same_v<S, Eigen::bfloat16> && width == 4)
        return _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bits16::low_words(bits16::bfloat16_bits(v)));
      if constexpr (std::is_same_v<S, Eigen::half> && width == 4)
        return _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bits16::low_words(bits16::half_bits(v)));
#endif
      alignas(64) Acc wide[width];
      ops::store(wide, v);
      for (std::size_t i = 0; i < width; ++i) p[i] = static_cast<S>(wide[i]);
    }
  }

  /// Bytes one store writes.
  static constexpr std::size_t stored_bytes = width * sizeof(S);

 private:
  /// Where the 16-bit narrowings of two packets are joined into one 32-byte store (AVX2 without
  /// AVX-512): half as many stores, and for bfloat16 one pack and one permute per pair instead
  /// of per packet.
#if defined(GRADAVG_LEVEL_AVX2_)
  static constexpr bool pairs_stores = width == 8 && (std::is_same_v<S, Eigen::half> || std::is_same_v<S, Eigen::bfloat16>);
#else
  static constexpr bool pairs_stores = false;
#endif

 public:
  /// Whether a step of bfloat16 values can be kept in lane order (bfloat16 on AVX2, and on
  /// AVX-512 with BW): each pair of packets u, u + 1 holds the pair's elements as one register's
  /// 128-bit lanes widen them, words 0-3 of every 128-bit lane in packet u and words 4-7 in
  /// packet u + 1 (AVX2: elements 0-3 and 8-11 in u, 4-7 and 12-15 in u + 1). One load and two
  /// unpacks widen a pair, and one pack (with AVX-512 BF16: one conversion and one permute)
  /// narrows it back into memory order, where element order costs two widenings and a shift
  /// each, and a permute or a narrowing move per packet. The sums are elementwise, so a pass
  /// whose loads and stores all use it computes the same values as in memory order.
#if defined(GRADAVG_LEVEL_AVX512_)
  static constexpr bool lane_order = width == 16 && std::is_same_v<S, Eigen::bfloat16>;
#else
  static constexpr bool lane_order = pairs_stores && std::is_same_v<S, Eigen::bfloat16>;
#endif

  /// Bytes the widest store of store_step / stream_step writes: stream_step stores non-temporally
  /// where p is aligned to it.
  static constexpr std::size_t step_store_bytes = pairs_stores || lane_order ? 2 * stored_bytes : stored_bytes;

  /// Loads a step's packets x[u] from p + u * width: in memory order (load() of each), or in lane
  /// order where InLaneOrder (lane_order is then required, and U even).
  template <bool InLaneOrder, std::size_t U>
  GRADAVG_INLINE_ static void load_step(const S* p, P (&x)[U]) noexcept {
    if constexpr (InLaneOrder) {
#if defined(GRADAVG_LEVEL_AVX2_)
      static_assert(lane_order && U % 2 == 0);
      const __m256i zero = _mm256_setzero_si256();
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; u += 2) {
        const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + u * width));
        x[u] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, both));
        x[u + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, both));
      }
#elif defined(GRADAVG_LEVEL_AVX512_)
      static_assert(lane_order && U % 2 == 0);
      const __m512i zero = _mm512_setzero_si512();
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; u += 2) {
        const __m512i both = _mm512_loadu_si512(p + u * width);
        x[u] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, both));
        x[u + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, both));
      }
#else
      static_assert(!InLaneOrder, "gradavg: lane order needs bfloat16 on AVX2 or AVX-512 BW");
#endif
    } else {
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) x[u] = load(p + u * width);
    }
  }

  /// Packets of Acc in lane order to memory order (ToMemory), or back: for outputs in Acc and for
  /// sums kept in memory between passes, which partial steps copy element by element. AVX2: the
  /// same exchange of each pair's 128-bit halves both ways (its own inverse).
  template <bool ToMemory, std::size_t U>
  GRADAVG_INLINE_ static void reorder_lanes([[maybe_unused]] P (&x)[U]) noexcept {
#if defined(GRADAVG_LEVEL_AVX2_)
    static_assert(lane_order && U % 2 == 0);
    GRADAVG_UNROLL_
    for (std::size_t u = 0; u < U; u += 2) {
      const P low = _mm256_permute2f128_ps(x[u], x[u + 1], 0x20);
      x[u + 1] = _mm256_permute2f128_ps(x[u], x[u + 1], 0x31);
      x[u] = low;
    }
#elif defined(GRADAVG_LEVEL_AVX512_)
    // The pair's 32 elements in four blocks of eight, one per 128-bit lane: packet u holds the
    // first four of each block, packet u + 1 the last four; memory order interleaves them.
    static_assert(lane_order && U % 2 == 0);
    GRADAVG_UNROLL_
    for (std::size_t u = 0; u < U; u += 2) {
      P first, second;
      if constexpr (ToMemory) {
        const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        first = _mm512_permutex2var_ps(x[u], low, x[u + 1]);
        second = _mm512_permutex2var_ps(x[u], high, x[u + 1]);
      } else {
        first = _mm512_maskz_shuffle_f32x4(0xffff, x[u], x[u + 1], _MM_SHUFFLE(2, 0, 2, 0));
        second = _mm512_maskz_shuffle_f32x4(0xffff, x[u], x[u + 1], _MM_SHUFFLE(3, 1, 3, 1));
      }
      x[u] = first;
      x[u + 1] = second;
    }
#else
    static_assert(U == 0, "gradavg: lane order needs bfloat16 on AVX2 or AVX-512 BW");
#endif
  }

  /// v[u] at p + u * width for every u: store() of each packet, or of a pair of them at once (the
  /// same bytes). InLaneOrder: v is in lane order (load_step), stored in memory order.
  template <bool InLaneOrder = false, std::size_t U>
  GRADAVG_INLINE_ static void store_step(S* p, const P (&v)[U]) noexcept {
    step_impl<false, InLaneOrder>(p, v);
  }
  /// As store_step, non-temporal where the target has it and p is aligned to step_store_bytes
  /// (in lane order: where p is aligned to a half of it).
  template <bool InLaneOrder = false, std::size_t U>
  GRADAVG_INLINE_ static void stream_step(S* p, const P (&v)[U]) noexcept {
    step_impl<true, InLaneOrder>(p, v);
  }

  /// As store, with a non-temporal store where the target has one for the converted values and p
  /// is aligned to stored_bytes (packet_ops::stream where S == Acc); otherwise an ordinary store.
  static void stream(S* p, const P& v) noexcept {
    if constexpr (std::is_same_v<S, Acc>) {
      ops::stream(p, v);
    } else {
      if (reinterpret_cast<std::uintptr_t>(p) % stored_bytes == 0) {
#if defined(GRADAVG_LEVEL_AVX512_)
        if constexpr (std::is_same_v<S, float> && std::is_same_v<Acc, double> && width == 8)
          return _mm256_stream_ps(p, _mm512_maskz_cvtpd_ps(0xff, v));
        if constexpr (std::is_same_v<S, Eigen::half> && width == 16)
          return _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                                     _mm512_maskz_cvtps_ph(0xffff, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        if constexpr (std::is_same_v<S, Eigen::bfloat16> && width == 16)
          return _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                                     _mm512_maskz_cvtepi32_epi16(0xffff, bits16::bfloat16_bits(v)));
#elif defined(GRADAVG_LEVEL_AVX2_)
        if constexpr (std::is_same_v<S, float> && std::is_same_v<Acc, double> && width == 4)
          return _mm_stream_ps(p, _mm256_cvtpd_ps(v));
        if constexpr (std::is_same_v<S, Eigen::half> && width == 8)
          return _mm_stream_si128(reinterpret_cast<__m128i*>(p),
                                  _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        if constexpr (std::is_same_v<S, Eigen::bfloat16> && width == 8) {
          const __m256i bits = bits16::bfloat16_bits(v);
          const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
          return _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
        }
#endif
      }
      store(p, v);
    }
  }

 private:
  template <bool Stream, bool InLaneOrder, std::size_t U>
  GRADAVG_INLINE_ static void step_impl(S* p, const P (&v)[U]) noexcept {
    if constexpr (InLaneOrder)
      lane_order_step<Stream>(p, v);
    else
      memory_order_step<Stream>(p, v);
  }

  /// A step in lane order narrowed into memory order (lane_order), pair by pair.
  template <bool Stream, std::size_t U>
  GRADAVG_INLINE_ static void lane_order_step([[maybe_unused]] S* p, [[maybe_unused]] const P (&v)[U]) noexcept {
#if defined(GRADAVG_LEVEL_AVX2_)
    static_assert(lane_order && U % 2 == 0);
    GRADAVG_UNROLL_
    for (std::size_t u = 0; u < U; u += 2) {
      // Per 128-bit lane: packet u's four words, then packet u + 1's: memory order.
      const __m256i both = _mm256_packus_epi32(bits16::bfloat16_bits(v[u]), bits16::bfloat16_bits(v[u + 1]));
      S* q = p + u * width;
      const auto address = reinterpret_cast<std::uintptr_t>(q);
      if (Stream && address % 32 == 0) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(q), both);
      } else if (Stream && address % 16 == 0) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(q), _mm256_castsi256_si128(both));
        _mm_stream_si128(reinterpret_cast<__m128i*>(q + width), _mm256_extracti128_si256(both, 1));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), both);
      }
    }
#elif defined(GRADAVG_LEVEL_AVX512_)
    static_assert(lane_order && U % 2 == 0);
    GRADAVG_UNROLL_
    for (std::size_t u = 0; u < U; u += 2) {
      const __m512i both = bits16::bfloat16_pair_bits(v[u], v[u + 1]);  // 64 bytes in memory order
      S* q = p + u * width;
      const auto address = reinterpret_cast<std::uintptr_t>(q);
      if (Stream && address % 64 == 0) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(q), both);
      } else if (Stream && address % 32 == 0) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(q), _mm512_maskz_extracti64x4_epi64(0xf, both, 0));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(q + width), _mm512_maskz_extracti64x4_epi64(0xf, both, 1));
      } else {
        _mm512_storeu_si512(q, both);
      }
    }
#else
    static_assert(U == 0, "gradavg: lane order needs bfloat16 on AVX2 or AVX-512 BW");
#endif
  }

  /// A step in memory order: pairs of packets joined into one store where pairs_stores, else
  /// packet by packet.
  template <bool Stream, std::size_t U>
  GRADAVG_INLINE_ static void memory_order_step(S* p, const P (&v)[U]) noexcept {
#if defined(GRADAVG_LEVEL_AVX2_)
    if constexpr (pairs_stores && U % 2 == 0) {
      // Streaming to a pointer off the pairs' alignment: packet by packet below, each of those
      // stores non-temporal where it is aligned.
      if (!Stream || reinterpret_cast<std::uintptr_t>(p) % step_store_bytes == 0) {
        GRADAVG_UNROLL_
        for (std::size_t u = 0; u < U; u += 2) {
          __m256i both;
          if constexpr (std::is_same_v<S, Eigen::bfloat16>) {
            // Words 0-3 of each packet, then 4-7 of each, per 128-bit lane; the qword permute
            // puts the first packet's eight before the second's.
            both = _mm256_permute4x64_epi64(
                _mm256_packus_epi32(bits16::bfloat16_bits(v[u]), bits16::bfloat16_bits(v[u + 1])), 0xd8);
          } else {
            constexpr int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_cvtps_ph(v[u], rounding)),
                                           _mm256_cvtps_ph(v[u + 1], rounding), 1);
          }
          auto* q = reinterpret_cast<__m256i*>(p + u * width);
          if constexpr (Stream) _mm256_stream_si256(q, both); else _mm256_storeu_si256(q, both);
        }
        return;
      }
    }
#endif
    GRADAVG_UNROLL_
    for (std::size_t u = 0; u < U; ++u) {
      if constexpr (Stream) stream(p + u * width, v[u]); else store(p + u * width, v[u]);
    }
  }
};

}  // namespace GRADAVG_LEVEL_NS_
}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
