// gradavg internals: the data path of one call across processes — this rank's tables and fusion
// buffers, then the buckets' fill, exchange and unpack (the file comment of <gradavg/mpi.hpp>
// describes them), over any transport (exchange.hpp). call.hpp's call runs it once every rank
// has agreed.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "agreement.hpp"
#include "exchange.hpp"
#include "workspace.hpp"
#include "../into.hpp"
#include "../isa.hpp"
#include "../choices.hpp"
#include "../ordered_statistics.hpp"
#include "../trace.hpp"
#include "../../errors.hpp"
#include "../../statistics.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail::processes {

/// The data path of one call over Transport: TG the towers, Means/Squares the output ranges
/// (Squares = no_outputs: none), S and O the element types the gradients are read as and the
/// outputs written as (value_types, or the run-time types this rank found), Buf the fusion
/// buffer's element type.
template <transport Transport, class TG, class Means, class Squares, class S, class O>
struct data_path {
  using Buf = gradavg::detail::accumulator_t<S>;
  using options_type = typename Transport::options_type;
  using exchange_type = owner_sum<Transport, Buf>;  // the exchange strategy
  static constexpr bool with_squares = gradavg::detail::outputs_passed<Squares>;

  Transport& wire;
  const TG& tg;
  Means& means;
  Squares* squares;
  const options_type& opts;
  gradavg::shared_detail::process_buffers& work;
  const gradavg::options local = opts.local();  // the groups the one-process code takes
  int rank = wire.rank(), ranks = wire.ranks();
  std::size_t towers = 0, variables = 0;

  /// The parts of work.words (sized by local_checks).
  word_layout words() noexcept { return {work.words.data(), static_cast<std::size_t>(ranks), variables}; }
  /// The divisor from the gathered headers (agreement.hpp).
  double total_weight(const std::uint64_t* all) const noexcept { return weight_sum_of(all, ranks); }

  /// The towers of one variable from element `offset` on, for the kernel's tower_reader.
  struct piece_towers {
    const void* const* towers;
    std::size_t offset;
    static const S* first_element(const void* context, std::size_t k) {
      const auto* self = static_cast<const piece_towers*>(context);
      return static_cast<const S*>(self->towers[k]) + self->offset;
    }
  };

  using bucket_set = bucket_buffers<Buf>;

  // ---- Preparation: every table and buffer the data path uses, before any collective. ----

  std::uint64_t* sizes = nullptr;  // each variable's element count and first flat element
  std::size_t total = 0;            // elements of the variables present on every local tower
  std::size_t range_begin = 0, range_end = 0;
  element_range own{0, 0};  // the elements this rank's outputs receive (summary::shard)
  std::size_t bucket_elements = 0, buckets = 0;
  std::size_t slot_elements = 0, slot_len = 0;  // output_mode::sharded: a slot's run and buffer elements
  bool stream_outputs = false;  // options.run.stores decided for this rank's data (prepare())
  bucket_set set[3] = {};
  gradavg::shared_detail::call_trace trace = {};  // options.run.timeline's events and profile (trace.hpp)
  /// The line options.run.log gets (run()): at info when this call proves a plan (call.hpp).
  log_level log_at = log_level::debug;
  const char* log_what = "call";
  bool squares_in_buffer() const noexcept { return with_squares || opts.compute.statistics; }
  bool detect() const noexcept { return opts.compute.on_nonfinite != nonfinite_policy::ignore; }
  bool sharded() const noexcept { return opts.exchange.output == output_mode::sharded; }

