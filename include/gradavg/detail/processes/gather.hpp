// gradavg internals: the gather of shards across processes (gradavg::mpi::gather_shards), over
// any transport (exchange.hpp) — each rank's shard of the parameters (output_mode::sharded's
// shards, shard_of) sent to every other rank, in buckets that hold a run of every rank's shard,
// raw or in a wire format (codec.hpp) that every rank, the owner too, decodes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>

#include "agreement.hpp"
#include "codec.hpp"
#include "exchange.hpp"
#include "workspace.hpp"
#include "../access.hpp"
#include "../isa.hpp"
#include "../../errors.hpp"
#include "../../options.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail::processes {

/// One gather of shards: Params the parameters (an output range), T their element type.
template <transport Transport, class Params, class T>
struct gather_call {
  using options_type = typename Transport::options_type;

  Transport& wire;
  Params& params;
  const options_type& opts;
  gradavg::shared_detail::process_buffers& work;
  std::exception_ptr prior = nullptr;  // this rank's failure before the call (its element types)
  int rank = wire.rank(), ranks = wire.ranks();
  std::size_t variables = 0, total = 0;
  std::size_t range_begin = 0, range_end = 0;
  std::size_t slot_elements = 0, buckets = 0;
  bucket_buffers<T> set[2] = {};

  /// The header every rank gathers: what every rank must pass alike.
  enum field : std::size_t { g_variables, g_total, g_sizes, g_type, g_range_begin, g_range_end,
                             g_fusion_bytes, g_compression, g_method, fields };

  codec<T> format() const noexcept { return {opts.exchange.compression}; }
  /// work.words: every rank's header, then each variable's element count and first flat element.
  std::uint64_t* headers() const noexcept { return work.words.data(); }
  std::uint64_t* sizes() const noexcept { return work.words.data() + static_cast<std::size_t>(ranks) * fields; }
  std::size_t size_of(std::size_t i) const noexcept { return static_cast<std::size_t>(sizes()[2 * i]); }
  std::size_t offset_of(std::size_t i) const noexcept { return static_cast<std::size_t>(sizes()[2 * i + 1]); }
  T* data_of(std::size_t i) const noexcept { return static_cast<T*>(work.outputs[i]); }
  slice_layout layout() const noexcept {
    const auto p = static_cast<std::size_t>(ranks);
    if (format().encodes()) return {p * slot_blocks(), format().block_bytes(), ranks};
    return {p * slot_elements, sizeof(T), ranks};
  }
  std::size_t slot_blocks() const noexcept { return (slot_elements + block_values - 1) / block_values; }

  /// This rank's checks, tables and buffers, and the header's counts and fingerprint (fill_header
  /// puts the options). Throws this rank's error; nothing is written.
  void local_checks(std::uint64_t* header) {
    variables = std::ranges::size(params);
    header[g_variables] = variables;
    if (!opts.exchange.residual.empty())
      throw option_error(std::string(Transport::caller) +
                         "::gather_shards: options.exchange.residual is for the averaging calls' error feedback; "
                         "a gather of parameters keeps none");
    gradavg::shared_detail::require_named(opts.exchange.compression, compression::int8, "options.exchange.compression");
    wire.check_options();
    const std::size_t asked = opts.exchange.fusion_bytes;
    check_fusion_bytes(Transport::caller, "::gather_shards", asked, sizeof(T));
    work.words.resize(static_cast<std::size_t>(ranks) * fields + 2 * variables);
    work.outputs.resize(variables);
    std::uint64_t fingerprint = 0xcbf29ce484222325ull;
    for (std::size_t i = 0; i < variables; ++i) {
      const output_read<T> p = read_output<Params, T>(params, i);
      if (p.present && !p.contiguous)
        throw output_error(std::string(Transport::caller) + "::gather_shards: parameter #" + std::to_string(i) +
                               " is not contiguous; the gather writes its elements in storage order",
                           i);
      const std::size_t n = p.present ? p.dims.size() : 0;
      work.outputs[i] = n != 0 ? p.data : nullptr;
      sizes()[2 * i] = n;
      sizes()[2 * i + 1] = total;
      total += n;
      fingerprint = (fingerprint ^ n) * 0x100000001b3ull;
    }
    header[g_total] = total;
    header[g_sizes] = fingerprint;
    range_begin = std::min(opts.compute.range.begin, total);
    range_end = std::max(range_begin, std::min(opts.compute.range.end, total));
    const std::size_t bucket_elements =
        std::max<std::size_t>(1, fusion_bytes_for<T>(wire, asked, opts.exchange.compression) / sizeof(T));
    const shard_runs runs = shard_runs_of(range_end - range_begin, ranks, bucket_elements);
    slot_elements = runs.run;
    buckets = runs.buckets;
    if (buckets != 0) {
      const std::size_t bytes = layout().at(ranks);
      const std::size_t set_elements = (bytes + sizeof(T) - 1) / sizeof(T);
      const std::size_t sets = std::min<std::size_t>(2, buckets);
      work.buffers.resize(sets * set_elements * sizeof(T));
      T* base = reinterpret_cast<T*>(work.buffers.data());
      wire.reserve(sets);
      for (std::size_t s = 0; s < sets; ++s) set[s] = {base + s * set_elements, nullptr, s};
    }
  }

