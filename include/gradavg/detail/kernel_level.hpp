// gradavg internals: the averaging kernel at one instruction-set level (the contract is in
// kernel.hpp). Included by kernel.hpp after packet_level.hpp, once per level, in the same target
// region and with the same GRADAVG_LEVEL_* macros (no include guard).

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {
namespace GRADAVG_LEVEL_NS_ {

/// Packets per step: one 64-byte cache line of each tower's storage (at least one packet of the
/// accumulator, at most four): two float packets per line of 16-bit values on AVX-512. Without
/// SIMD (one element per packet) 16 floats or 8 doubles, whole blocks of the statistics.
template <class S, class Acc>
inline constexpr std::size_t step_packets =
    std::clamp<std::size_t>(64 / (packet_ops<Acc>::width * sizeof(S)), 1, packet_ops<Acc>::width == 1 ? 16 : 4);

/// Elements per step.
template <class S, class Acc>
inline constexpr std::size_t step_elements = step_packets<S, Acc> * packet_ops<Acc>::width;

/// Registers of the fused pass over one piece: whether a non-finite input was found, and the
/// statistics in eight double lanes, the same at every level: element j of each block of 16
/// (float means) or 8 (double means) from the piece's start goes to lane j mod 8 — a float
/// block's elements j and j + 8 summed first, rounded squares for mean^2 — and each block's
/// eight values are added to the lanes in block order. result() adds lanes 0 to 7 in order. Every
/// level's steps hold whole blocks (a SIMD step is one 64-byte line of inputs: 16 floats, 8
/// doubles or 16-32 16-bit values), so the sums are the same bits at every SIMD level.
template <class Acc>
struct fused_state {
  using ops = packet_ops<Acc>;
  using D = packet_ops<double>;
  static constexpr std::size_t parts = std::is_same_v<Acc, float> ? widen_ops::parts : 1;
  static constexpr std::size_t lanes = 8;
  static constexpr std::size_t accumulators = lanes / D::width;  // double packets holding the lanes
  static_assert(accumulators * D::width == lanes);

  bool nonfinite = false;
  typename D::type mean_squared[accumulators];
  typename D::type mean_of_squares[accumulators];

  fused_state() noexcept {
    for (auto& p : mean_squared) p = D::broadcast(0);
    for (auto& p : mean_of_squares) p = D::broadcast(0);
  }

  /// Adds a step's N packets of means m and means of squares q (in memory order), widened to
  /// double (exact), block by block.
  template <std::size_t N>
  GRADAVG_INLINE_ void add_statistics(const typename ops::type (&m)[N], const typename ops::type (&q)[N]) noexcept {
    constexpr std::size_t packets = N * parts;  // double packets in the step, in memory order
    typename D::type wide_m[packets], wide_q[packets];
    GRADAVG_UNROLL_
    for (std::size_t u = 0; u < N; ++u) {
      if constexpr (std::is_same_v<Acc, double>) {
        wide_m[u] = m[u];
        wide_q[u] = q[u];
      } else {
        typename D::type pm[parts], pq[parts];
        widen_ops::widen(m[u], pm);
        widen_ops::widen(q[u], pq);
        for (std::size_t p = 0; p < parts; ++p) {
          wide_m[u * parts + p] = pm[p];
          wide_q[u * parts + p] = pq[p];
        }
      }
    }
    constexpr std::size_t A = accumulators;
    if constexpr (std::is_same_v<Acc, float>) {
      static_assert(packets % (2 * A) == 0, "gradavg: a step holds whole blocks of 16 floats");
      GRADAVG_UNROLL_
      for (std::size_t b = 0; b < packets; b += 2 * A) {
        GRADAVG_UNROLL_
        for (std::size_t a = 0; a < A; ++a) {
          const auto& first = wide_m[b + a];
          const auto& second = wide_m[b + a + A];
          mean_squared[a] = D::add(mean_squared[a], D::mul_add(second, second, D::rounded(D::mul(first, first))));
          mean_of_squares[a] = D::add(mean_of_squares[a], D::add(wide_q[b + a], wide_q[b + a + A]));
        }
      }
    } else {
      static_assert(packets % A == 0, "gradavg: a step holds whole blocks of 8 doubles");
      GRADAVG_UNROLL_
      for (std::size_t b = 0; b < packets; b += A) {
        GRADAVG_UNROLL_
        for (std::size_t a = 0; a < A; ++a) {
          mean_squared[a] = D::add(mean_squared[a], D::rounded(D::mul(wide_m[b + a], wide_m[b + a])));
          mean_of_squares[a] = D::add(mean_of_squares[a], wide_q[b + a]);
        }
      }
    }
  }

  /// The piece's result: lanes summed in order.
  piece_result result() const noexcept {
    piece_result r{};
    r.nonfinite = nonfinite;
    alignas(64) double values[D::width];
    for (const auto& p : mean_squared) {
      D::store(values, p);
      for (double x : values) r.sum_mean_squared += x;
    }
    for (const auto& p : mean_of_squares) {
      D::store(values, p);
      for (double x : values) r.sum_mean_of_squares += x;
    }
    return r;
  }
};

/// One group of up to group_towers towers over a range of one variable. Where its sums come from
/// and go: from_acc, the accumulator block is added first; to_out, the group is the last, so
/// results are divided by the weight sum and stored to the outputs; stream, with non-temporal
/// stores. Direct: the common case known at compile time, up to group_towers towers straight to
/// the outputs (!from_acc, to_out), inlined into its caller; DirectStream: its stores (a template
/// because a branch per step measurably slows the in-cache and streaming passes). Otherwise (the
/// accumulator-block passes, partial steps) those three are run-time members: one predictable
/// branch per step, not a copy of the loop per combination. Prefetching is a run-time member: a
/// branch per tower and step in the Direct passes, a loop each elsewhere (there the branch cost
/// up to 15 % from memory). Fused: weights, scale, and as fused_params ask the non-finite probe
/// and statistics. S: the gradients' element type; O: the outputs'.
template <class S, class Acc, class O, bool Fused, bool WithSquare, bool Direct, bool DirectStream = false>
struct group_pass {
  using ops = packet_ops<Acc>;
  using in = storage_ops<S, Acc>;
  using out = storage_ops<O, Acc>;
  using P = typename ops::type;
  static constexpr std::size_t W = ops::width;
  static constexpr std::size_t U = step_packets<S, Acc>;
  static constexpr std::size_t E = step_elements<S, Acc>;
  static constexpr bool Squares = WithSquare;  // fused: a squares output, or statistics
  /// bfloat16 gradients where the target has it: a step's packets in lane order
  /// (storage_ops::lane_order). bfloat16 outputs are packed from it into memory order; float
  /// outputs and the accumulator block are exchanged into memory order before their stores.
  static constexpr bool LaneOrder =
      in::lane_order && U % 2 == 0 && (std::is_same_v<O, S> || std::is_same_v<O, Acc>);
  static constexpr bool LaneOrderOut = LaneOrder && std::is_same_v<O, S>;

  const S* const* towers;  // count pointers, already offset to element 0 of this pass
  std::size_t count;
  Acc* acc;  // accumulator block (from_acc or !to_out), indexed like the outputs; any alignment
  Acc* sq;
  O* mean;  // outputs (to_out), offset like towers
  O* square;  // null in a fused pass that computes squares only for the statistics
  Acc divisor;
  Acc reciprocal;  // exact_reciprocal(divisor): multiply by it instead of dividing when not 0
  const Acc* weights;  // fused: this group's count weights
  const fused_params<Acc>* fused;
  fused_state<Acc>* state;  // fused: carried from group to group; copied into registers by run()
  bool prefetch;  // whole steps prefetch the towers' data (prefetch_ahead)
  bool stream;    // to_out: whole steps store the outputs non-temporally (storage_ops::stream_step)
  bool from_acc;
  bool to_out;

  bool adds_block() const noexcept {
    if constexpr (Direct) return false; else return from_acc;
  }
  bool writes_outputs() const noexcept {
    if constexpr (Direct) return true; else return to_out;
  }
  bool streams() const noexcept {
    if constexpr (Direct) return DirectStream; else return stream;
  }

  struct no_state {};
  using registers = std::conditional_t<Fused, fused_state<Acc>, no_state>;

  /// Elements [j, j + E): U packets of every tower, summed in registers. Unit (fused only): every
  /// f_k and c are 1, so the weighted operations are the plain ones (x * 1 is x: the same bits)
  /// and the plain ones run. stream_out: store the outputs non-temporally. prefetching: ask for
  /// each tower's data prefetch_distance bytes ahead.
  /// One function, not split: its packet arrays must stay registers across the tower loop and
  /// the stores, which holds only while the whole step is one inlined body.
  template <bool Unit>
  GRADAVG_INLINE_ void step(std::size_t j, [[maybe_unused]] registers& st, bool prefetching,
                            bool stream_out) const noexcept {
    constexpr bool Weighted = Fused && !Unit;
    P a[U], s[U];
    std::size_t k = 0;
    P c{};  // the scale, for the squares
    if constexpr (Weighted && Squares) c = ops::broadcast(fused->scale_in_acc);
    if (adds_block()) {
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) {
        a[u] = ops::load(acc + j + u * W);
        if constexpr (Squares) s[u] = ops::load(sq + j + u * W);
      }
      if constexpr (LaneOrder) {
        in::template reorder_lanes<false>(a);
        if constexpr (Squares) in::template reorder_lanes<false>(s);
      }
    } else {
      P w{};
      if constexpr (Weighted) w = ops::broadcast(weights[0]);
      P xs[U];
      if (prefetching) prefetch_ahead(towers[0] + j);
      in::template load_step<LaneOrder>(towers[0] + j, xs);
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) {
        const P x = xs[u];
        if constexpr (Weighted) {
          a[u] = ops::mul(x, w);
          if constexpr (Squares) s[u] = ops::mul(a[u], ops::mul(x, c));
        } else {
          a[u] = x;
          if constexpr (Squares) s[u] = ops::mul(x, x);
        }
      }
      k = 1;
    }
    for (; k < count; ++k) {
      const S* g = towers[k] + j;
      P w{};
      if constexpr (Weighted) w = ops::broadcast(weights[k]);
      P xs[U];
      if (prefetching) prefetch_ahead(g);
      in::template load_step<LaneOrder>(g, xs);
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) {
        const P x = xs[u];
        if constexpr (Weighted) {
          a[u] = ops::mul_add(x, w, a[u]);  // explicit: a compiler's contraction cannot change it
          if constexpr (Squares) s[u] = ops::mul_add(ops::mul(x, w), ops::mul(x, c), s[u]);
        } else {
          a[u] = ops::add(a[u], x);
          if constexpr (Squares) s[u] = ops::mul_add(x, x, s[u]);
        }
      }
    }
    if constexpr (Fused) {
      // A NaN or +-Inf input makes its sum NaN or +-Inf (f_k > 0 keeps it infinite, f_k = 0 makes
      // it NaN), so the inputs are probed only where a sum is not finite: a sum that overflowed
      // from finite inputs is told apart there, and once one is found nothing more is probed.
      if (fused->detect && !st.nonfinite) {
        const P zero = ops::broadcast(0);
        P probe = ops::mul(a[0], zero);  // 0 for a finite lane, NaN for any other
        for (std::size_t u = 1; u < U; ++u) probe = ops::mul_add(a[u], zero, probe);
        if (ops::any_nan(probe)) st.nonfinite = inputs_nonfinite(j);
      }
    }
    if (writes_outputs()) {
      P m[U], q[U];
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) {
        if (reciprocal != Acc(0)) {  // the same results: see exact_reciprocal
          const P r = ops::broadcast(reciprocal);
          m[u] = ops::mul(a[u], r);
          if constexpr (Squares) q[u] = ops::mul(s[u], r);
        } else {
          const P d = ops::broadcast(divisor);
          m[u] = ops::div(a[u], d);
          if constexpr (Squares) q[u] = ops::div(s[u], d);
        }
        m[u] = ops::canonical_nan(m[u]);
        if constexpr (Squares) q[u] = ops::canonical_nan(q[u]);
      }
      if constexpr (Fused && Squares)
        if (fused->statistics) {
          if constexpr (LaneOrder) {  // the statistics take the means in memory order
            P mm[U], qq[U];
            GRADAVG_UNROLL_
            for (std::size_t u = 0; u < U; ++u) {
              mm[u] = m[u];
              qq[u] = q[u];
            }
            in::template reorder_lanes<true>(mm);
            in::template reorder_lanes<true>(qq);
            st.add_statistics(mm, qq);
          } else {
            st.add_statistics(m, q);
          }
        }
      if constexpr (LaneOrder && !LaneOrderOut) in::template reorder_lanes<true>(m);
      if (stream_out) out::template stream_step<LaneOrderOut>(mean + j, m); else out::template store_step<LaneOrderOut>(mean + j, m);
      if constexpr (Squares) {
        if (!Fused || square != nullptr) {  // else the squares fed only the statistics
          if constexpr (LaneOrder && !LaneOrderOut) in::template reorder_lanes<true>(q);
          if (stream_out) out::template stream_step<LaneOrderOut>(square + j, q); else out::template store_step<LaneOrderOut>(square + j, q);
        }
      }
    } else {
      if constexpr (LaneOrder) {  // the block in memory order: partial steps copy it by element
        in::template reorder_lanes<true>(a);
        if constexpr (Squares) in::template reorder_lanes<true>(s);
      }
      GRADAVG_UNROLL_
      for (std::size_t u = 0; u < U; ++u) {
        ops::store(acc + j + u * W, a[u]);
        if constexpr (Squares) ops::store(sq + j + u * W, s[u]);
      }
    }
  }

  /// Whether an input of this group's towers in [j, j + E) is NaN or +-Inf.
  [[gnu::cold]] [[gnu::noinline]] bool inputs_nonfinite(std::size_t j) const noexcept {
    const P zero = ops::broadcast(0);
    P probe = zero;
    for (std::size_t k = 0; k < count; ++k)
      for (std::size_t u = 0; u < U; ++u) probe = ops::mul_add(in::load(towers[k] + j + u * W), zero, probe);
    return ops::any_nan(probe);
  }

  /// Elements [j, j + n), n < E: copied into a zero-padded step, computed by run() as one whole
  /// step (the general operations: the same bits as the Unit ones), and the n results copied back.
  void partial_step(std::size_t j, std::size_t n, registers& st) const noexcept {
    alignas(64) S in_buf[group_towers][E] = {};
    const S* in_ptrs[group_towers];
    for (std::size_t k = 0; k < group_towers; ++k) in_ptrs[k] = in_buf[k];
    for (std::size_t k = 0; k < count; ++k) std::memcpy(in_buf[k], towers[k] + j, n * sizeof(S));
    alignas(64) Acc a_buf[E] = {}, s_buf[E] = {};
    if (adds_block()) {
      std::memcpy(a_buf, acc + j, n * sizeof(Acc));
      if constexpr (Squares) std::memcpy(s_buf, sq + j, n * sizeof(Acc));
    }
    alignas(64) O m_buf[E], q_buf[E];
    fused_state<Acc>* padded_state = nullptr;
    if constexpr (Fused) padded_state = &st;
    const group_pass<S, Acc, O, Fused, WithSquare, false> padded{
        in_ptrs, count, a_buf, s_buf, m_buf, q_buf, divisor, reciprocal, weights, fused, padded_state,
        false, false, adds_block(), writes_outputs()};
    padded.run(E);
    if (writes_outputs()) {
      std::memcpy(mean + j, m_buf, n * sizeof(O));
      if constexpr (Squares)
        if (square != nullptr) std::memcpy(square + j, q_buf, n * sizeof(O));
    } else {
      std::memcpy(acc + j, a_buf, n * sizeof(Acc));
      if constexpr (Squares) std::memcpy(sq + j, s_buf, n * sizeof(Acc));
    }
  }

  /// Elements [0, len) with the general operations: every pass but the Direct one, and partial
  /// steps.
  [[gnu::noinline]] void run(std::size_t len) const noexcept {
    registers st;  // a local the compiler can keep in registers, unlike *state
    if constexpr (Fused) st = *state;
    run_steps<false>(len, st);
    if constexpr (Fused) *state = st;
  }

  /// Elements [0, len) of a Direct pass, inlined into a caller whose towers' pointers and weights
  /// are its arrays of group_towers: their loads are then unrolled and hoisted out of the steps.
  GRADAVG_INLINE_ void run_inlined(std::size_t len) const noexcept {
    registers st;
    if constexpr (Fused) {
      st = *state;
      // The plain operations where every f_k and c are 1 (the same bits as the general ones).
      bool unit = fused->scale_in_acc == Acc(1);
      for (std::size_t k = 0; k < count; ++k) unit = unit && weights[k] == Acc(1);
      if (unit) run_steps<true>(len, st); else run_steps<false>(len, st);
      *state = st;
    } else {
      run_steps<false>(len, st);
    }
  }

  /// Elements [0, len): when streaming, a partial step up to the alignment of the outputs' widest
  /// stores (step_store_bytes); whole steps; then a partial step for the tail.
  template <bool Unit>
  GRADAVG_INLINE_ void run_steps(std::size_t len, registers& st) const noexcept {
    std::size_t j = 0;
    const bool stream_out = writes_outputs() && streams();
    if (stream_out) {
      // Not with statistics: their lanes follow the steps, which must not move with the outputs'
      // address (a misaligned packet is then stored normally, see packet_ops::stream).
      const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(mean) % out::step_store_bytes;
      if (misaligned % sizeof(O) == 0 && misaligned != 0 && !(Fused && fused->statistics)) {
        j = std::min(len, (out::step_store_bytes - misaligned) / sizeof(O));
        partial_step(0, j, st);
      }
    }
    // The whole steps update a copy whose address is never taken (partial_step takes st's), so
    // that the compiler can keep the fused state in registers across the steps.
    registers in_steps = st;
    const bool prefetching = software_prefetch && prefetch;
    if constexpr (Direct) {
      for (; j + E <= len; j += E) step<Unit>(j, in_steps, prefetching, stream_out);
    } else if (prefetching) {
      for (; j + E <= len; j += E) step<Unit>(j, in_steps, true, stream_out);
    } else {
      for (; j + E <= len; j += E) step<Unit>(j, in_steps, false, stream_out);
    }
    st = in_steps;
    if (j < len) partial_step(j, len - j, st);
  }
};

}  // namespace GRADAVG_LEVEL_NS_
}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