  /// This rank's tables (tower pointers, outputs, sizes and offsets, per-variable sums) and fusion
  /// buffers, from the table of buffers its checks recorded (validate_into's layout, or its
  /// plan's): a variable present on tower 0 is taken as averaged (agreement throws before the
  /// data path where that is not so on every tower of every rank). layout null: the checks found
  /// a gradient missing on some of this rank's towers, so agreement fails; the tables are sized,
  /// and empty. Every allocation of the call after validation happens here, before the first
  /// collective, so that a failure here reaches every rank through it.
  void prepare(const gradavg::shared_detail::buffer_table* layout) {
    work.towers.resize(variables * towers);
    work.outputs.resize(2 * variables);
    work.nonfinite.resize(variables);
    sizes = words().sizes();
    total = 0;
    for (std::size_t i = 0; i < variables; ++i) {
      const std::size_t size = layout != nullptr && towers != 0 ? layout->elements[i] : 0;
      for (std::size_t k = 0; k < towers; ++k) work.towers[i * towers + k] = size != 0 ? layout->row(i)[k] : nullptr;
      work.outputs[2 * i] = size != 0 ? layout->buffer<std::byte>(i, towers) : nullptr;
      work.outputs[2 * i + 1] = size != 0 && with_squares ? layout->buffer<std::byte>(i, towers + 1) : nullptr;
      sizes[2 * i] = size;
      sizes[2 * i + 1] = total;
      total += size;
      work.nonfinite[i] = 0;
    }
    if (layout != nullptr) check_residual();
    range_begin = std::min(opts.compute.range.begin, total);
    range_end = std::min(opts.compute.range.end, total);
    own = {std::min(range_begin, range_end), range_end};
    if (sharded()) own = shard_of(own, ranks, rank);
    buckets = 0;
    // The last collective: one word, and with sharded output and detection the variables'
    // non-finite flags, a bit each (data_path::run).
    work.outcome.resize(1 + (sharded() && detect() ? (variables + 63) / 64 : 0));
    // The rank's reads of its towers and writes of its outputs decide the stores
    // (options.run.stores).
    const std::size_t element_traffic = towers * sizeof(S) + (with_squares ? 2 : 1) * sizeof(O);
    stream_outputs = gradavg::detail::streams(local, (own.end - own.begin) * element_traffic);
    if (range_begin >= range_end) return;

    // Buckets: E elements each (means and squares), a flag per variable touching it behind them.
    const std::size_t per_element = sizeof(Buf) * (squares_in_buffer() ? 2 : 1);
    const std::size_t fusion_bytes = fusion_bytes_for<Buf>(wire, opts.exchange.fusion_bytes, opts.exchange.compression);
    bucket_elements = std::max<std::size_t>(1, fusion_bytes / per_element);
    const std::size_t n = range_end - range_begin;
    std::size_t max_len = 0, room = 0;
    if (sharded()) {
      // Bucket b: the b-th run of slot_elements of every rank's shard, in slots of slot_len.
      const shard_runs runs = shard_runs_of(n, ranks, bucket_elements);
      slot_elements = runs.run;
      buckets = runs.buckets;
      const std::size_t max_flags = detect() ? std::min(variables, slot_elements) + 1 : 0;
      slot_len = slot_elements * (squares_in_buffer() ? 2 : 1) + max_flags;
      max_len = static_cast<std::size_t>(ranks) * slot_len;
      room = exchange().slot_room(slot_len);
    } else {
      buckets = (n + bucket_elements - 1) / bucket_elements;
      // Most variables one bucket can touch: bounded by its elements and by the variable count.
      const std::size_t max_flags = detect() ? std::min(variables, bucket_elements) + 1 : 0;
      max_len = std::min(bucket_elements, n) * (squares_in_buffer() ? 2 : 1) + max_flags;
      room = exchange().room(max_len);
    }
    const std::size_t sets = std::min<std::size_t>(3, buckets);
    const std::size_t set_elements = max_len + room;
    work.buffers.resize(sets * set_elements * sizeof(Buf));  // new[]: aligned for any Buf
    Buf* base = reinterpret_cast<Buf*>(work.buffers.data());
    wire.reserve(sets);
    for (std::size_t s = 0; s < sets; ++s) set[s] = {base + s * set_elements, base + s * set_elements + max_len, s};
  }

  /// options.exchange.residual: empty, or one float per element of the flat range with a lossy
  /// compression (option_error).
  void check_residual() const {
    const std::size_t n = opts.exchange.residual.size();
    if (n == 0) return;
    if (opts.exchange.compression == compression::none)
      throw option_error(std::string(Transport::caller) +
                         ": options.exchange.residual (error feedback) is passed but options.exchange.compression "
                         "is none; it keeps what a lossy format drops");
    if (n != total)
      throw option_error(std::string(Transport::caller) + ": options.exchange.residual holds " + std::to_string(n) +
                         " floats; it must hold one per element of the averaged variables, " + std::to_string(total));
  }

