// gradavg internals: the libtorch helpers' copies into replicas — the means into every replica
// after averaging, and a state (parameters or buffers) from replica 0 to the others, checked
// alike first (<gradavg/torch.hpp>'s broadcasts) — on the caller's executor, block by block.
#pragma once

#include <torch/nn/module.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "../average.hpp"
#include "../errors.hpp"
#include "../options.hpp"
#include "../torch_tensor.hpp"
#include "isa.hpp"

namespace gradavg::libtorch {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// Copies bytes from `from` to `to`; with stream, through non-temporal stores where the target has
/// them (SSE2), which bypass the caches (the caller's chunk ends with a store fence).
inline void copy_bytes(std::byte* to, const std::byte* from, std::size_t bytes, bool stream) noexcept {
#if defined(__SSE2__)
  if (stream && bytes >= 256) {
    const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(to) % 16) % 16;
    std::memcpy(to, from, head);
    std::size_t i = head;
    for (; i + 64 <= bytes; i += 64)
      for (std::size_t j = 0; j < 64; j += 16)
        _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + j),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + j)));
    std::memcpy(to + i, from + i, bytes - i);
    return;
  }
#else
  (void)stream;
#endif
  std::memcpy(to, from, bytes);
}

/// Copies each defined means[i] into tg[k][i] for k in [first, end), byte for byte (validation made their
/// memory-order shapes and dtype equal, so the bytes lie in the same order), on the executor opts
/// name: the means' bytes, as one flat range, split into chunks as the averaging splits its
/// elements, each chunk copying blocks small enough to stay in cache into every replica in turn
/// (each mean is read from memory once), through non-temporal stores as options.run.stores says
/// (automatic: by the bytes the copies read and write).
/// An exception from the executor propagates, the copies then partly done.
template <class TG>
void copy_to_replicas(const TG& tg, const std::vector<at::Tensor>& means, std::size_t first_replica,
                      std::size_t end_replica, const options& opts) {
  constexpr std::size_t block = std::size_t{64} << 10;
  struct segment {
    const std::byte* from;
    std::size_t begin, end;   // its bytes' place in the flat range of all copied means
    std::size_t first, last;  // its destinations: to[first, last)
  };
  std::vector<segment> segments;
  std::vector<std::byte*> to;
  std::size_t total = 0;
  for (std::size_t i = 0; i < means.size(); ++i) {
    if (!means[i].defined() || means[i].nbytes() == 0) continue;
    const auto* from = static_cast<const std::byte*>(means[i].data_ptr());
    const std::size_t first = to.size();
    for (std::size_t k = first_replica; k < std::min(end_replica, tg.size()); ++k) {
      auto* p = static_cast<std::byte*>(tg[k][i].first.data_ptr());
      if (p != from) to.push_back(p);  // else a parameter shared between replicas
    }
    if (to.size() == first) continue;
    segments.push_back({from, total, total + means[i].nbytes(), first, to.size()});
    total += means[i].nbytes();
  }
  if (total == 0) return;
  // Each mean is read once and written into every destination (options.run.stores).
  const std::size_t stop_replica = std::min(end_replica, tg.size());
  const bool stream =
      gradavg::detail::streams(opts, total * (1 + stop_replica - std::min(first_replica, stop_replica)));
  // Each byte is read once and written once per destination replica.
  const std::size_t chunks = gradavg::detail::chunk_count(total, std::max<std::size_t>(1, tg.size()), opts);
  auto chunk = [&](std::size_t c) {
    std::size_t begin = total / chunks * c + std::min(c, total % chunks);
    const std::size_t end = begin + total / chunks + (c < total % chunks ? 1 : 0);
    auto s = std::upper_bound(segments.begin(), segments.end(), begin,
                              [](std::size_t b, const segment& x) { return b < x.end; });
    for (; begin < end; ++s) {
      const std::size_t stop = std::min(end, s->end);
      for (std::size_t at = begin - s->begin; at < stop - s->begin; at += block) {
        const std::size_t bytes = std::min(block, stop - s->begin - at);
        for (std::size_t d = s->first; d < s->last; ++d) copy_bytes(to[d] + at, s->from + at, bytes, stream);
      }
      begin = stop;
    }
    if (stream) gradavg::detail::streaming_fence();
  };
  gradavg::detail::run_chunks(chunks, chunk, opts);
}

/// Which of a module's tensors a broadcast copies.
enum class state_kind : std::uint8_t { parameters, buffers };

