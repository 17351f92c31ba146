// gradavg internals: the kernel's entry points at one instruction-set level — one variable's
// range, whole variables of a table, quotients (the contracts are in kernel.hpp). Included by
// kernel.hpp after kernel_level.hpp, once per level, in the same target region and with the same
// GRADAVG_LEVEL_* macros (no include guard).

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {
namespace GRADAVG_LEVEL_NS_ {

/// The pass's state for one variable: the tower pointers and weights of the group being summed,
/// and the fused registers.
template <class S, class Acc, bool Fused>
struct variable_pass {
  struct no_state {};
  const S* group[group_towers];
  Acc weights[group_towers];
  [[maybe_unused]] std::conditional_t<Fused, fused_state<Acc>, no_state> state;

  fused_state<Acc>* state_ptr() noexcept {
    if constexpr (Fused) return &state; else return nullptr;
  }
  /// group[k] and weights[k] for towers [first, first + count), from element `offset` on.
  void load(const tower_reader<S>& tower_data, std::size_t first, std::size_t count, std::size_t offset,
            const fused_params<Acc>* fused) {
    for (std::size_t k = 0; k < count; ++k) group[k] = tower_data(first + k) + offset;
    if constexpr (Fused)
      for (std::size_t k = 0; k < count; ++k)
        weights[k] = static_cast<Acc>((fused->weights ? fused->weights[first + k] : 1.0) * fused->scale);
  }
};

/// More than group_towers towers: group by group through the L1 accumulator block, which starts
/// at -0.0 (x + -0.0 is x, bit for bit, for every x: the same sums as starting from the first
/// tower, with one group variant fewer to compile). Out of line, so that its block does not
/// enlarge the stack frame of every call with fewer towers.
template <class S, class Acc, class O, bool Fused, bool WithSquare>
[[gnu::noinline]] void reduce_blocks(variable_pass<S, Acc, Fused>& v, const tower_reader<S>& tower_data,
                                     std::size_t tower_count, std::size_t begin, std::size_t end, O* mean, O* square,
                                     Acc divisor, Acc reciprocal, const fused_params<Acc>* fused, bool prefetch,
                                     bool stream) {
  constexpr std::size_t B = block_elements<Acc>;
  alignas(64) Acc acc[B];
  alignas(64) Acc sq[WithSquare ? B : 1];
  using ops = packet_ops<Acc>;
  const auto negative_zero = ops::broadcast(Acc(-0.0));
  for (std::size_t block = begin; block < end; block += B) {
    const std::size_t len = std::min(B, end - block);
    for (std::size_t j = 0; j < len; j += ops::width) {  // B is whole packets
      ops::store(acc + j, negative_zero);
      if constexpr (WithSquare) ops::store(sq + j, negative_zero);
    }
    for (std::size_t first = 0; first < tower_count; first += group_towers) {
      const std::size_t count = std::min(group_towers, tower_count - first);
      v.load(tower_data, first, count, block, fused);
      O* m = mean + block;
      O* q = square ? square + block : nullptr;
      const bool last = first + count == tower_count;
      group_pass<S, Acc, O, Fused, WithSquare, false>{v.group, count, acc, sq, m, q, divisor, reciprocal, v.weights,
                                                      fused, v.state_ptr(), prefetch, stream, true, last}
          .run(len);
    }
  }
}

/// At most group_towers towers, whose pointers (and weights) v holds: elements [0, len) from mean
/// and square on, the Direct pass inlined into its caller.
template <class S, class Acc, class O, bool Fused, bool WithSquare, bool Stream>
GRADAVG_INLINE_ void reduce_direct(variable_pass<S, Acc, Fused>& v, std::size_t tower_count, std::size_t len, O* mean,
                                   O* square, Acc divisor, Acc reciprocal, const fused_params<Acc>* fused,
                                   bool prefetch) noexcept {
  group_pass<S, Acc, O, Fused, WithSquare, true, Stream>{
      v.group, tower_count, nullptr, nullptr, mean, square, divisor, reciprocal, v.weights, fused, v.state_ptr(),
      prefetch, Stream, false, true}
      .run_inlined(len);
}

template <class S, class Acc, class O, bool Fused, bool WithSquare>
piece_result reduce_range_impl(const tower_reader<S>& tower_data, std::size_t tower_count, std::size_t begin, std::size_t end,
                               O* mean, O* square, Acc divisor, const fused_params<Acc>* fused, bool prefetch,
                               bool stream) {
  const Acc reciprocal = exact_reciprocal(divisor);
  variable_pass<S, Acc, Fused> v;
  if (tower_count <= group_towers) {
    v.load(tower_data, 0, tower_count, begin, fused);
    O* q = square ? square + begin : nullptr;
    if (stream)
      reduce_direct<S, Acc, O, Fused, WithSquare, true>(v, tower_count, end - begin, mean + begin, q, divisor,
                                                        reciprocal, fused, prefetch);
    else
      reduce_direct<S, Acc, O, Fused, WithSquare, false>(v, tower_count, end - begin, mean + begin, q, divisor,
                                                         reciprocal, fused, prefetch);
  } else {
    reduce_blocks<S, Acc, O, Fused, WithSquare>(v, tower_data, tower_count, begin, end, mean, square, divisor,
                                                reciprocal, fused, prefetch, stream);
  }
  if (stream) streaming_fence();
  if constexpr (Fused)
    return v.state.result();
  else
    return {};
}


/// Reduces elements [begin, end) of one variable at this level: kernel.hpp's reduce_range.
template <class S, class Acc, class O>
piece_result reduce_range(const tower_reader<S>& tower_data, std::size_t tower_count, std::size_t begin, std::size_t end,
                          O* mean, O* square, bool streaming, bool prefetch, Acc divisor, const fused_params<Acc>* fused) {
  if (fused != nullptr) {
    if (square != nullptr || fused->statistics)
      return reduce_range_impl<S, Acc, O, true, true>(tower_data, tower_count, begin, end, mean, square, divisor, fused,
                                                      prefetch, streaming);
    return reduce_range_impl<S, Acc, O, true, false>(tower_data, tower_count, begin, end, mean, square, divisor, fused,
                                                     prefetch, streaming);
  }
  if (square != nullptr)
    return reduce_range_impl<S, Acc, O, false, true>(tower_data, tower_count, begin, end, mean, square, divisor, fused,
                                                     prefetch, streaming);
  return reduce_range_impl<S, Acc, O, false, false>(tower_data, tower_count, begin, end, mean, square, divisor, fused,
                                                    prefetch, streaming);
}

/// Whole variables [first, last) of a table, plain pass (kernel.hpp's reduce_variables): the
/// Direct pass inlined in the loop over the variables, so a small variable costs no call.
template <class S, class Acc, class O, bool WithSquare>
void reduce_variables_impl(const shared_detail::buffer_table& table, std::size_t first, std::size_t last,
                           std::size_t tower_count, bool streaming, bool prefetch, Acc divisor) {
  const Acc reciprocal = exact_reciprocal(divisor);
  for (std::size_t i = first; i < last; ++i) {
    const std::size_t n = table.elements[i];
    if (n == 0) continue;
    const tower_reader<S> reader = row_reader<S>(table, i);
    O* mean = table.buffer<O>(i, tower_count);
    O* square = WithSquare ? table.buffer<O>(i, tower_count + 1) : nullptr;
    if (tower_count <= group_towers && !streaming) {
      variable_pass<S, Acc, false> towers;
      towers.load(reader, 0, tower_count, 0, nullptr);
      reduce_direct<S, Acc, O, false, WithSquare, false>(towers, tower_count, n, mean, square, divisor, reciprocal,
                                                         nullptr, prefetch);
    } else {
      reduce_range_impl<S, Acc, O, false, WithSquare>(reader, tower_count, 0, n, mean, square, divisor, nullptr,
                                                      prefetch, streaming);
    }
  }
}

template <class S, class Acc, class O>
void reduce_variables(const shared_detail::buffer_table& table, std::size_t first, std::size_t last,
                      std::size_t tower_count, bool with_squares, bool streaming, bool prefetch, Acc divisor) {
  if (with_squares)
    reduce_variables_impl<S, Acc, O, true>(table, first, last, tower_count, streaming, prefetch, divisor);
  else
    reduce_variables_impl<S, Acc, O, false>(table, first, last, tower_count, streaming, prefetch, divisor);
}

/// to[j] = from[j] / divisor for j in [0, len), a NaN quotient the default quiet NaN, stored
/// non-temporally from the first element aligned to a packet: kernel.hpp's stream_quotients.
/// Not fenced: the caller calls streaming_fence once before the outputs are read.
template <class Acc>
void stream_quotients(const Acc* from, Acc* to, std::size_t len, Acc divisor) noexcept {
  using ops = packet_ops<Acc>;
  constexpr Acc nan = std::numeric_limits<Acc>::quiet_NaN();
  std::size_t j = 0;
  for (; j < len && reinterpret_cast<std::uintptr_t>(to + j) % ops::bytes != 0; ++j) {
    const Acc x = from[j] / divisor;
    to[j] = x == x ? x : nan;
  }
  const auto d = ops::broadcast(divisor);
  for (; j + ops::width <= len; j += ops::width)
    ops::stream(to + j, ops::canonical_nan(ops::div(ops::load(from + j), d)));
  for (; j < len; ++j) {
    const Acc x = from[j] / divisor;
    to[j] = x == x ? x : nan;
  }
}

}  // namespace GRADAVG_LEVEL_NS_
}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