  // ---- The data path, after agreement: tables and buffers only, no tensor_traits call and no
  // allocation. Its one source of exceptions, the executor (user code) running the kernel, is
  // answered by zeros in this rank's place and the last collective. ----

  /// One bucket: its flat element range and its buffer's layout.
  struct bucket_shape {
    std::size_t begin, end;       // flat
    std::size_t first_variable;   // the first variable with an element in it
    bucket_parts parts;           // its buffer: sums, squares' sums, a flag per variable in it (detect)
  };
  static constexpr std::size_t piece_elements = std::size_t{1} << 16;  // between progress calls

  /// Set by run(): the global weight sum (the divisor), the fused parameters, and the count of
  /// finished variables with a non-finite input.
  double weight_sum = 0;
  bool fused = false;
  gradavg::detail::fused_params<Buf> params{};
  std::size_t nonfinite_variables = 0;

  bool zero_nonfinite() const noexcept { return opts.compute.on_nonfinite == nonfinite_policy::zero; }
  std::size_t element_bytes() const noexcept { return sizeof(Buf) * (squares_in_buffer() ? 2 : 1); }
  std::size_t set_count() const noexcept { return std::min<std::size_t>(3, buckets); }
  /// How a bucket's contributions move and are summed (exchange.hpp).
  exchange_type exchange() noexcept {
    float* residual = opts.exchange.residual.empty() ? nullptr : opts.exchange.residual.data();
    return {wire, {opts.exchange.compression}, {residual, opts.exchange.seed}, trace.on() ? &trace : nullptr};
  }
  /// Variable i's element count and first flat element (prepare()'s table).
  std::size_t size_of(std::size_t i) const noexcept { return static_cast<std::size_t>(sizes[2 * i]); }
  std::size_t offset_of(std::size_t i) const noexcept { return static_cast<std::size_t>(sizes[2 * i + 1]); }

  /// The shape of the run of flat elements [begin, end), its first variable found by search.
  bucket_shape shape_of_run(std::size_t begin, std::size_t end) const {
    bucket_shape sh;
    sh.begin = begin;
    sh.end = end;
    sh.first_variable = first_variable_after(sizes, variables, begin);
    std::size_t flags = 0;
    for (std::size_t v = sh.first_variable; v < variables && offset_of(v) < end; ++v) flags += size_of(v) != 0 ? 1 : 0;
    const std::size_t elements = end - begin;
    sh.parts = {{elements, squares_in_buffer() ? elements : 0, detect() && elements != 0 ? flags : 0}, begin};
    return sh;
  }

  /// Bucket b of the range (replicated output).
  bucket_shape shape_of_bucket(std::size_t b) const {
    const std::size_t begin = range_begin + b * bucket_elements;
    return shape_of_run(begin, std::min(range_end, begin + bucket_elements));
  }

  /// Sharded output: slot r of bucket b, the b-th run of slot_elements of rank r's shard (empty
  /// past its end).
  bucket_shape slot_shape(std::size_t b, int r) const {
    const element_range run = shard_run({range_begin, range_end}, ranks, r, b, slot_elements);
    return shape_of_run(run.begin, run.end);
  }

  /// Bytes this rank's pass reads and writes: its towers' gradients over the range, its outputs
  /// over the elements it receives (call_profile::local_bytes).
  std::uint64_t local_bytes() const noexcept {
    return static_cast<std::uint64_t>(towers * sizeof(S) * (range_end - range_begin) +
                                      (with_squares ? 2 : 1) * sizeof(O) * (own.end - own.begin));
  }

  /// Progress of the buckets in flight while the kernel runs (exchange.hpp: transport::test).
  void progress() {
    for (std::size_t s = 0; s < set_count(); ++s) exchange().progress(set[s]);
  }