/// named_parameters() or named_buffers() (recursive) of m.
inline ::torch::OrderedDict<std::string, at::Tensor> state_of(::torch::nn::Module& m, state_kind kind) {
  return kind == state_kind::parameters ? m.named_parameters(/*recurse=*/true) : m.named_buffers(/*recurse=*/true);
}

/// The replicas' parameters or buffers, checked to be alike before anything is copied: every
/// replica lists the same names in the same order (tower_error for a null replica or another
/// count, variable_mismatch_error), each tensor defined on every replica or on none, a dense CPU
/// tensor (unsupported_tensor_error; shape_error for gaps or overlaps) of one dtype
/// (element_type_error) and one memory-order shape (shape_error) on every replica. Messages name
/// the tensor (#i 'name') and the replica.
inline std::vector<::torch::OrderedDict<std::string, at::Tensor>> alike_states(
    std::span<::torch::nn::Module* const> replicas, state_kind kind) {
  const char* what = kind == state_kind::parameters ? "parameter" : "buffer";
  for (std::size_t k = 0; k < replicas.size(); ++k)
    if (replicas[k] == nullptr) throw tower_error("gradavg: replica " + std::to_string(k) + " is null");
  std::vector<::torch::OrderedDict<std::string, at::Tensor>> states;
  states.reserve(replicas.size());
  for (auto* m : replicas) states.push_back(state_of(*m, kind));
  for (std::size_t k = 0; k < states.size(); ++k) {
    if (states[k].size() != states[0].size())
      throw tower_error("gradavg: replica " + std::to_string(k) + " holds " + std::to_string(states[k].size()) + " " +
                        what + "s but replica 0 holds " + std::to_string(states[0].size()));
    for (std::size_t i = 0; i < states[k].size(); ++i) {
      const auto& item = states[k][i];
      const auto& first = states[0][i];
      const std::string here = std::string(what) + " #" + std::to_string(i) + " '" + first.key() + "'";
      if (item.key() != first.key())
        throw variable_mismatch_error(here + ": replica " + std::to_string(k) + " has '" + item.key() +
                                          "' at this position; every replica must be of one model",
                                      i);
      const at::Tensor& t = item.value();
      if (t.defined() != first.value().defined())
        throw variable_mismatch_error(here + ": defined on replica " + std::to_string(t.defined() ? k : 0) +
                                          " but not on replica " + std::to_string(t.defined() ? 0 : k),
                                      i);
      if (!t.defined()) continue;
      try {
        shared_detail::check_readable(t);
      } catch (const error& e) {
        throw unsupported_tensor_error(here + " on replica " + std::to_string(k) + ": " + e.what(), i);
      }
      if (!t.is_non_overlapping_and_dense())
        throw shape_error(here + " on replica " + std::to_string(k) + " is not contiguous (strided)", i);
      if (t.scalar_type() != first.value().scalar_type())
        throw element_type_error(here + ": " + c10::toString(t.scalar_type()) + " on replica " + std::to_string(k) +
                                     " but " + c10::toString(first.value().scalar_type()) + " on replica 0",
                                 i);
      const shape sk = shared_detail::memory_order_shape(t), s0 = shared_detail::memory_order_shape(first.value());
      if (!(sk == s0) || t.sizes() != first.value().sizes())
        throw shape_error(here + ": replica " + std::to_string(k) + " has sizes " + c10::str(t.sizes()) +
                              " (memory order " + gradavg::detail::describe_shape(sk) + ") but replica 0 has " +
                              c10::str(first.value().sizes()) + " (memory order " +
                              gradavg::detail::describe_shape(s0) + ")",
                          i);
    }
  }
  return states;
}

/// Copies every tensor of states[0] into the same tensor of states[1..K-1], byte for byte (alike:
/// the same bytes in the same order), through copy_to_replicas on opts' executor.
inline void copy_state_to_other_replicas(const std::vector<::torch::OrderedDict<std::string, at::Tensor>>& states,
                                         const options& opts = {}) {
  if (states.size() < 2) return;
  std::vector<std::vector<std::pair<at::Tensor, std::string_view>>> to(states.size());
  for (std::size_t k = 0; k < states.size(); ++k) {
    to[k].reserve(states[k].size());
    for (const auto& item : states[k]) to[k].emplace_back(item.value(), std::string_view(item.key()));
  }
  std::vector<at::Tensor> from;
  from.reserve(states[0].size());
  for (const auto& item : states[0]) from.push_back(item.value());
  copy_to_replicas(to, from, 1, states.size(), opts);
}

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg::libtorch