  void fill_header(std::uint64_t* header) const noexcept {
    header[g_type] = type_code<T>();
    header[g_range_begin] = opts.compute.range.begin;
    header[g_range_end] = opts.compute.range.end;
    header[g_fusion_bytes] = opts.exchange.fusion_bytes;
    header[g_compression] = static_cast<std::uint64_t>(opts.exchange.compression);
    header[g_method] = wire.method_code();
  }

  /// Throws the error every rank agrees on from the gathered headers, if any.
  void agree(const std::uint64_t* all) const {
    auto value = [&](int r, field f) { return all[static_cast<std::size_t>(r) * fields + f]; };
    struct named {
      field f;
      const char* what;
    };
    for (const named& n : {named{g_variables, "parameter count"}, named{g_total, "total of parameter elements"},
                           named{g_sizes, "list of parameter element counts"},
                           named{g_type, "parameter element type"}, named{g_range_begin, "options.compute.range"},
                           named{g_range_end, "options.compute.range"},
                           named{g_fusion_bytes, "options.exchange.fusion_bytes"},
                           named{g_compression, "options.exchange.compression"},
                           named{g_method, "options.exchange.method"}}) {
      bool differ = false;
      for (int r = 1; r < ranks; ++r) differ = differ || value(r, n.f) != value(0, n.f);
      if (!differ) continue;
      const rank_split d = split_ranks(ranks, [&](int q) { return value(q, n.f); }, [](int) { return true; });
      std::string message = Transport::caller;
      message.append("::gather_shards: ").append(rank_list(d.odd)).append(" ").append(verb_s(d.odd, "passes", "pass"));
      message.append(" a different ").append(n.what).append(" than ").append(rank_list(d.common));
      message.append("; every rank must pass the same");
      if (n.f == g_variables || n.f == g_total || n.f == g_sizes) throw shape_error(message);
      throw option_error(message);
    }
  }

  /// Calls f(data, begin, end) for each run of one variable in the flat elements [begin, end):
  /// the variable's data from its element `begin` on, `end - begin` elements.
  template <class F>
  void for_each_run(std::size_t begin, std::size_t end, const F& f) const {
    for (std::size_t i = first_variable_after(sizes(), variables, begin); i < variables && offset_of(i) < end; ++i) {
      if (size_of(i) == 0) continue;
      const std::size_t a = std::max(begin, offset_of(i)), b = std::min(end, offset_of(i) + size_of(i));
      if (a < b) f(data_of(i) + (a - offset_of(i)), a, b);
    }
  }

  /// Rank r's run of bucket b: flat elements [begin, end) of its shard.
  element_range run_of(std::size_t b, int r) const noexcept {
    return shard_run({range_begin, range_end}, ranks, r, b, slot_elements);
  }

  /// The values of flat elements [begin, end) copied into `to`.
  void read_run(std::size_t begin, std::size_t end, T* to) const {
    for_each_run(begin, end, [&](const T* from, std::size_t a, std::size_t e) {
      std::copy(from, from + (e - a), to + (a - begin));
    });
  }
  /// `from` written into flat elements [begin, end), converted from F.
  template <class F>
  void write_run(std::size_t begin, std::size_t end, const F* from) const {
    for_each_run(begin, end, [&](T* to, std::size_t a, std::size_t e) {
      for (std::size_t j = a; j < e; ++j) to[j - a] = static_cast<T>(from[j - begin]);
    });
  }

  /// This rank's run of bucket b into its slot, encoded block by block when the format encodes,
  /// and the gather started.
  void start(std::size_t b, bucket_buffers<T>& s) {
    const slice_layout l = layout();
    const element_range run = run_of(b, rank);
    std::byte* bytes = reinterpret_cast<std::byte*>(s.local);
    if (!format().encodes()) {
      read_run(run.begin, run.end, s.local + static_cast<std::size_t>(rank) * slot_elements);
    } else {
      const bucket_parts parts{{run.end - run.begin, 0, 0}, run.begin};
      const std::size_t used = parts.blocks();
      std::byte* to = bytes + l.at(rank);
      T values[block_values];
      for (std::size_t k = 0; k < used; ++k) {
        const bucket_parts::block_place place = parts.place(k);
        read_run(run.begin + place.at, run.begin + place.at + place.count, values);
        format().encode(values, {0, place.count, 0, place.in_part}, to + k * l.element,
                        block_key(opts.exchange.seed, rank, 1, parts, place));
      }
      std::memset(to + used * l.element, 0, l.bytes(rank) - used * l.element);  // sent, never read
    }
    wire.gather(s.set, bytes, l);
  }