  /// Sums elements [lo, hi) of a bucket into its buffer; with_progress: between pieces, let the
  /// transport move the buckets in flight (only on the calling thread: MPI, for one, may be
  /// initialised for it alone).
  void fill_range(const bucket_shape& sh, Buf* buffer, std::size_t lo, std::size_t hi, bool with_progress) {
    const std::size_t elements = sh.end - sh.begin;
    Buf* sums = buffer;
    Buf* sq = squares_in_buffer() ? buffer + elements : nullptr;
    Buf* flags = buffer + elements * (squares_in_buffer() ? 2 : 1);
    const bool prefetch = gradavg::detail::prefetch_pays(elements, towers * sizeof(S) + element_bytes());
    std::size_t flag = 0;  // the flag of variable i: its position among the bucket's variables
    for (std::size_t i = sh.first_variable; i < variables && offset_of(i) < hi; ++i) {
      const std::size_t size = size_of(i);
      if (size == 0) continue;
      if (offset_of(i) + size <= lo) {
        ++flag;
        continue;
      }
      const std::size_t begin = std::max(offset_of(i), lo) - offset_of(i);
      const std::size_t end = std::min(offset_of(i) + size, hi) - offset_of(i);
      bool nonfinite = false;
      const void* const* tp = work.towers.data() + i * towers;
      for (std::size_t p = begin; p < end; p += piece_elements) {
        const std::size_t q = std::min(end, p + piece_elements);
        const std::size_t at = offset_of(i) + p - sh.begin;
        const piece_towers from{tp, p};
        const gradavg::detail::tower_reader<S> tower_data{&from, &piece_towers::first_element};
        const auto piece = gradavg::detail::reduce_range<S, Buf, Buf>(
            tower_data, towers, 0, q - p, sums + at, sq ? sq + at : nullptr, false, prefetch, Buf(1),
            fused ? &params : nullptr);
        nonfinite = nonfinite || (fused && piece.nonfinite);
        if (with_progress) progress();
      }
      // A variable split between chunks has its flag set by any of them (never cleared).
      if (detect() && nonfinite) std::atomic_ref<Buf>(flags[flag]).store(Buf(1), std::memory_order_relaxed);
      ++flag;
    }
  }

  /// Fills a bucket of `runs` runs of flat elements: run r shaped shape_of(r), at buffer + r * stride
  /// (stride 0: one run), its flags and the rest of its stride zeroed. options.run.threads / pool:
  /// the runs' elements, end to end, split into chunks (the sums do not depend on the split).
  template <class ShapeOf>
  void fill_runs(int runs, const ShapeOf& shape_of, Buf* buffer, std::size_t stride) {
    std::size_t elements = 0;
    for (int r = 0; r < runs; ++r) {
      const bucket_shape sh = shape_of(r);
      Buf* run = buffer + static_cast<std::size_t>(r) * stride;
      const std::size_t e = sh.end - sh.begin;
      std::fill(run + e * (squares_in_buffer() ? 2 : 1), run + std::max(sh.parts.len(), stride), Buf(0));
      elements += e;
    }
    const std::size_t chunks =
        gradavg::detail::chunk_count(elements, towers * sizeof(S) + element_bytes(), local);
    auto chunk = [&](std::size_t c, bool with_progress) {
      const std::size_t lo = elements * c / chunks, hi = elements * (c + 1) / chunks;
      std::size_t at = 0;  // where run r begins among the runs' elements
      for (int r = 0; r < runs && at < hi; ++r) {
        const bucket_shape sh = shape_of(r);
        const std::size_t e = sh.end - sh.begin;
        const std::size_t from = std::max(lo, at), to = std::min(hi, at + e);
        if (from < to)
          fill_range(sh, buffer + static_cast<std::size_t>(r) * stride, sh.begin + (from - at), sh.begin + (to - at),
                     with_progress);
        at += e;
      }
    };
    if (chunks <= 1) {
      chunk(0, true);
      return;
    }
    auto threaded = [&](std::size_t c) { chunk(c, false); };
    gradavg::detail::run_chunks(chunks, threaded, local);
  }

