// gradavg internals: how the buckets of a call across processes move, in two parts — a transport
// (MPI, or any other engine that moves bytes between the ranks) gives the blocking collectives of
// the agreement and a bucket's nonblocking byte moves; an exchange strategy decides what moves and
// how the ranks' contributions are summed. owner_sum is today's strategy: every rank owns a
// contiguous slice of each bucket, sums the others' contributions to it in rank order and sends
// the sum back to every rank (the same bits on every rank, whatever the transport), as the
// accumulator's bits or in a wire format (codec.hpp); with sharded output the slices are runs of
// the ranks' shards, and the owners keep their sums.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "codec.hpp"
#include "../trace.hpp"
#include "../../errors.hpp"
#include "../../options.hpp"
#include "../isa.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail::processes {

/// A bucket of len elements of `element` bytes each, cut among `ranks` ranks: rank r owns
/// elements [first(r), first(r + 1)), bytes [at(r), at(r + 1)).
struct slice_layout {
  std::size_t len = 0;
  std::size_t element = 0;
  int ranks = 1;

  [[nodiscard]] std::size_t first(int r) const noexcept {
    return len * static_cast<std::size_t>(r) / static_cast<std::size_t>(ranks);
  }
  [[nodiscard]] std::size_t at(int r) const noexcept { return first(r) * element; }
  [[nodiscard]] std::size_t bytes(int r) const noexcept { return at(r + 1) - at(r); }
  /// Where, among the other ranks' contributions to this rank's slice (rank order, itself left
  /// out), rank r's begins, in bytes.
  [[nodiscard]] std::size_t received_at(int r, int rank) const noexcept {
    return static_cast<std::size_t>(r < rank ? r : r - 1) * bytes(rank);
  }
};

/// What a call across processes needs from a transport. The agreement's collectives are blocking
/// and every rank enters them in the same order; they throw the transport's own error (the same
/// on every rank where the engine fails everywhere). A bucket's moves are nonblocking, identified
/// by a set number in [0, reserve's count), and never throw: a failure is noted and rethrown by
/// rethrow_noted() after the call's last collective (throwing at once would leave the other ranks
/// waiting for this rank's messages).
template <class T>
concept transport = requires(T& t, const T& c, std::uint64_t* words, const std::uint64_t* in, std::size_t n,
                             std::size_t set, std::byte* bytes, const std::byte* from, const slice_layout& layout) {
  /// "gradavg::mpi": the start of every error message the call throws.
  { T::caller } -> std::convertible_to<const char*>;
  /// The call's options: gradavg::options' groups (compute, run, check, and local() for them) and
  /// exchange.fusion_bytes, compression, residual and seed (mpi::options is a model).
  typename T::options_type;
  { c.rank() } -> std::same_as<int>;
  { c.ranks() } -> std::same_as<int>;
  /// Bits that tell this communication context from another one (a plan keeps them).
  { c.identity() } -> std::same_as<std::uint64_t>;
  /// The transport's own exchange option, as a header word every rank must pass alike; and
  /// its check (option_error), before any collective.
  { c.method_code() } -> std::same_as<std::uint64_t>;
  c.check_options();
  /// Fusion bytes when the caller passes 0.
  { c.automatic_fusion_bytes() } -> std::same_as<std::size_t>;
  /// Every collective: in place minimum; maximum of in into words; every rank's n words into
  /// words, in rank order.
  t.min_words(words, n);
  t.max_words(in, words, n);
  t.gather_words(in, words, n);
  /// Room for `sets` buckets in flight (allocates; before the first collective).
  t.reserve(set);
  /// Sends bytes [layout.at(r), layout.at(r + 1)) of `from` to every other rank r, receives
  /// layout.bytes(rank) bytes from each into `bytes` + layout.received_at(r, rank).
  t.scatter(set, from, bytes, layout);
  /// Sends this rank's bytes of `bytes` to every other rank, receives theirs in place.
  t.gather(set, bytes, layout);
  /// Waits for a set's moves; lets them progress (an engine without a progress thread moves data
  /// only inside its calls).
  t.wait(set);
  t.test(set);
  t.rethrow_noted();
};