  /// Waits for bucket b's gather; every other rank's run (with a format, every rank's, this
  /// rank's too) written into the parameters.
  void finish(std::size_t b, bucket_buffers<T>& s) {
    wire.wait(s.set);
    const slice_layout l = layout();
    const std::byte* bytes = reinterpret_cast<const std::byte*>(s.local);
    for (int r = 0; r < ranks; ++r) {
      const element_range run = run_of(b, r);
      if (!format().encodes()) {
        if (r != rank) write_run(run.begin, run.end, s.local + static_cast<std::size_t>(r) * slot_elements);
        continue;
      }
      const bucket_parts parts{{run.end - run.begin, 0, 0}, run.begin};
      for (std::size_t k = 0; k < parts.blocks(); ++k) {
        const bucket_parts::block_place place = parts.place(k);
        float x[block_values];
        format().decode(bytes + l.at(r) + k * l.element, x);
        write_run(run.begin + place.at, run.begin + place.at + place.count, x);
      }
    }
  }

  /// The call: this rank's checks; collective 1 (one word on the stack: the lowest rank whose
  /// checks failed, thrown on every rank before anything is written); collective 2, the
  /// headers (what every rank passes alike); then the buckets, two in flight.
  void operator()() {
    std::uint64_t header[fields] = {};
    fill_header(header);
    std::exception_ptr own = prior;
    try {
      if (!own) local_checks(header);
    } catch (...) {
      own = std::current_exception();
    }
    std::uint64_t failed = own ? static_cast<std::uint64_t>(rank) : static_cast<std::uint64_t>(ranks);
    wire.min_words(&failed, 1);
    if (own) std::rethrow_exception(own);
    if (failed < static_cast<std::uint64_t>(ranks))
      throw remote_error(std::string(Transport::caller) + "::gather_shards: rank " + std::to_string(failed) +
                         " failed its own checks (see the error thrown there); nothing was written on any rank");
    wire.gather_words(header, headers(), fields);
    agree(headers());
    for (std::size_t b = 0; b < buckets + 1; ++b) {
      if (b < buckets) start(b, set[b % 2]);
      if (b >= 1) finish(b - 1, set[(b - 1) % 2]);
    }
    wire.rethrow_noted();
  }
};
/// The element type of run-time typed parameters: the present ones' (float32 or float64, every
/// one the same; element_type_error otherwise). float32 when none is present.
template <class Params>
element_type parameters_element(const char* caller, Params& params) {
  using P = output_tensor_t<Params&>;
  element_type found = element_type::float32;
  std::size_t first = error::npos;
  for (std::size_t i = 0; i < std::ranges::size(params); ++i) {
    auto&& s = at(params, i);
    if (!slot_present(s)) continue;
    const element_type e = tensor_traits<P>::element(slot_get(s));
    if (e != element_type::float32 && e != element_type::float64)
      throw element_type_error(std::string(caller) + "::gather_shards: parameter #" + std::to_string(i) + " holds " +
                                   std::string(element_name(e)) + "; the gather takes float32 or float64 parameters",
                               i);
    if (first == error::npos) {
      first = i;
      found = e;
    } else if (e != found) {
      throw element_type_error(std::string(caller) + "::gather_shards: parameter #" + std::to_string(i) + " holds " +
                                   std::string(element_name(e)) + " but parameter #" + std::to_string(first) + " " +
                                   std::string(element_name(found)) + "; every parameter holds one element type",
                               i);
    }
  }
  return found;
}

/// gather_shards over wire: the parameters' element type (float or double; static, or the
/// run-time one of the present parameters).
template <transport Transport, class Params>
void gather_shards(Transport& wire, gradavg::shared_detail::process_buffers& work, Params& params,
                   const typename Transport::options_type& opts) {
  using P = output_tensor_t<Params&>;
  static_assert(outputs_outlive_reads<Params&>, "gradavg: parameters yielded by value must be views");
  if constexpr (static_tensor<P>) {
    static_assert(std::is_same_v<tensor_value_t<P>, float> || std::is_same_v<tensor_value_t<P>, double>,
                  "gradavg: gather_shards takes parameters of float or double elements (a tensor_traits value_type)");
    gather_call<Transport, Params, tensor_value_t<P>>{wire, params, opts, work}();
  } else {
    // A rank whose element types cannot be read still takes part in the collectives (prior);
    // ranks of other element types disagree in the headers (g_type).
    element_type e = element_type::float32;
    std::exception_ptr prior;
    try {
      e = parameters_element(Transport::caller, params);
    } catch (...) {
      prior = std::current_exception();
    }
    if (e == element_type::float64)
      gather_call<Transport, Params, double>{wire, params, opts, work, prior}();
    else
      gather_call<Transport, Params, float>{wire, params, opts, work, prior}();
  }
}

}  // namespace detail::processes
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