  /// A variable whose last element in the range has been written: zeroed when the policy says,
  /// reported (segment_walk.hpp: finish_variable, as the one-process pass finishes it). sums:
  /// its statistics (options.compute.statistics), or null.
  void finish_variable(std::size_t i, gradavg::detail::piece_result* sums) {
    gradavg::detail::piece_result r = sums != nullptr ? *sums : gradavg::detail::piece_result{};
    r.nonfinite = work.nonfinite[i] != 0;
    if (zero_nonfinite() && r.nonfinite)
      gradavg::detail::zero_outputs(static_cast<O*>(work.outputs[2 * i]), static_cast<O*>(work.outputs[2 * i + 1]),
                                    gradavg::detail::covered_by(offset_of(i), size_of(i), own.begin, own.end));
    gradavg::detail::finish_variable(opts.compute, i, r);
    if (sums != nullptr) *sums = r;
    nonfinite_variables += r.nonfinite ? 1 : 0;
  }

  /// Divides a bucket's sums (buffer: laid out as sh.parts says) into the outputs, adds their
  /// statistics to stats, finishes the variables whose last element it holds (sharded output:
  /// after the last collective, run()).
  template <class Acc>
  void unpack(const bucket_shape& sh, const Buf* buffer, gradavg::detail::flat_statistics<Acc>& stats) {
    const Acc divisor = static_cast<Acc>(weight_sum);
    bool streamed = false;  // non-temporal stores made: fenced before the outputs are read
    const std::size_t elements = sh.end - sh.begin;
    const Buf* sums = buffer;
    const Buf* sq = buffer + elements;
    const Buf* flags = buffer + elements * (squares_in_buffer() ? 2 : 1);
    std::size_t flag = 0;
    for (std::size_t i = sh.first_variable; i < variables && offset_of(i) < sh.end; ++i) {
      const std::size_t size = size_of(i);
      if (size == 0) continue;
      const std::size_t begin = std::max(offset_of(i), sh.begin) - offset_of(i);
      const std::size_t end = std::min(offset_of(i) + size, sh.end) - offset_of(i);
      const std::size_t at = offset_of(i) + begin - sh.begin;
      O* m = static_cast<O*>(work.outputs[2 * i]) + begin;
      O* q = work.outputs[2 * i + 1] ? static_cast<O*>(work.outputs[2 * i + 1]) + begin : nullptr;
      const std::size_t len = end - begin;
      // Branch-free loops the compiler vectorises; a NaN result is the default quiet NaN.
      constexpr Acc nan = std::numeric_limits<Acc>::quiet_NaN();
      auto divide_into = [&](const Buf* from, O* to) {
        if constexpr (std::is_same_v<Buf, Acc> && std::is_same_v<O, Acc>) {
          if (stream_outputs) {
            // The same quotients, stored around the caches.
            gradavg::detail::stream_quotients<Acc>(from, to, len, divisor);
            streamed = true;
            return;
          }
        }
        for (std::size_t j = 0; j < len; ++j) {
          const Acc x = static_cast<Acc>(from[j]) / divisor;
          to[j] = static_cast<O>(x == x ? x : nan);
        }
      };
      divide_into(sums + at, m);
      if (q) divide_into(sq + at, q);
      if (detect() && flags[flag++] != Buf(0)) work.nonfinite[i] = 1;
      if (opts.compute.statistics) {
        // From the values in Acc, before any rounding to O, in the one-process pass's order
        // (ordered_statistics.hpp): the same bits whatever the bucket size.
        auto value = [&](std::size_t j) {
          const Acc mean = static_cast<Acc>(sums[at + j]) / divisor;
          const Acc square = static_cast<Acc>(sq[at + j]) / divisor;
          return std::pair{mean == mean ? mean : nan, square == square ? square : nan};
        };
        const std::size_t first = std::max(offset_of(i), range_begin);
        const std::size_t last = std::min(offset_of(i) + size, range_end);
        stats.add(i, first, last, offset_of(i) + begin, offset_of(i) + end, value,
                  [&](std::size_t v, gradavg::detail::piece_result& r) { finish_variable(v, &r); });
      } else if (!sharded() && (offset_of(i) + size <= sh.end || sh.end == range_end)) {
        finish_variable(i, nullptr);
      }
    }
    if (streamed) gradavg::detail::streaming_fence();
    progress();
  }