/// The first variable whose elements end after flat element `begin`, from a table of each
/// variable's element count and first flat element (sizes[2 i], sizes[2 i + 1]; flat order).
inline std::size_t first_variable_after(const std::uint64_t* sizes, std::size_t variables, std::size_t begin) noexcept {
  std::size_t lo = 0, hi = variables;
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (sizes[2 * mid + 1] + sizes[2 * mid] <= begin) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/// Sharded buckets (output_mode::sharded, the gather of shards): bucket b holds, for every rank
/// r, the b-th run of `run` elements of r's shard of `range` (shard_of), empty past its end.
inline element_range shard_run(element_range range, int ranks, int r, std::size_t b, std::size_t run) noexcept {
  const element_range shard = shard_of(range, ranks, r);
  const std::size_t begin = std::min(shard.begin + b * run, shard.end);
  return {begin, std::min(shard.end, begin + run)};
}

/// The runs of sharded buckets over n elements among `ranks` ranks, buckets of bucket_elements:
/// each rank's run is bucket_elements / ranks (at least 1, at most the largest shard), and the
/// buckets cover the largest shard (shard_run places each run).
struct shard_runs {
  std::size_t run = 0, buckets = 0;
};
inline shard_runs shard_runs_of(std::size_t n, int ranks, std::size_t bucket_elements) noexcept {
  const auto p = static_cast<std::size_t>(ranks > 0 ? ranks : 1);
  const std::size_t largest = (n + p - 1) / p;
  if (largest == 0) return {};
  const std::size_t run = std::min(std::max<std::size_t>(1, bucket_elements / p), largest);
  return {run, (largest + run - 1) / run};
}

/// options.exchange.fusion_bytes: 0 (automatic), or room for two elements of `element` bytes and
/// at most 1 GiB (option_error naming the caller and its call, "" or "::gather_shards").
inline void check_fusion_bytes(const char* caller, const char* call, std::size_t asked, std::size_t element) {
  if (asked == 0 || (element * 2 <= asked && asked <= (std::size_t{1} << 30))) return;
  std::string message = caller;
  message.append(call).append(": options.exchange.fusion_bytes is ").append(std::to_string(asked));
  message.append("; it must hold two elements and be at most 1 GiB (or be 0: automatic)");
  throw option_error(message);
}

/// Fusion bytes for a call over `wire` that asked for `asked` (0: the transport's automatic size,
/// grown by the format's ratio so that the encoded bucket, what the messages carry, keeps that
/// size). Buf: the bucket's element type.
template <class Buf, transport Transport>
std::size_t fusion_bytes_for(const Transport& wire, std::size_t asked, compression c) noexcept {
  if (asked != 0) return asked;
  const std::size_t base = wire.automatic_fusion_bytes();
  const codec<Buf> format{c};
  if (!format.encodes()) return base;
  return static_cast<std::size_t>(static_cast<double>(base) * static_cast<double>(sizeof(Buf) * block_values) /
                                  static_cast<double>(format.block_bytes()));
}

/// One bucket's buffers in flight: the fusion buffer (this rank's contributions, then the sums of
/// every rank's), the exchange's room (the others' contributions to this rank's slice; encoded:
/// the bucket's encoding, then those), and the transport's set.
template <class Buf>
struct bucket_buffers {
  Buf* local = nullptr;
  Buf* recv = nullptr;
  std::size_t set = 0;
};

/// What a lossy exchange keeps and draws from (options.exchange): the error feedback's residual
/// (indexed by flat element; null: none) and the stochastic rounding's seed.
struct wire_state {
  float* residual = nullptr;
  std::uint64_t seed = 0;
};

/// The exchange strategy of a call: start (the contributions leave), reduce_and_gather (the
/// contributions to this rank's part summed, the sums sent), finish (every sum here, in the
/// bucket's buffer), progress; room(max_len) is the Buf elements it needs beside a bucket of
/// max_len elements (bucket_buffers::recv).
/// owner_sum: contributions to a slice's owner, summed in rank order, the sums gathered back; in
/// the codec's format (codec.hpp) when it encodes: the owners then own whole blocks, sum the
/// decoded contributions and encode the sum, which every rank, the owner too, decodes.
template <transport Transport, class Buf>
struct owner_sum {
  Transport& wire;
  codec<Buf> format;
  wire_state state;
  gradavg::shared_detail::call_trace* trace = nullptr;  // the call's timeline, or null (timeline.hpp)

  [[nodiscard]] slice_layout layout(const bucket_parts& parts) const noexcept {
    if (format.encodes()) return {parts.blocks(), format.block_bytes(), wire.ranks()};
    return {parts.len(), sizeof(Buf), wire.ranks()};
  }
  [[nodiscard]] std::size_t room(std::size_t max_len) const noexcept {
    const auto p = static_cast<std::size_t>(wire.ranks());
    if (!format.encodes()) return (max_len + p - 1) / p * p;
    // The encoded bucket, then the others' blocks of this rank's slice.
    const std::size_t blocks = bucket_parts::max_blocks(max_len);
    const std::size_t bytes = (blocks + (p - 1) * ((blocks + p - 1) / p)) * format.block_bytes();
    return (bytes + sizeof(Buf) - 1) / sizeof(Buf);
  }

  /// Every other rank's slice of the bucket leaves for its owner; theirs of this rank's arrive.
  void start(const bucket_parts& parts, bucket_buffers<Buf>& b) {
    const slice_layout l = layout(parts);
    if (format.encodes()) {
      std::byte* encoded = reinterpret_cast<std::byte*>(b.recv);
      for (std::size_t k = 0; k < l.len; ++k) encode_contribution(parts, k, b.local, encoded + k * l.element);
      scatter(b, encoded, encoded + l.at(wire.ranks()), l);
      return;
    }
    scatter(b, reinterpret_cast<const std::byte*>(b.local), reinterpret_cast<std::byte*>(b.recv), l);
  }

  /// Waits for the contributions, sums them in rank order into this rank's slice (its own
  /// contribution is there already), and starts the sum's way to every other rank.
  void reduce_and_gather(const bucket_parts& parts, bucket_buffers<Buf>& b) {
    wait(b);
    const slice_layout l = layout(parts);
    if (format.encodes()) {
      reduce_blocks(parts, l, b);
      return;
    }
    sum_slice(l, b);
    gather(b, reinterpret_cast<std::byte*>(b.local), l);
  }

  /// Waits for every slice's sums; decodes them into the bucket's buffer when encoded.
  void finish(const bucket_parts& parts, bucket_buffers<Buf>& b) {
    wait(b);
    if (!format.encodes()) return;
    const slice_layout l = layout(parts);
    const std::byte* encoded = reinterpret_cast<const std::byte*>(b.recv);
    for (std::size_t k = 0; k < l.len; ++k) format.decode_into(encoded + k * l.element, parts.place(k), b.local);
  }
  void progress(bucket_buffers<Buf>& b) { wire.test(b.set); }

  // ---- Sharded output (output_mode::sharded): a bucket is one slot per rank, slot r of slot_len
  // buffer elements holding the run of rank r's shard that parts_of(r) describes (its parts from
  // the slot's start, zeros behind them); each owner keeps the sum of its own slot, in Buf,
  // and nothing is gathered. ----

  /// Blocks of an encoded slot: every slot alike, so that the owners' slices are equal.
  [[nodiscard]] static std::size_t slot_blocks(std::size_t slot_len) noexcept {
    return bucket_parts::max_blocks(slot_len);
  }
  [[nodiscard]] slice_layout slot_layout(std::size_t slot_len) const noexcept {
    const auto p = static_cast<std::size_t>(wire.ranks());
    if (format.encodes()) return {p * slot_blocks(slot_len), format.block_bytes(), wire.ranks()};
    return {p * slot_len, sizeof(Buf), wire.ranks()};
  }
  /// The Buf elements a sharded bucket needs beside its slots (bucket_buffers::recv): the others'
  /// contributions to this rank's slot, and when encoded the bucket's encoding before them.
  [[nodiscard]] std::size_t slot_room(std::size_t slot_len) const noexcept {
    const slice_layout l = slot_layout(slot_len);
    const std::size_t others = static_cast<std::size_t>(wire.ranks() - 1) * l.bytes(0);
    const std::size_t bytes = (format.encodes() ? l.at(wire.ranks()) : 0) + others;
    return (bytes + sizeof(Buf) - 1) / sizeof(Buf);
  }

  /// Every other rank's slot leaves for its owner (encoded slot by slot, with error feedback on
  /// every slot); theirs of this rank's slot arrive.
  template <class PartsOf>
  void start_slots(const PartsOf& parts_of, std::size_t slot_len, bucket_buffers<Buf>& b) {
    const slice_layout l = slot_layout(slot_len);
    if (!format.encodes()) {
      scatter(b, reinterpret_cast<const std::byte*>(b.local), reinterpret_cast<std::byte*>(b.recv), l);
      return;
    }
    std::byte* encoded = reinterpret_cast<std::byte*>(b.recv);
    for (int r = 0; r < wire.ranks(); ++r) {
      const bucket_parts parts = parts_of(r);
      std::byte* slot = encoded + l.at(r);
      const std::size_t used = parts.blocks();
      for (std::size_t k = 0; k < used; ++k)
        encode_contribution(parts, k, b.local + static_cast<std::size_t>(r) * slot_len, slot + k * l.element);
      std::memset(slot + used * l.element, 0, l.bytes(r) - used * l.element);  // sent, never read
    }
    scatter(b, encoded, encoded + l.at(wire.ranks()), l);
  }

  /// Waits for the contributions to this rank's slot (parts: its parts) and sums them in rank
  /// order into the slot, in Buf (decoded first when encoded; the sum is not encoded again).
  void reduce_slot(const bucket_parts& parts, std::size_t slot_len, bucket_buffers<Buf>& b) {
    wait(b);
    const slice_layout l = slot_layout(slot_len);
    if (!format.encodes()) {
      sum_slice(l, b);
      return;
    }
    const int rank = wire.rank(), ranks = wire.ranks();
    const std::byte* encoded = reinterpret_cast<const std::byte*>(b.recv);
    const std::byte* received = encoded + l.at(ranks);
    Buf* out = b.local + static_cast<std::size_t>(rank) * slot_len;
    for (std::size_t k = 0; k < parts.blocks(); ++k) {
      auto block_of = [&](int r) {
        return r == rank ? encoded + l.at(rank) + k * l.element : received + l.received_at(r, rank) + k * l.element;
      };
      const bucket_parts::block_place place = parts.place(k);
      float x[block_values];
      format.decode(block_of(0), x);
      Buf* o = out + place.at;
      for (std::size_t j = 0; j < place.count; ++j) o[j] = static_cast<Buf>(x[j]);
      for (int r = 1; r < ranks; ++r) {
        format.decode(block_of(r), x);
        for (std::size_t j = 0; j < place.count; ++j) o[j] += static_cast<Buf>(x[j]);
      }
    }
  }

 private:
  /// Sums the contributions to this rank's slice of l (received: b.recv, l.received_at) in rank
  /// order into the slice in b.local, where its own contribution is.
  void sum_slice(const slice_layout& l, bucket_buffers<Buf>& b) {
    const int rank = wire.rank(), ranks = wire.ranks();
    const std::size_t mine = l.first(rank + 1) - l.first(rank);
    Buf* out = b.local + l.first(rank);
    auto from = [&](int r) { return b.recv + l.received_at(r, rank) / sizeof(Buf); };
    constexpr std::size_t block = 512;  // elements summed over every rank at a time (in L1)
    Buf own[block];                      // this rank's contribution, kept aside while out is rewritten
    for (std::size_t j0 = 0; j0 < mine; j0 += block) {
      const std::size_t n = std::min(block, mine - j0);
      Buf* o = out + j0;
      if (rank != 0) {
        std::copy(o, o + n, own);
        const Buf* in = from(0) + j0;
        std::copy(in, in + n, o);
      }
      for (int r = 1; r < ranks; ++r) {
        const Buf* in = r == rank ? own : from(r) + j0;
        for (std::size_t j = 0; j < n; ++j) o[j] += in[j];
      }
    }
  }

  /// The residual of the sums in block `place` (null: no error feedback, or not a sums block).
  float* residual_of(const bucket_parts& parts, const bucket_parts::block_place& place) const noexcept {
    return state.residual != nullptr && place.part == 0 ? state.residual + parts.first + place.in_part : nullptr;
  }

  /// Block k of this rank's contribution encoded into `to`; with error feedback, the residual added
  /// into the sums first, and what the encoding dropped kept as the new residual.
  void encode_contribution(const bucket_parts& parts, std::size_t k, Buf* local, std::byte* to) const {
    const bucket_parts::block_place place = parts.place(k);
    float* residual = residual_of(parts, place);
    if (residual != nullptr)
      for (std::size_t j = 0; j < place.count; ++j) local[place.at + j] += static_cast<Buf>(residual[j]);
    format.encode(local, place, to, block_key(state.seed, wire.rank(), 0, parts, place));
    if (residual != nullptr) {
      float sent[block_values];
      format.decode(to, sent);
      for (std::size_t j = 0; j < place.count; ++j) residual[j] = static_cast<float>(local[place.at + j]) - sent[j];
    }
  }

  /// The encoded exchange's sums: each block of this rank's slice of `encoded` (the bucket's
  /// encoding; the others' blocks of the slice behind it) decoded from every rank's encoding,
  /// this rank's own included, summed in rank order in Buf and encoded in place. With error
  /// feedback, what the sum's encoding dropped is added to this rank's residual: the owner sends
  /// it in its next contribution, so it reaches the next step's sum.
  void reduce_blocks(const bucket_parts& parts, const slice_layout& l, bucket_buffers<Buf>& b) {
    std::byte* encoded = reinterpret_cast<std::byte*>(b.recv);
    const int rank = wire.rank(), ranks = wire.ranks();
    const std::byte* received = encoded + l.at(ranks);
    const std::size_t first = l.first(rank), last = l.first(rank + 1);
    for (std::size_t k = first; k < last; ++k) {
      auto block_of = [&](int r) {
        const std::size_t at = (k - first) * l.element;
        return r == rank ? encoded + k * l.element : received + l.received_at(r, rank) + at;
      };
      float x[block_values];
      Buf sum[block_values];  // the slice's sums in Buf, rank order
      format.decode(block_of(0), x);
      for (std::size_t j = 0; j < block_values; ++j) sum[j] = static_cast<Buf>(x[j]);
      for (int r = 1; r < ranks; ++r) {
        format.decode(block_of(r), x);
        for (std::size_t j = 0; j < block_values; ++j) sum[j] += static_cast<Buf>(x[j]);
      }
      const bucket_parts::block_place place = parts.place(k);
      std::byte* to = encoded + k * l.element;
      format.encode(sum, {0, block_values, place.part, place.in_part}, to, block_key(state.seed, rank, 1, parts, place));
      if (float* residual = residual_of(parts, place)) {
        format.decode(to, x);
        for (std::size_t j = 0; j < place.count; ++j) residual[j] += static_cast<float>(sum[j]) - x[j];
      }
    }
    gather(b, encoded, l);
  }

  // The transport's moves and waits, counted and timed on the call's timeline when it has one.
  void scatter(bucket_buffers<Buf>& b, const std::byte* from, std::byte* to, const slice_layout& l) {
    wire.scatter(b.set, from, to, l);
    if (trace != nullptr) {
      const std::size_t own = l.bytes(wire.rank()), others = l.at(wire.ranks()) - own;
      trace->moved(others, own * static_cast<std::size_t>(wire.ranks() - 1));
    }
  }
  void gather(bucket_buffers<Buf>& b, std::byte* bytes, const slice_layout& l) {
    wire.gather(b.set, bytes, l);
    if (trace != nullptr) {
      const std::size_t own = l.bytes(wire.rank()), others = l.at(wire.ranks()) - own;
      trace->moved(own * static_cast<std::size_t>(wire.ranks() - 1), others);
    }
  }
  void wait(bucket_buffers<Buf>& b) {
    if (trace == nullptr) {
      wire.wait(b.set);
      return;
    }
    const std::uint64_t begin = trace->start();
    wire.wait(b.set);
    trace->waited(begin, b.set);
  }
};

}  // namespace detail::processes
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