  /// The summary's counts from the gathered headers and the reduced per-variable words, and the
  /// divisor (weight_sum): the same on every rank.
  summary counts() {
    const std::uint64_t* headers = words().headers();
    summary result;
    for (int r = 0; r < ranks; ++r) {
      result.towers += headers[static_cast<std::size_t>(r) * header_words + h_towers];
      result.weighted_towers += headers[static_cast<std::size_t>(r) * header_words + h_weighted_towers];
    }
    weight_sum = total_weight(headers);
    const std::uint64_t* reduced = words().reduced();
    for (std::size_t i = 0; i < variables; ++i)
      result.averaged += reduced[i * variable_words + v_state] == present_everywhere ? 1 : 0;
    result.skipped = variables - result.averaged;
    result.statistics = opts.compute.statistics;
    result.shard = own;
    if (range_begin != 0 || range_end != total)
      result.averaged = gradavg::detail::variables_in_range(
          variables, [&](std::size_t i) { return size_of(i); }, range_begin, range_end);
    return result;
  }

  /// Every bucket filled, exchanged, gathered and unpacked (its statistics into stats), three in
  /// flight: bucket b filled while b-1 is exchanged and b-2 gathered. After an exception in this
  /// rank's kernel its contributions are zeros, so that the messages every rank waits for flow;
  /// the exception is returned.
  template <class Acc>
  std::exception_ptr pipeline(gradavg::detail::flat_statistics<Acc>& stats) {
    std::exception_ptr failure;
    bucket_shape shapes[3];
    for (std::size_t b = 0; b < buckets + 2; ++b) {
      if (b < buckets) {
        const std::uint64_t began = trace.start();
        bucket_set& bs = set[b % 3];
        shapes[b % 3] = sharded() ? slot_shape(b, rank) : shape_of_bucket(b);
        const std::size_t len = sharded() ? static_cast<std::size_t>(ranks) * slot_len : shapes[b % 3].parts.len();
        if (!failure) {
          try {
            if (sharded())
              fill_runs(ranks, [&](int r) { return slot_shape(b, r); }, bs.local, slot_len);
            else
              fill_runs(1, [&](int) { return shapes[b % 3]; }, bs.local, 0);
          } catch (...) {
            failure = std::current_exception();
          }
        }
        if (failure) std::fill(bs.local, bs.local + len, Buf(0));
        if (sharded())
          exchange().start_slots([&](int r) { return slot_shape(b, r).parts; }, slot_len, bs);
        else
          exchange().start(shapes[b % 3].parts, bs);
        trace.local("fill", began, b);
        trace.departed(b);
      }
      if (b >= 1 && b - 1 < buckets) {
        const std::uint64_t began = trace.start();
        bucket_set& bs = set[(b - 1) % 3];
        if (sharded()) {
          exchange().reduce_slot(shapes[(b - 1) % 3].parts, slot_len, bs);
          trace.arrived(b - 1, b - 1);
          trace.local("sum", began, b - 1);
        } else {
          exchange().reduce_and_gather(shapes[(b - 1) % 3].parts, bs);
          trace.local("sum", began, b - 1, 1);  // the bucket itself is on the wire
        }
      }
      if (b >= 2) {
        const std::uint64_t began = trace.start();
        bucket_set& bs = set[(b - 2) % 3];
        const bucket_shape& sh = shapes[(b - 2) % 3];
        if (sharded()) {
          if (sh.end > sh.begin) unpack<Acc>(sh, bs.local + static_cast<std::size_t>(rank) * slot_len, stats);
        } else {
          exchange().finish(sh.parts, bs);
          trace.arrived(b - 2, b - 2);
          unpack<Acc>(sh, bs.local, stats);
        }
        trace.local("unpack", began, b - 2);
      }
    }
    return failure;
  }

  /// Sharded output: every variable with elements in the range finished, its non-finite flag
  /// every rank's (flags: the last collective's complements; none without detection).
  void finish_shard(const std::uint64_t* flags, std::size_t flag_words) {
    for (std::size_t i = 0; i < variables; ++i) {
      if (size_of(i) == 0 || offset_of(i) + size_of(i) <= range_begin || offset_of(i) >= range_end) continue;
      if (flag_words != 0) work.nonfinite[i] = (flags[i / 64] >> (i % 64) & 1) == 0 ? 1 : 0;
      finish_variable(i, nullptr);
    }
  }

  /// Writes what this call chose to options.run.log at log_at, where it takes that level:
  /// choices.hpp's words for this rank's part, then the buckets and the exchange. Runs between
  /// the collectives, where a rank must not throw alone: a line that cannot be built (no memory)
  /// or that the sink throws on is dropped.
  void log_choices(const summary& counted) const noexcept {
    if (opts.run.log == nullptr || !opts.run.log->enabled(log_at)) return;
    try {
      write_choices(counted);
    } catch (...) {
    }
  }
  void write_choices(const summary& counted) const {
    static constexpr const char* formats[] = {"none", "bfloat16", "float16", "int8"};
    const auto format = static_cast<std::size_t>(opts.exchange.compression);
    const std::size_t n = range_end > range_begin ? range_end - range_begin : 0;
    std::string line = std::string(Transport::caller) + ": rank " + std::to_string(rank) + " of " +
                       std::to_string(ranks) + ": " + log_what + ": " +
                       gradavg::detail::choices_line<S, O>(local, variables, counted.averaged, counted.skipped, n, towers,
                                                           with_squares, static_cast<std::size_t>(local_bytes()));
    line += ", " + std::to_string(counted.towers) + " towers in all; " + std::to_string(buckets) +
            (buckets == 1 ? " bucket" : " buckets") + " of at most " + std::to_string(bucket_elements * element_bytes()) +
            " bytes, exchange method " +
            std::to_string(wire.method_code()) + ", wire format " + (format < 4 ? formats[format] : "?") +
            ", output " + (sharded() ? "sharded" : "replicated");
    opts.run.log->write(log_at, line);
  }

  /// The data path: the pipeline over every bucket, then the last collective (the lowest rank
  /// whose kernel failed, if any), and the call's summary.
  template <class Acc>
  summary run() {
    summary result = counts();
    log_choices(result);
    if (range_begin >= range_end) {
      if (opts.compute.statistics) result.sum_mean_squared = result.sum_mean_of_squares = 0;
      trace.end_call(0);
      return result;
    }
    const double* weights = opts.compute.weights.empty() ? nullptr : opts.compute.weights.data();
    fused = weights != nullptr || opts.compute.scale != 1.0 || detect();
    params = {weights, opts.compute.scale, static_cast<Buf>(opts.compute.scale), detect(), false};
    nonfinite_variables = 0;
    gradavg::detail::flat_statistics<Acc> stats(range_begin, range_end);
    const std::exception_ptr failure = pipeline<Acc>(stats);
    // The last collective (in place minimum): the lowest rank whose kernel failed, and with
    // sharded output and detection, the complements of the variables' non-finite flags (a bit
    // each: their minimum is the complement of every rank's flags together).
    std::uint64_t* outcome = work.outcome.data();
    const std::size_t flag_words = work.outcome.size() - 1;
    outcome[0] = static_cast<std::uint64_t>(failure ? rank : ranks);
    std::fill(outcome + 1, outcome + 1 + flag_words, ~std::uint64_t{0});
    for (std::size_t i = 0; i < variables && flag_words != 0; ++i)
      if (work.nonfinite[i] != 0) outcome[1 + i / 64] &= ~(std::uint64_t{1} << (i % 64));
    const std::uint64_t last_began = trace.start();
    wire.min_words(outcome, work.outcome.size());
    trace.phase("outcome", last_began);
    const std::uint64_t failed_rank = outcome[0];
    wire.rethrow_noted();
    if (failure) std::rethrow_exception(failure);
    if (failed_rank < static_cast<std::uint64_t>(ranks))
      throw remote_error(std::string(Transport::caller) + ": rank " + std::to_string(failed_rank) +
                         " failed while averaging (an exception from user code there, after validation: see the "
                         "error thrown there); the outputs of this call are partly written on every rank");
    if (sharded()) finish_shard(outcome + 1, flag_words);
    trace.end_call(local_bytes());
    result.nonfinite_variables = nonfinite_variables;
    if (opts.compute.statistics) {
      result.sum_mean_squared = stats.everything().sum_mean_squared;
      result.sum_mean_of_squares = stats.everything().sum_mean_of_squares;
    }
    return result;
  }
};

}  // namespace detail::processes
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
