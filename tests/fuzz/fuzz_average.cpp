// libFuzzer target: decodes bytes into one call of average_gradients_into and one of
// average_gradients — towers, shapes, absent gradients, variables, outputs, aliasing layouts and
// options, every gradient and output in one arena so that overlaps are real — and checks both
// against a scalar model of the contract in docs/api.md written here, independently of the library:
//   - either the error the model allows (class and variable index), and then every byte of the
//     arena unchanged,
//   - or success with mean = (sum over towers in tower order, in the element type) / T bitwise
//     (any NaN equals any NaN), squares = (g_0² + g_1² + ...) / T bitwise with each square
//     rounded before it is added (never fused, on any target), every other byte of the arena
//     unchanged, and the counts and skipped list right.
// The fused step's options are decoded too (weights, scale, on_nonfinite with NaN and infinities
// planted in the inputs, statistics, per_variable, element ranges, double accumulation, and
// outputs that are flat views of their gradient): with unit weights and scale 1 the results are
// still checked bitwise (summed in double and rounded once to float with double accumulation);
// otherwise against a long double reference within an error bound stated in bound_element. The
// non-finite flags and counts must be exact, the statistics within the rounding of a double sum
// of the results, elements outside the range untouched, and after an error the arena and
// per_variable unchanged.
// Build: tests/fuzz/CMakeLists.txt (GRADAVG_BUILD_FUZZ, Clang); run: scripts/fuzz.sh.
#include <gradavg/gradavg.hpp>

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iterator>
#include <limits>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fuzz {

/// The model's view of options{}.aliasing. Switch it together with the library's default.
constexpr gradavg::alias_check default_aliasing = gradavg::alias_check::all;
static_assert(gradavg::options{}.check.aliasing == default_aliasing,
              "options{}.check.aliasing changed: update fuzz::default_aliasing, the model of the default");

// ---- The tensors handed to gradavg: views into the arena, and what the allocating API returns.

template <class S>
struct view {
  S* data = nullptr;
  gradavg::shape shape;
  bool strided = false;  // reported as not contiguous
};

template <class S>
struct owned {
  std::vector<S> values;
  gradavg::shape shape;
};

}  // namespace fuzz

namespace gradavg {

template <class S>
struct tensor_traits<fuzz::view<S>> {
  using value_type = S;
  using result_type = fuzz::owned<S>;
  static const S* data(const fuzz::view<S>& v) noexcept { return v.data; }
  static S* mutable_data(const fuzz::view<S>& v) noexcept { return v.data; }
  static gradavg::shape shape(const fuzz::view<S>& v) noexcept { return v.shape; }
  static bool contiguous(const fuzz::view<S>& v) noexcept { return !v.strided; }
  static result_type make(const gradavg::shape& s) { return {std::vector<S>(s.size()), s}; }
};

template <class S>
struct tensor_traits<fuzz::owned<S>> {
  using value_type = S;
  static const S* data(const fuzz::owned<S>& t) noexcept { return t.values.data(); }
  static S* mutable_data(fuzz::owned<S>& t) noexcept { return t.values.data(); }
  static gradavg::shape shape(const fuzz::owned<S>& t) noexcept { return t.shape; }
};

}  // namespace gradavg

namespace fuzz {

/// On the harness's per-element loops (values, reference, comparisons): their branches say
/// nothing about the library, and tracing them would cost most of the run time.
#define GRADAVG_FUZZ_UNTRACED __attribute__((no_sanitize("coverage")))

constexpr std::size_t npos = gradavg::error::npos;

// ---- The case: what the bytes decode into. -------------------------------------------------

/// A shape of rank 1 ([d0]) or 2 ([d0, d1] in either storage order).
struct dims {
  int rank = 1;
  std::int64_t d0 = 0, d1 = 0;
  bool row_major = true;

  [[nodiscard]] std::size_t size() const { return static_cast<std::size_t>(rank == 1 ? d0 : d0 * d1); }
};

/// The contract's shape equality: same rank and dimensions; the storage order counts only where
/// it changes the order of the elements, i.e. where more than one dimension exceeds 1.
bool same_shape(const dims& a, const dims& b) {
  if (a.rank != b.rank || a.d0 != b.d0 || (a.rank == 2 && a.d1 != b.d1)) return false;
  return a.rank == 1 || a.row_major == b.row_major || a.d0 <= 1 || a.d1 <= 1;
}

gradavg::shape to_shape(const dims& d) {
  gradavg::shape s;
  s.rank = static_cast<std::size_t>(d.rank);
  s.dims[0] = d.d0;
  s.dims[1] = d.d1;
  s.order = d.row_major ? gradavg::storage_order::row_major : gradavg::storage_order::col_major;
  return s;
}

std::string describe(const dims& d) {
  std::string s = "[" + std::to_string(d.d0);
  if (d.rank == 2) s += "," + std::to_string(d.d1) + (d.row_major ? "]r" : "]c");
  else s += d.row_major ? "]" : "]c";
  return s;
}

/// A gradient or output slot: absent (null), or a tensor of `shape` at arena[offset...].
struct slot_desc {
  bool present = false;
  std::size_t offset = 0;  // in elements
  dims shape;
  bool strided = false;

  [[nodiscard]] std::size_t count() const { return present ? shape.size() : 0; }
};

enum class alias_mode : std::uint8_t { unset, same_variable, all, none };

/// The options of the fused training step (all at their defaults unless decoded otherwise).
struct fused_desc {
  std::vector<double> weights;  // empty: none
  double scale = 1.0;
  gradavg::nonfinite_policy on_nonfinite = gradavg::nonfinite_policy::ignore;
  bool statistics = false;
  double samples_per_tower = 0;
  bool per_variable = false;
  std::size_t per_variable_count = 0;
  bool per_variable_flag = false;  // what every per_variable entry's nonfinite holds before a call
  std::size_t range_begin = 0, range_end = gradavg::element_range{}.end;
  bool double_precision = false;
  int planted = 0;  // NaN and infinities planted at random arena elements

  [[nodiscard]] bool default_range() const {
    return range_begin == gradavg::element_range{}.begin && range_end == gradavg::element_range{}.end;
  }
};

struct case_desc {
  bool is_double = false;
  bool pointer_slots = false;  // raw pointers instead of std::optional
  bool large = false;          // variables big enough for several threads' chunks
  std::size_t towers = 1;
  std::vector<std::vector<slot_desc>> grads;  // [tower][entry]
  std::vector<std::vector<int>> vars;         // [tower][entry]
  std::vector<slot_desc> means, squares;
  bool pass_squares = false, include_square = false, streaming = false, use_pool = false;
  std::size_t threads = 1;
  alias_mode aliasing = alias_mode::unset;
  int value_mode = 0;
  std::uint64_t seed = 0;
  std::size_t arena_size = 0;  // in elements
  fused_desc fused;

  [[nodiscard]] std::size_t variables() const { return towers == 0 ? means.size() : grads[0].size(); }
};

std::string describe(const case_desc& c) {
  std::ostringstream os;
  os << (c.is_double ? "double" : "float") << (c.pointer_slots ? ", pointer slots" : ", optional slots")
     << (c.large ? ", large" : "")
     << ", T=" << c.towers << ", arena " << c.arena_size << " elements, values mode " << c.value_mode << " seed "
     << c.seed << "\n  options: threads " << c.threads << (c.use_pool ? " (pool)" : "")
     << (c.streaming ? ", streaming" : "") << (c.include_square ? ", include_square" : "") << ", aliasing "
     << (c.aliasing == alias_mode::unset           ? "unset"
         : c.aliasing == alias_mode::same_variable ? "same_variable"
         : c.aliasing == alias_mode::all           ? "all"
                                                   : "none")
     << "\n";
  const fused_desc& f = c.fused;
  os << "  fused: accumulate " << (f.double_precision ? "double" : "native") << ", weights";
  if (f.weights.empty()) os << " none";
  for (double w : f.weights) os << " " << w;
  os << ", scale " << f.scale << ", on_nonfinite "
     << (f.on_nonfinite == gradavg::nonfinite_policy::ignore   ? "ignore"
         : f.on_nonfinite == gradavg::nonfinite_policy::report ? "report"
                                                               : "zero")
     << (f.statistics ? ", statistics" : "") << ", samples_per_tower " << f.samples_per_tower;
  if (f.per_variable) os << ", per_variable " << f.per_variable_count << (f.per_variable_flag ? " (true)" : " (false)");
  if (!f.default_range()) os << ", range [" << f.range_begin << ", " << f.range_end << ")";
  os << ", planted " << f.planted << "\n";
  auto slot = [&](const slot_desc& s) {
    if (!s.present) return std::string("null");
    return describe(s.shape) + "@" + std::to_string(s.offset) + (s.strided ? " strided" : "");
  };
  for (std::size_t k = 0; k < c.towers; ++k) {
    os << "  tower " << k << ":";
    for (std::size_t i = 0; i < c.grads[k].size(); ++i) os << " (" << slot(c.grads[k][i]) << ", v" << c.vars[k][i] << ")";
    os << "\n";
  }
  os << "  means:";
  for (const auto& s : c.means) os << " " << slot(s);
  if (c.pass_squares) {
    os << "\n  squares:";
    for (const auto& s : c.squares) os << " " << slot(s);
  }
  return os.str();
}

// ---- Decoding. Every byte read past the end is 0, which decodes to a plain valid choice. -----

/// Another shape near d: bigger, smaller, the same size in another shape, or another order
/// (which some of these leave equal to d: the model decides).
dims mutate(const dims& d, std::uint8_t how) {
  dims m = d;
  switch (how % 5) {
    case 0:
      ++m.d0;
      break;
    case 1:
      if (m.rank == 2 && m.d1 > 0) --m.d1;
      else if (m.d0 > 0) --m.d0;
      else ++m.d0;
      break;
    case 2:  // same size, other rank
      if (d.rank == 1) {
        m.rank = 2;
        m.d0 = (how & 8) ? d.d0 : 1;
        m.d1 = (how & 8) ? 1 : d.d0;
      } else {
        m.rank = 1;
        m.d0 = static_cast<std::int64_t>(d.size());
        m.d1 = 0;
      }
      break;
    case 3:  // transposed
      if (d.rank == 1) {
        m.rank = 2;
        m.d1 = 1;
      } else {
        std::swap(m.d0, m.d1);
      }
      break;
    default:  // other storage order
      m.row_major = !m.row_major;
      if (d.rank == 1) {
        m.rank = 2;
        m.d0 = 1;
        m.d1 = d.d0;
      }
      break;
  }
  return m;
}

/// Large cases (variables of about 1 MiB, so that threads get several chunks each) cost
/// hundreds of times a small one: GRADAVG_FUZZ_NO_LARGE=1 decodes them as small, for long runs
/// that want executions per second. Read once, so every input decodes the same way in a run.
bool large_cases_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("GRADAVG_FUZZ_NO_LARGE");
    return v == nullptr || std::string(v) == "0";
  }();
  return enabled;
}

class decoder {
 public:
  decoder(const std::uint8_t* data, std::size_t size) : in_(data, size) {}

  case_desc decode() {
    case_desc c;
    const std::uint8_t flags = byte();
    c.is_double = (flags & 1) != 0;
    c.pointer_slots = (flags & 2) != 0;
    const bool uniform_shapes = (flags & 4) != 0;  // every variable shaped like variable 0: swaps fit
    c.pass_squares = (flags & 8) != 0;
    c.include_square = (flags & 16) != 0;
    c.streaming = (flags & 32) != 0;
    c.use_pool = (flags & 64) != 0;
    const bool shared_ids = (flags & 128) != 0;  // the same variable at every position
    const std::uint8_t tb = byte();  // mostly 1..4 towers (cheaper runs), else up to 20
    c.towers = tb == 0xFF ? 0 : (tb & 0x80) ? 1 + tb % 20 : 1 + tb % 4;
    std::size_t v = byte() % 9;
    const std::uint8_t ob = byte();
    c.threads = ob % 5;
    c.aliasing = static_cast<alias_mode>((ob >> 3) % 4);
    const std::uint8_t mb = byte();
    c.value_mode = mb % 4;
    c.large = byte() == 0xA7 && large_cases_enabled();
    if (c.large) {
      c.towers = std::min<std::size_t>(c.towers, 2);
      v = std::min<std::size_t>(v, 4);
    }
    c.seed = in_.ConsumeIntegral<std::uint64_t>();

    // Entries per tower: all v, but one tower may hold one more or one fewer.
    std::vector<std::size_t> entries(c.towers, v);
    const std::uint8_t eb = byte();
    if (c.towers > 1 && (mb >> 2) % 16 == 1) {
      const std::size_t k = 1 + eb % (c.towers - 1);
      entries[k] = ((eb & 0x80) && v > 0) ? v - 1 : v + 1;
    }
    c.grads.resize(c.towers);
    c.vars.resize(c.towers);
    for (std::size_t k = 0; k < c.towers; ++k) {
      c.grads[k].resize(entries[k]);
      c.vars[k].assign(entries[k], 1000);  // extra entries: absent gradient, variable 1000
    }

    // Shapes, around the packet widths; large: rank-1 sizes scaled to span several chunks.
    std::size_t large_budget = 150000;
    shapes_.resize(v);
    for (std::size_t i = 0; i < v; ++i) {
      const std::uint8_t b = byte(), s1 = byte(), s2 = byte();
      dims d;
      if (uniform_shapes && i > 0) {
        d = shapes_[0];
      } else {
        d.rank = 1 + (b & 1);
        d.row_major = (b & 2) == 0;
        d.d0 = d.rank == 1 ? s1 % 71 : s1 % 9;
        d.d1 = d.rank == 1 ? 0 : s2 % 13;
        if (c.large && d.rank == 1) d.d0 = d.d0 * 1031 + s2 % 7;
      }
      if (c.large && d.rank == 1) {
        d.d0 = std::min<std::int64_t>(d.d0, static_cast<std::int64_t>(large_budget));
        large_budget -= static_cast<std::size_t>(d.d0);
      }
      shapes_[i] = d;
    }

    // Gradients: presence, problems on one tower, placement in the arena.
    std::vector<std::size_t> placed;  // offsets of present gradients
    for (std::size_t i = 0; i < v; ++i) {
      const int id = shared_ids ? 7 : static_cast<int>(3 * i + 1);
      const std::uint8_t pb = byte();
      const std::uint32_t absent_mask = pb % 8 == 1 ? in_.ConsumeIntegral<std::uint32_t>() : 0;
      const std::uint8_t qb = byte();
      const std::size_t bad_tower = c.towers ? byte() % c.towers : 0;
      for (std::size_t k = 0; k < c.towers; ++k) {
        if (i >= entries[k]) continue;
        const bool at_fault = k == bad_tower;
        c.vars[k][i] = id + (at_fault && qb % 16 == 0 ? 1 + (qb >> 4) : 0);
        slot_desc& g = c.grads[k][i];
        g.present = pb % 8 != 0 && !(pb % 8 == 1 && ((absent_mask >> (k % 32)) & 1));
        if (!g.present) continue;
        g.shape = at_fault && qb % 16 == 1 ? mutate(shapes_[i], qb >> 4) : shapes_[i];
        g.strided = at_fault && qb % 16 == 2;
        const std::uint8_t gb = byte();
        const std::size_t n = g.count();
        if (gb % 8 == 0 && k > 0 && c.grads[0][i].present)
          g.offset = place_at(c.grads[0][i].offset, 0, n);  // tower k reads tower 0's buffer
        else if (gb % 8 == 1 && !placed.empty())
          g.offset = place_at(placed[byte() % placed.size()], shift(), n);  // overlaps another input
        else
          g.offset = place_fresh(n, (gb >> 3) % 16);
        placed.push_back(g.offset);
      }
    }

    decode_outputs(c, c.means);
    if (c.pass_squares) decode_outputs(c, c.squares);
    c.arena_size = std::max(cursor_, end_);
    decode_fused(c);
    return c;
  }

 private:
  std::uint8_t byte() { return in_.ConsumeIntegral<std::uint8_t>(); }

  /// The fused step's options, read last so that inputs written before them decode as before
  /// (a first byte of 0: every option at its default).
  void decode_fused(case_desc& c) {
    const std::uint8_t flags = byte();
    if (flags == 0) return;
    fused_desc& f = c.fused;
    f.double_precision = (flags & 128) != 0;
    if (flags & 1) {  // weights: one per tower, or the wrong count; all 1 (bitwise the unweighted results)
      const std::uint8_t wb = byte();
      std::size_t n = c.towers;
      if (wb % 8 == 7) n = c.towers >= 2 && (wb & 8) ? c.towers - 1 : c.towers + 1;
      for (std::size_t k = 0; k < n; ++k) f.weights.push_back(wb % 8 == 6 ? 1.0 : weight());
    }
    if (flags & 2) f.scale = scale();
    f.on_nonfinite = (flags >> 2) % 4 == 2 ? gradavg::nonfinite_policy::zero
                     : (flags >> 2) % 4 == 0 ? gradavg::nonfinite_policy::ignore
                                             : gradavg::nonfinite_policy::report;
    if (flags & 16) {
      f.statistics = true;
      constexpr double samples[] = {0, 32, 217.5, 1, -1, std::numeric_limits<double>::quiet_NaN(),
                                    std::numeric_limits<double>::infinity(), 1e-3};
      f.samples_per_tower = samples[byte() % 8];
    }
    if (flags & 32) {  // one per variable, or one more or fewer
      const std::uint8_t pb = byte();
      const std::size_t v = c.variables();
      f.per_variable = true;
      f.per_variable_count = pb % 8 == 7 || (pb % 8 == 6 && v < 2) ? v + 1 : pb % 8 == 6 ? v - 1 : v;
      f.per_variable_flag = (pb & 8) != 0;
    }
    if (flags & 64) {  // partial ranges around the flat total, begin > end now and then
      std::size_t total = 0;
      if (c.towers > 0)
        for (const slot_desc& g : c.grads[0]) total += g.count();
      const std::uint8_t rb = byte();
      const std::size_t span = total + 3;
      f.range_begin = (rb & 3) == 0 ? 0 : in_.ConsumeIntegral<std::uint32_t>() % span;
      switch ((rb >> 2) % 4) {
        case 0: break;
        case 1: f.range_end = f.range_begin + in_.ConsumeIntegral<std::uint8_t>() % 80; break;
        case 2: f.range_end = in_.ConsumeIntegral<std::uint32_t>() % span; break;
        default: f.range_end = total; break;
      }
    }
    const std::uint8_t planted = byte();
    f.planted = planted % 4 == 0 ? 0 : 1 + (planted >> 2) % 6;
  }

  /// A tower weight: mostly valid (zero too), now and then negative, NaN, infinite, or outside
  /// float's range.
  double weight() {
    constexpr double inf = std::numeric_limits<double>::infinity();
    constexpr double palette[] = {1, 2, 0.5, 0, 3, 0.25, 1.5, 10, 0.1, 1.0 / 3, 1e-3, 100, -0.0, 7, 1e-30, 1e30,
                                  -1, std::numeric_limits<double>::quiet_NaN(), inf, -inf,
                                  std::numeric_limits<double>::max(), 1e-300,
                                  std::numeric_limits<double>::denorm_min(), 1e39};
    const std::uint8_t b = byte();
    if (b % 32 >= std::size(palette)) return static_cast<double>(byte()) / 16;  // 0 .. 16 in 1/16 steps
    return palette[b % 32];
  }

  double scale() {
    constexpr double inf = std::numeric_limits<double>::infinity();
    constexpr double palette[] = {0.5, 2, 1.0 / 1024, 0x1p-16, 0, -1, 0.1, 3, 1e-30, 1e30, 65536, -0.5,
                                  std::numeric_limits<double>::quiet_NaN(), inf, -inf, 1};
    return palette[byte() % 16];
  }

  /// 0 half the time, else -4..4 elements.
  int shift() {
    const std::uint8_t b = byte();
    return (b & 1) ? static_cast<int>((b >> 1) % 9) - 4 : 0;
  }

  std::size_t place_fresh(std::size_t n, std::size_t pad) {
    cursor_ = std::max(cursor_, end_) + pad;
    const std::size_t offset = cursor_;
    cursor_ += n;
    end_ = std::max(end_, cursor_);
    return offset;
  }

  std::size_t place_at(std::size_t target, int shift, std::size_t n) {
    const std::size_t offset =
        shift < 0 && static_cast<std::size_t>(-shift) > target ? 0 : static_cast<std::size_t>(std::int64_t(target) + shift);
    end_ = std::max(end_, offset + n);
    return offset;
  }

  /// One output per variable (or one more or fewer): a fresh buffer, null, the wrong shape,
  /// strided, in place into tower 0's gradient, over some gradient, or over an earlier output.
  /// Outputs of skipped variables are placed fresh (or null, misshapen, strided); an aliased
  /// output targets an averaged variable's buffer, though it may run on into a skipped one's.
  void decode_outputs(case_desc& c, std::vector<slot_desc>& outs) {
    const std::size_t v = shapes_.size();
    const std::uint8_t cb = byte();
    std::size_t n = v;
    if (cb % 16 == 1) n = v + 1;
    else if (cb % 16 == 2 && v > 0) n = v - 1;
    outs.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const bool real = i < v && c.towers > 0 && i < c.grads[0].size();
      const bool skipped = real && !c.grads[0][i].present;
      const std::uint8_t kb = byte();
      const int kind = kb % 16;
      slot_desc& o = outs[i];
      o.present = kind != 7;
      o.shape = i < v ? shapes_[i] : dims{1, kb >> 4, 0, true};
      if (kind == 8) o.shape = mutate(o.shape, kb >> 4);
      o.strided = kind == 9;
      if (!o.present) continue;
      const std::size_t count = o.count();
      bool aliased = false;
      if (real && !skipped) {
        if ((kind == 10 || kind == 11) && c.grads[0][i].present) {
          o.offset = place_at(c.grads[0][i].offset, 0, count);
          aliased = true;
        } else if (kind == 12 || kind == 13) {
          const std::size_t k = byte() % c.towers;
          const std::uint8_t jb = byte();
          if (!c.grads[k].empty() && c.grads[k][jb % c.grads[k].size()].present) {
            o.offset = place_at(c.grads[k][jb % c.grads[k].size()].offset, shift(), count);
            aliased = true;
          }
        } else if ((kind == 14 || kind == 15) && !placed_outputs_.empty()) {
          o.offset = place_at(placed_outputs_[byte() % placed_outputs_.size()], shift(), count);
          aliased = true;
        }
      }
      if (!aliased) o.offset = place_fresh(count, (kb >> 4) % 16);
      if (!skipped) placed_outputs_.push_back(o.offset);
    }
  }

  FuzzedDataProvider in_;
  std::vector<dims> shapes_;  // tower 0's shape of each variable
  std::vector<std::size_t> placed_outputs_;
  std::size_t cursor_ = 0, end_ = 0;
};

// ---- The model: what the contract allows for a case. ---------------------------------------

enum class fault { tower, variable_mismatch, missing_gradient, shape, output, aliasing, weight, option, other };

const char* name(fault f) {
  switch (f) {
    case fault::tower: return "tower_error";
    case fault::variable_mismatch: return "variable_mismatch_error";
    case fault::missing_gradient: return "missing_gradient_error";
    case fault::shape: return "shape_error";
    case fault::output: return "output_error";
    case fault::aliasing: return "aliasing_error";
    case fault::weight: return "weight_error";
    case fault::option: return "option_error";
    default: return "another exception";
  }
}

/// One thing wrong: the error class it raises, and the variable index (or indices, for an
/// overlap between two variables' buffers) the error may report; npos when about no variable.
/// A weight of one tower that is wrong: the tower the message must name.
struct problem {
  fault kind;
  std::size_t index, other_index;
  std::size_t tower = npos;
};

/// At most one dimension above 1: the element order does not depend on the storage order.
bool flat(const dims& d) { return d.rank == 1 || (d.d0 > 1 ? 1 : 0) + (d.d1 > 1 ? 1 : 0) <= 1; }

/// The contract's rule for outputs: the gradient's shape, or the same element count when either
/// of the two is flat.
bool output_fits(const dims& output, const dims& gradient) {
  return same_shape(output, gradient) || (output.size() == gradient.size() && (flat(output) || flat(gradient)));
}

/// What one call may do: throw one of `errors`, or succeed when success_allowed; with
/// success_checked the results must then match the reference.
struct expectation {
  std::vector<problem> errors;
  bool success_allowed = false;
  bool success_checked = false;
  gradavg::alias_check mode = default_aliasing;  // what the call checks
  bool set_mode = false;                           // false: options.check.aliasing left at its default
};

/// Precedence, as the model states it: the checks run in stages, and only problems of the
/// first stage that finds any may be reported (any of them, in any order within the stage):
///   1. towers: none, or towers holding different numbers of entries       tower_error
///   2. inputs, every variable: variable mismatch, gradient present on some towers only, shape
///      mismatch or strided gradient      variable_mismatch_ / missing_gradient_ / shape_error
///   3. outputs (into): count, null or misshapen or strided output of an averaged variable
///                                                                          output_error
///   4. overlaps (into), as options.check.aliasing says                           aliasing_error
/// Invalid options of the fused step (weights, scale, range, per_variable)
/// belong to no stage: the contract leaves their order against the others open, so either may
/// be reported, and the call never succeeds.
/// Outputs of skipped variables are never read, written or checked (null or any shape is fine);
/// whether the overlap check looks at them is left open: either outcome is accepted.
class model {
 public:
  explicit model(const case_desc& c) : c_(c) {}

  [[nodiscard]] bool tower_stage(std::vector<problem>& out) const {
    if (c_.towers == 0) out.push_back({fault::tower, npos, npos});
    for (std::size_t k = 1; k < c_.towers; ++k)
      if (c_.grads[k].size() != c_.grads[0].size()) out.push_back({fault::tower, npos, npos});
    return !out.empty();
  }

  [[nodiscard]] bool input_stage(std::vector<problem>& out) const {
    for (std::size_t i = 0; i < v(); ++i) {
      std::size_t present = 0;
      for (std::size_t k = 0; k < c_.towers; ++k) {
        if (c_.vars[k][i] != c_.vars[0][i]) out.push_back({fault::variable_mismatch, i, i});
        present += c_.grads[k][i].present ? 1 : 0;
      }
      if (present != 0 && present != c_.towers) out.push_back({fault::missing_gradient, i, i});
      if (present != c_.towers) continue;
      for (std::size_t k = 0; k < c_.towers; ++k)
        if (!same_shape(c_.grads[k][i].shape, c_.grads[0][i].shape) || c_.grads[k][i].strided)
          out.push_back({fault::shape, i, i});
    }
    return !out.empty();
  }

  [[nodiscard]] bool output_stage(std::vector<problem>& out) const {
    auto check = [&](const std::vector<slot_desc>& outs) {
      if (outs.size() != v()) out.push_back({fault::output, npos, npos});
      for (std::size_t i = 0; i < std::min(v(), outs.size()); ++i) {
        if (skipped(i)) continue;
        const slot_desc& o = outs[i];
        if (!o.present || !output_fits(o.shape, c_.grads[0][i].shape) || o.strided) out.push_back({fault::output, i, i});
      }
    };
    check(c_.means);
    if (c_.pass_squares) check(c_.squares);
    return !out.empty();
  }

  /// Overlaps of outputs with gradients and with each other, once the outputs are valid.
  struct overlaps {
    std::vector<problem> forbidden_same;   // within one variable's buffers
    std::vector<problem> forbidden_cross;  // between two variables' buffers
    std::vector<problem> open;             // involving a skipped variable's output
  };

  [[nodiscard]] overlaps overlap_stage() const {
    overlaps r;
    struct buffer {
      std::size_t first, last;  // elements [first, last) of the arena
      std::size_t variable;
      bool square, skipped;  // a squares output; a skipped variable's output
      std::size_t tower;     // of a gradient
    };
    std::vector<buffer> outs, grads;
    for (std::size_t i = 0; i < v(); ++i) {
      if (!skipped(i))
        for (std::size_t k = 0; k < c_.towers; ++k) {
          const slot_desc& g = c_.grads[k][i];
          grads.push_back({g.offset, g.offset + g.count(), i, false, false, k});
        }
      for (int sq = 0; sq <= (c_.pass_squares ? 1 : 0); ++sq) {
        const std::vector<slot_desc>& list = sq ? c_.squares : c_.means;
        if (i >= list.size()) continue;  // a count the output stage rejects
        const slot_desc& o = list[i];
        if (o.present) outs.push_back({o.offset, o.offset + o.count(), i, sq == 1, skipped(i), 0});
      }
    }
    auto overlap = [](const buffer& a, const buffer& b) {
      return a.first < a.last && b.first < b.last && a.first < b.last && b.first < a.last;
    };
    auto add = [&](const buffer& a, const buffer& b) {
      const problem p{fault::aliasing, a.variable, b.variable};
      if (a.skipped || b.skipped) r.open.push_back(p);
      else if (a.variable == b.variable) r.forbidden_same.push_back(p);
      else r.forbidden_cross.push_back(p);
    };
    for (std::size_t x = 0; x < outs.size(); ++x) {
      const buffer& o = outs[x];
      for (const buffer& g : grads) {
        const bool in_place = !o.square && g.variable == o.variable && g.tower == 0 && g.first == o.first && g.last == o.last;
        if (overlap(o, g) && !in_place) add(o, g);
      }
      for (std::size_t y = x + 1; y < outs.size(); ++y)
        if (overlap(o, outs[y])) add(o, outs[y]);
    }
    return r;
  }

  /// Invalid options: weights (weight_error; naming the tower when one weight is wrong), scale,
  /// range, per_variable (option_error). Weights, their sum and the scale must be finite in the accumulator type (double for double gradients and for float
  /// ones with accumulation::double_precision, else float), the sum a normal number there.
  void option_stage(std::vector<problem>& out, bool allocating) const {
    const fused_desc& f = c_.fused;
    const bool double_acc = c_.is_double || f.double_precision;
    const double acc_max = double_acc ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
    const double acc_min = double_acc ? std::numeric_limits<double>::min() : std::numeric_limits<float>::min();
    if (!f.weights.empty()) {
      if (f.weights.size() != c_.towers) {
        out.push_back({fault::weight, npos, npos});
      } else {
        bool bad = false;
        double sum = 0;  // in tower order
        for (std::size_t k = 0; k < c_.towers; ++k) {
          const double w = f.weights[k];
          if (!std::isfinite(w) || w < 0 || w > acc_max) {
            out.push_back({fault::weight, npos, npos, k});
            bad = true;
          }
          sum += w;
        }
        if (!bad && !(sum >= acc_min && sum <= acc_max)) out.push_back({fault::weight, npos, npos});
      }
    }
    if (!std::isfinite(f.scale) || std::fabs(f.scale) > acc_max) out.push_back({fault::option, npos, npos});
    // The scale is folded into each tower's weight: every product must be finite there too.
    if (f.weights.size() == c_.towers)
      for (std::size_t k = 0; k < c_.towers; ++k)
        if (std::fabs(f.weights[k] * f.scale) > acc_max) out.push_back({fault::weight, npos, npos, k});
    if (f.range_begin > f.range_end || (allocating && !f.default_range())) out.push_back({fault::option, npos, npos});
    if (f.per_variable && f.per_variable_count != 0 && f.per_variable_count != v() &&
        c_.towers > 0 && std::all_of(c_.grads.begin(), c_.grads.end(), [&](const auto& t) { return t.size() == v(); }))
      out.push_back({fault::option, npos, npos});
  }

  /// The expectation for average_gradients_into.
  [[nodiscard]] expectation into() const {
    expectation e = into_ignoring_options();
    with_options(e, false);
    return e;
  }

  /// The expectation for average_gradients (no outputs to check).
  [[nodiscard]] expectation allocating() const {
    expectation e;
    if (!tower_stage(e.errors) && !input_stage(e.errors)) e.success_allowed = e.success_checked = true;
    with_options(e, true);
    return e;
  }

  [[nodiscard]] std::size_t v() const { return c_.variables(); }
  [[nodiscard]] bool skipped(std::size_t i) const { return !c_.grads[0][i].present; }

 private:
  void with_options(expectation& e, bool allocating) const {
    std::vector<problem> options;
    option_stage(options, allocating);
    if (options.empty()) return;
    e.errors.insert(e.errors.end(), options.begin(), options.end());
    e.success_allowed = e.success_checked = false;
  }

  [[nodiscard]] expectation into_ignoring_options() const {
    expectation e;
    if (tower_stage(e.errors) || input_stage(e.errors)) return e;
    // alias_check::none is only given layouts without forbidden overlaps: others get `all`.
    const overlaps ov = overlap_stage();
    const bool forbidden = !ov.forbidden_same.empty() || !ov.forbidden_cross.empty();
    e.set_mode = c_.aliasing != alias_mode::unset;
    e.mode = c_.aliasing == alias_mode::same_variable ? gradavg::alias_check::same_variable
             : c_.aliasing == alias_mode::all         ? gradavg::alias_check::all
             : c_.aliasing == alias_mode::none        ? (forbidden ? gradavg::alias_check::all : gradavg::alias_check::none)
                                                      : default_aliasing;
    if (output_stage(e.errors)) return e;
    for (const auto* list : {&ov.forbidden_same, &ov.forbidden_cross, &ov.open})
      e.errors.insert(e.errors.end(), list->begin(), list->end());
    switch (e.mode) {
      case gradavg::alias_check::all:
        e.success_allowed = e.success_checked = !forbidden;
        break;
      case gradavg::alias_check::same_variable:  // overlaps across variables may go unseen
        e.success_allowed = ov.forbidden_same.empty();
        e.success_checked = !forbidden;
        break;
      case gradavg::alias_check::none:
        e.errors.clear();
        e.success_allowed = e.success_checked = true;
        break;
    }
    return e;
  }

  const case_desc& c_;
};

// ---- Values and the reference. --------------------------------------------------------------

struct rng {
  std::uint64_t state;
  std::uint64_t next() {  // splitmix64
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

/// Mode 0: small integers; 1: uniform in [-1, 1]; 2: any bit pattern (NaN payloads, infinities,
/// denormals); 3: uniform values with specials mixed in (NaN, ±Inf, ±0, denormals, ±max).
template <class S>
GRADAVG_FUZZ_UNTRACED S value(rng& r, int mode) {
  using lim = std::numeric_limits<S>;
  const std::uint64_t x = r.next();
  switch (mode) {
    case 0:
      return static_cast<S>(static_cast<int>(x % 17) - 8);
    case 1:
      return static_cast<S>(static_cast<double>(x >> 11) * 0x1.0p-52 - 1.0);
    case 2: {
      S s;
      if constexpr (sizeof(S) == 4) {
        const auto bits = static_cast<std::uint32_t>(x);
        std::memcpy(&s, &bits, sizeof s);
      } else {
        std::memcpy(&s, &x, sizeof s);
      }
      return s;
    }
    default: {
      const S specials[] = {lim::quiet_NaN(), -lim::quiet_NaN(), lim::infinity(), -lim::infinity(), S(0), -S(0),
                            lim::denorm_min(), -lim::denorm_min(), lim::min(), lim::max(), lim::lowest(),
                            lim::max() / 2};
      if (x % 4 == 0) return specials[(x >> 8) % std::size(specials)];
      return static_cast<S>(static_cast<double>(x >> 11) * 0x1.0p-50 - 4.0);
    }
  }
}

template <class S>
GRADAVG_FUZZ_UNTRACED bool same_value(S got, S want) {
  return (std::isnan(got) && std::isnan(want)) || std::memcmp(&got, &want, sizeof(S)) == 0;
}

/// Reference of one element over T towers, summed in Acc (S, or double for float with
/// accumulation::double_precision) and rounded once to S: mean, and the mean of squares with
/// every product but the first fused into its sum, and with none fused. The contract's results
/// without weights (or with unit weights) and with scale 1.
template <class S>
struct reference_element {
  S mean, square;
};

template <class S, class Acc>
GRADAVG_FUZZ_UNTRACED std::vector<reference_element<S>> reference(const S* arena,
                                                                const std::vector<std::size_t>& offsets,
                                                                std::size_t n) {
#pragma STDC FP_CONTRACT OFF
  std::vector<reference_element<S>> r(n);
  const Acc t = static_cast<Acc>(offsets.size());
  for (std::size_t j = 0; j < n; ++j) {
    Acc a = static_cast<Acc>(arena[offsets[0] + j]);
    Acc square = a * a;
    for (std::size_t k = 1; k < offsets.size(); ++k) {
      const Acc x = static_cast<Acc>(arena[offsets[k] + j]);
      a = a + x;
      const Acc product = x * x;
      square = square + product;
    }
    r[j] = {static_cast<S>(a / t), static_cast<S>(square / t)};
  }
  return r;
}

/// A result of the fused step as the contract bounds it: the value in long double (which gives
/// the IEEE outcome, NaN or an infinity, where an input is not finite), within tol of the
/// result; may_overflow: an intermediate of finite inputs may pass the largest finite value of
/// the accumulator or output type, so any non-finite result is allowed too.
struct bounded {
  long double value = 0, tol = 0;
  bool may_overflow = false;
};

struct bounded_element {
  bounded mean, square;
};

/// The floating-point facts of the fused step's model for one call: accumulator type Acc,
/// output type O, weights (empty: 1 each), W their sum, scale c, and f_k = w_k c (the scale
/// folded into each weight, computed in double and rounded once to Acc).
struct fused_params {
  std::size_t towers = 0;
  std::vector<long double> weights;  // f_k = w_k c, as rounded to Acc
  long double weight_sum = 0;        // exact
  long double scale = 1;             // c as rounded to Acc
  long double acc_epsilon = 0, acc_denorm = 0, acc_max = 0;  // unit roundoff, smallest denormal, largest finite
  long double out_epsilon = 0, out_denorm = 0, out_max = 0;
  bool out_is_acc = true;
  /// Weights, their products with the scale or their sum that validation rejects: set so that a
  /// model of a wrong success never checks values against them.
  bool unrepresentable = false;
};

template <class Acc, class O>
fused_params make_params(const fused_desc& f, std::size_t towers) {
  fused_params p;
  p.towers = towers;
  for (std::size_t k = 0; k < towers; ++k) {
    const double w = f.weights.size() == towers ? f.weights[k] : 1.0;
    const double folded = w * f.scale;
    if (w > std::numeric_limits<Acc>::max() || !(std::fabs(folded) <= std::numeric_limits<Acc>::max())) {
      p.unrepresentable = true;
      p.weights.push_back(0);
    } else {
      p.weights.push_back(static_cast<Acc>(folded));
    }
    p.weight_sum += w;
  }
  p.scale = std::fabs(f.scale) <= std::numeric_limits<Acc>::max() ? static_cast<Acc>(f.scale) : 0;
  using acc = std::numeric_limits<Acc>;
  using out = std::numeric_limits<O>;
  p.acc_epsilon = acc::epsilon() / 2;
  p.acc_denorm = acc::denorm_min();
  p.acc_max = acc::max();
  p.out_epsilon = out::epsilon() / 2;
  p.out_denorm = out::denorm_min();
  p.out_max = out::max();
  p.out_is_acc = std::is_same_v<Acc, O>;
  p.unrepresentable = p.unrepresentable || p.weight_sum < acc::min() || p.weight_sum > acc::max() ||
                      !(std::fabs(f.scale) <= std::numeric_limits<Acc>::max());
  return p;
}

/// Bounds of one element: mean = sum_k f_k x_k / W, square = sum_k (f_k x_k)(c x_k) / W.
/// Error model: each product, sum, the division and the rounding of f_k, W and c to Acc errs by
/// at most one unit roundoff of its result (and one smallest denormal where it underflows); the
/// bound allows twice that.
template <class S>
GRADAVG_FUZZ_UNTRACED bounded_element bound_element(const S* arena, const std::vector<std::size_t>& offsets, std::size_t j,
                                                  const fused_params& p) {
  long double a = 0, s = 0, abs_a = 0, abs_s = 0, abs_cx = 0, max_product = 0;
  for (std::size_t k = 0; k < offsets.size(); ++k) {
    const long double x = arena[offsets[k] + j];
    const long double fx = p.weights[k] * x, cx = p.scale * x;
    a += fx;
    s += fx * cx;
    if (!std::isfinite(x)) continue;
    abs_a += std::fabs(fx);
    abs_s += std::fabs(fx * cx);
    abs_cx += std::fabs(cx);
    max_product = std::max({max_product, std::fabs(fx), std::fabs(cx), std::fabs(fx * cx)});
  }
  const long double w = p.weight_sum;
  const long double t = static_cast<long double>(offsets.size());
  const long double rel = (2.0L * t + 16) * p.acc_epsilon;
  auto big = [&](long double v, long double limit) { return v * (1 + rel) >= limit; };
  bounded_element e;
  e.mean.value = a / w;
  e.square.value = s / w;
  const long double bm = abs_a / w, bq = abs_s / w;
  // Underflow: each product f_k x_k (and its error carried through c x_k in the squares), each
  // c x_k (carried through f_k x_k), each square product, and the division.
  e.mean.tol = rel * bm + 2 * p.acc_denorm * (t / w + 2);
  e.square.tol = rel * bq + 2 * p.acc_denorm * ((t + abs_a + abs_cx) / w + 2);
  e.mean.may_overflow = big(max_product, p.acc_max) || big(abs_a, p.acc_max) || big(bm, p.acc_max) || big(bm, p.out_max);
  e.square.may_overflow = big(max_product, p.acc_max) || big(abs_s, p.acc_max) || big(bq, p.acc_max) || big(bq, p.out_max);
  if (!p.out_is_acc) {  // rounded once more, to O
    e.mean.tol += p.out_epsilon * std::fabs(e.mean.value) * (1 + rel) + p.out_denorm;
    e.square.tol += p.out_epsilon * std::fabs(e.square.value) * (1 + rel) + p.out_denorm;
  }
  return e;
}

/// Whether got is a result the bounds allow.
GRADAVG_FUZZ_UNTRACED inline bool within(long double got, const bounded& b) {
  if (std::isnan(b.value)) return std::isnan(got);  // a NaN input, inf - inf or 0 * inf: NaN whatever else overflows
  if (std::isinf(b.value)) return got == b.value || (b.may_overflow && !std::isfinite(got));
  if (std::isfinite(got) && std::fabs(got - b.value) <= b.tol) return true;
  return b.may_overflow && !std::isfinite(got);
}

/// A sum of the statistics as the model knows it: a sum of terms, each exact or within a
/// tolerance, or unknown (then the sum is not checked).
struct statistic_sum {
  long double value = 0, tol = 0, magnitude = 0;
  std::size_t terms = 0;
  bool nan = false, inf = false, unknown = false;

  void add(long double term, long double term_tol) {
    ++terms;
    if (std::isnan(term)) nan = true;
    else if (std::isinf(term)) inf = true;
    else {
      value += term;
      tol += term_tol;
      magnitude += std::fabs(term);
    }
  }

  /// The library's sum, in double in any order: NaN when a term is, +inf when a term is (the
  /// terms are never negative), else within the summation's rounding of the reference (or +inf
  /// past the largest double).
  [[nodiscard]] bool matches(double got) const {
    if (unknown) return true;
    if (nan) return std::isnan(got);
    if (inf) return got == std::numeric_limits<double>::infinity();
    const long double limit = tol + (static_cast<long double>(terms) + 8) * 0x1p-52L * magnitude +
                              (static_cast<long double>(terms) + 1) * 2 * std::numeric_limits<double>::denorm_min();
    if (value + limit >= std::numeric_limits<double>::max() && got == std::numeric_limits<double>::infinity()) return true;
    return std::isfinite(got) && std::fabs(static_cast<long double>(got) - value) <= limit;
  }

  [[nodiscard]] std::string describe() const {
    if (unknown) return "unknown";
    if (nan) return "NaN";
    if (inf) return "+inf";
    std::ostringstream os;
    os.precision(17);
    os << static_cast<double>(value) << " +- " << static_cast<double>(tol + (terms + 8) * 0x1p-52L * magnitude);
    return os.str();
  }
};

// ---- Running a case. ------------------------------------------------------------------------

/// Known deviations of the library from the contract, named in GRADAVG_FUZZ_TOLERATE (comma
/// separated), are not reported: so that a long run can look for others while a reported one
/// is being fixed. Each name is checked where its deviation would be reported. Off by default.
bool tolerated(const char* deviation) {
  static const std::string list = [] {
    const char* v = std::getenv("GRADAVG_FUZZ_TOLERATE");
    return "," + std::string(v ? v : "") + ",";
  }();
  return list.find("," + std::string(deviation) + ",") != std::string::npos;
}

[[noreturn]] void fail(const case_desc& c, const std::string& what) {
  std::fprintf(stderr, "\n==== gradavg contract violation: %s\n  case: %s\n", what.c_str(), describe(c).c_str());
  std::fflush(stderr);
  std::abort();
}

gradavg::thread_pool& shared_pool() {
  static gradavg::thread_pool pool(4);
  return pool;
}

struct thrown {
  fault kind;
  std::size_t index;
  std::string what;
};

template <class F>
std::optional<thrown> outcome_of(F&& f) {
  try {
    f();
    return std::nullopt;
  } catch (const gradavg::tower_error& e) {
    return thrown{fault::tower, e.variable_index(), e.what()};
  } catch (const gradavg::variable_mismatch_error& e) {
    return thrown{fault::variable_mismatch, e.variable_index(), e.what()};
  } catch (const gradavg::missing_gradient_error& e) {
    return thrown{fault::missing_gradient, e.variable_index(), e.what()};
  } catch (const gradavg::shape_error& e) {
    return thrown{fault::shape, e.variable_index(), e.what()};
  } catch (const gradavg::output_error& e) {
    return thrown{fault::output, e.variable_index(), e.what()};
  } catch (const gradavg::aliasing_error& e) {
    return thrown{fault::aliasing, e.variable_index(), e.what()};
  } catch (const gradavg::weight_error& e) {  // before option_error, its base
    return thrown{fault::weight, e.variable_index(), e.what()};
  } catch (const gradavg::option_error& e) {
    return thrown{fault::option, e.variable_index(), e.what()};
  } catch (const std::exception& e) {
    return thrown{fault::other, npos, e.what()};
  }
}

std::string list(const std::vector<problem>& ps) {
  std::string s;
  for (const problem& p : ps) {
    s += std::string(s.empty() ? "" : ", ") + name(p.kind);
    if (p.index != npos) s += " #" + std::to_string(p.index);
    if (p.other_index != p.index) s += "/#" + std::to_string(p.other_index);
    if (p.tower != npos) s += " (naming tower " + std::to_string(p.tower) + ")";
  }
  return s.empty() ? "nothing" : s;
}

/// Whether a message names "tower k" (not "tower k0").
bool names_tower(const std::string& what, std::size_t k) {
  const std::string name = "tower " + std::to_string(k);
  for (std::size_t at = what.find(name); at != std::string::npos; at = what.find(name, at + 1)) {
    const std::size_t after = at + name.size();
    if (after == what.size() || what[after] < '0' || what[after] > '9') return true;
  }
  return false;
}

/// Checks an outcome against an expectation; true when the call succeeded (results to check).
bool check_outcome(const case_desc& c, const char* api, const std::optional<thrown>& t, const expectation& e) {
  static const bool verbose = std::getenv("GRADAVG_FUZZ_VERBOSE") != nullptr;
  if (verbose)
    std::fprintf(stderr, "  %s: %s%s; model: %s%s\n", api, t ? name(t->kind) : "success", t ? (" " + t->what).c_str() : "",
                 e.success_allowed ? (e.success_checked ? "success (checked) or " : "success (unchecked) or ") : "",
                 list(e.errors).c_str());
  if (!t) {
    if (!e.success_allowed) fail(c, std::string(api) + " succeeded; the model expects one of: " + list(e.errors));
    return true;
  }
  const bool known = std::any_of(e.errors.begin(), e.errors.end(), [&](const problem& p) {
    return p.kind == t->kind && (t->index == p.index || t->index == p.other_index) &&
           (p.tower == npos || names_tower(t->what, p.tower));
  });
  if (!known)
    fail(c, std::string(api) + " threw " + name(t->kind) + " (variable_index " +
                (t->index == npos ? std::string("npos") : std::to_string(t->index)) + ": " + t->what +
                "); the model expects " + (e.success_allowed ? "success or " : "") + "one of: " + list(e.errors));
  if (t->index != npos && std::string(t->what).find("#" + std::to_string(t->index)) == std::string::npos)
    fail(c, std::string(api) + ": the message does not name variable #" + std::to_string(t->index) + ": " + t->what);
  return false;
}

template <class S, bool Pointers>
class runner {
 public:
  using gslot = std::conditional_t<Pointers, const view<S>*, std::optional<view<S>>>;
  using oslot = std::conditional_t<Pointers, view<S>*, std::optional<view<S>>>;

  GRADAVG_FUZZ_UNTRACED explicit runner(const case_desc& c) : c_(c), model_(c) {
    const std::size_t n = std::max<std::size_t>(1, c.arena_size);
    arena_ = static_cast<S*>(::operator new(n * sizeof(S), std::align_val_t{64}));
    rng r{c.seed};
    for (std::size_t j = 0; j < c.arena_size; ++j) arena_[j] = value<S>(r, c.value_mode);
    rng planting{c.seed ^ 0x6A09E667F3BCC909ull};
    const S specials[] = {std::numeric_limits<S>::quiet_NaN(), -std::numeric_limits<S>::quiet_NaN(),
                          std::numeric_limits<S>::infinity(), -std::numeric_limits<S>::infinity()};
    for (int p = 0; p < c.fused.planted && c.arena_size > 0; ++p) {
      const std::size_t at = planting.next() % c.arena_size;
      arena_[at] = specials[planting.next() % 4];
    }
    before_.assign(arena_, arena_ + c.arena_size);

    const fused_desc& f = c.fused;
    double_accumulation_ = std::is_same_v<S, float> && f.double_precision;
    params_ = double_accumulation_ ? make_params<double, S>(f, c.towers) : make_params<S, S>(f, c.towers);
    unit_ = f.scale == 1.0 && std::all_of(f.weights.begin(), f.weights.end(), [](double w) { return w == 1.0; });
    zero_ = f.on_nonfinite == gradavg::nonfinite_policy::zero;
    detect_ = f.on_nonfinite != gradavg::nonfinite_policy::ignore;

    // The flat range: variables in order, each with its tower-0 gradient's count.
    std::size_t total = 0;
    for (std::size_t i = 0; i < model_.v() && c.towers > 0; ++i) {
      flat_.push_back(total);
      total += c.grads[0][i].count();
    }
    range_begin_ = std::min(f.range_begin, total);
    range_end_ = std::min(f.range_end, total);
    whole_range_ = range_begin_ == 0 && range_end_ == total;
  }
  runner(const runner&) = delete;
  runner& operator=(const runner&) = delete;
  ~runner() { ::operator delete(arena_, std::align_val_t{64}); }

  void run() {
    // Views of every slot, then the towers in the slot kind under test.
    std::vector<std::vector<view<S>>> gviews(c_.towers);
    std::vector<std::vector<std::pair<gslot, int>>> tg(c_.towers);
    for (std::size_t k = 0; k < c_.towers; ++k) {
      for (const slot_desc& s : c_.grads[k]) gviews[k].push_back(view_of(s));
      for (std::size_t i = 0; i < c_.grads[k].size(); ++i) {
        const bool present = c_.grads[k][i].present;
        if constexpr (Pointers)
          tg[k].emplace_back(present ? &gviews[k][i] : nullptr, c_.vars[k][i]);
        else
          tg[k].emplace_back(present ? gslot(gviews[k][i]) : std::nullopt, c_.vars[k][i]);
      }
    }
    std::vector<view<S>> mviews, sviews;
    for (const slot_desc& s : c_.means) mviews.push_back(view_of(s));
    for (const slot_desc& s : c_.squares) sviews.push_back(view_of(s));
    std::vector<oslot> means = slots(c_.means, mviews), squares = slots(c_.squares, sviews);

    const fused_desc& f = c_.fused;
    gradavg::options opts;
    opts.run.threads = c_.threads;
    opts.run.stores = c_.streaming ? gradavg::store_policy::streaming : gradavg::store_policy::regular;
    opts.run.pool = c_.use_pool ? &shared_pool() : nullptr;
    opts.compute.accumulate = f.double_precision ? gradavg::accumulation::double_precision : gradavg::accumulation::native;
    opts.compute.weights = f.weights;
    opts.compute.scale = f.scale;
    opts.compute.on_nonfinite = f.on_nonfinite;
    opts.compute.statistics = f.statistics;
    per_variable_.resize(f.per_variable ? f.per_variable_count : 0);
    opts.compute.per_variable = per_variable_;
    opts.compute.range = {f.range_begin, f.range_end};

    // The allocating API reads the inputs only.
    const expectation ea = model_.allocating();
    reset_per_variable();
    std::optional<gradavg::averaged_gradients<owned<S>, int>> result;
    const auto ta = outcome_of([&] {
      result.emplace(c_.include_square ? gradavg::average_gradients(tg, gradavg::include_square, opts)
                                       : gradavg::average_gradients(tg, opts));
    });
    if (!arena_unchanged()) fail(c_, "average_gradients changed the arena");
    if (check_outcome(c_, "average_gradients", ta, ea)) check_allocating(*result);
    else if (!per_variable_unchanged()) fail(c_, "average_gradients threw but wrote options.compute.per_variable");

    const expectation ei = model_.into();
    if (ei.set_mode) opts.check.aliasing = ei.mode;
    reset_per_variable();
    gradavg::summary sum;
    const auto ti = outcome_of([&] {
      sum = c_.pass_squares ? gradavg::average_gradients_into(tg, means, squares, opts)
                            : gradavg::average_gradients_into(tg, means, opts);
    });
    if (!check_outcome(c_, "average_gradients_into", ti, ei)) {
      if (!arena_unchanged())
        fail(c_, "average_gradients_into threw " + std::string(name(ti->kind)) + " but changed the arena");
      if (!per_variable_unchanged())
        fail(c_, "average_gradients_into threw " + std::string(name(ti->kind)) + " but wrote options.compute.per_variable");
    } else {
      check_into(sum, ei.success_checked);
    }
    check_planned(ti, sum, ei.success_checked, [&](gradavg::plan& p) {
      return c_.pass_squares ? gradavg::average_gradients_into(p, tg, means, squares, opts)
                             : gradavg::average_gradients_into(p, tg, means, opts);
    });
  }

 private:
  /// The statistics of a call or of one variable, as the model knows them.
  struct statistics {
    statistic_sum mean_squared, mean_of_squares;
  };

  /// Elements [lo, hi) of variable i lie in the range (the allocating API: all of them).
  struct span_of {
    std::size_t lo, hi;
  };

  /// The call again with a plan, from the inputs of the plain call, twice (the first proves, the
  /// second reuses the proof): the plain call's outcome, and where the layout has no forbidden
  /// overlap (checked: else the bits depend on the order of the writes) its arena bytes and
  /// statistics, bit for bit.
  template <class Call>
  void check_planned(const std::optional<thrown>& plain, const gradavg::summary& plain_sum, bool checked,
                     Call&& call) {
    const std::vector<S> after(arena_, arena_ + c_.arena_size);
    const std::vector<gradavg::variable_statistics> per_after = per_variable_;
    gradavg::plan p;
    for (int round = 0; round < 2; ++round) {
      if (c_.arena_size != 0) std::memcpy(arena_, before_.data(), c_.arena_size * sizeof(S));
      reset_per_variable();
      gradavg::summary sum;
      const auto t = outcome_of([&] { sum = call(p); });
      const std::string what = "average_gradients_into with a plan (call " + std::to_string(round + 1) + ")";
      if (t.has_value() != plain.has_value() || (t && t->kind != plain->kind))
        fail(c_, what + ": " + (t ? name(t->kind) : "no error") + " where the call without one gave " +
                     (plain ? name(plain->kind) : "no error"));
      if (plain) {
        if (!arena_unchanged()) fail(c_, what + " threw but changed the arena");
        return;  // a failed call empties the plan: nothing more to reuse
      }
      if (!checked) continue;
      if (c_.arena_size != 0 && std::memcmp(arena_, after.data(), c_.arena_size * sizeof(S)) != 0)
        fail(c_, what + ": the arena differs from the call without a plan");
      if (sum.averaged != plain_sum.averaged || sum.skipped != plain_sum.skipped ||
          sum.nonfinite_variables != plain_sum.nonfinite_variables ||
          std::memcmp(&sum.sum_mean_squared, &plain_sum.sum_mean_squared, sizeof(double)) != 0 ||
          std::memcmp(&sum.sum_mean_of_squares, &plain_sum.sum_mean_of_squares, sizeof(double)) != 0)
        fail(c_, what + ": the summary differs from the call without a plan");
      for (std::size_t i = 0; i < per_variable_.size(); ++i)
        if (per_variable_[i].nonfinite != per_after[i].nonfinite ||
            std::memcmp(&per_variable_[i].sum_mean_squared, &per_after[i].sum_mean_squared, sizeof(double)) != 0 ||
            std::memcmp(&per_variable_[i].sum_mean_of_squares, &per_after[i].sum_mean_of_squares, sizeof(double)) != 0)
          fail(c_, what + ": options.compute.per_variable[" + std::to_string(i) + "] differs from the call without a plan");
    }
    if (p.proofs() != 1) fail(c_, "a plan over unchanged buffers was proved " + std::to_string(p.proofs()) + " times");
  }

  GRADAVG_FUZZ_UNTRACED bool arena_unchanged() const {
    return c_.arena_size == 0 || std::memcmp(arena_, before_.data(), c_.arena_size * sizeof(S)) == 0;
  }

  /// Entries as before a call: a flag decoded from the input (so that writing false shows) and
  /// sums no call produces.
  void reset_per_variable() {
    for (auto& e : per_variable_) e = {c_.fused.per_variable_flag, -1234.5, -6789.25};
  }
  [[nodiscard]] bool entry_unchanged(const gradavg::variable_statistics& e) const {
    return e.nonfinite == c_.fused.per_variable_flag && e.sum_mean_squared == -1234.5 && e.sum_mean_of_squares == -6789.25;
  }
  [[nodiscard]] bool per_variable_unchanged() const {
    return std::all_of(per_variable_.begin(), per_variable_.end(), [&](const auto& e) { return entry_unchanged(e); });
  }

  view<S> view_of(const slot_desc& s) { return {arena_ + s.offset, to_shape(s.shape), s.strided}; }

  std::vector<oslot> slots(const std::vector<slot_desc>& descs, std::vector<view<S>>& views) {
    std::vector<oslot> out;
    for (std::size_t i = 0; i < descs.size(); ++i) {
      if constexpr (Pointers)
        out.push_back(descs[i].present ? &views[i] : nullptr);
      else
        out.push_back(descs[i].present ? oslot(views[i]) : std::nullopt);
    }
    return out;
  }

  [[nodiscard]] std::vector<std::size_t> offsets_of(std::size_t i) const {
    std::vector<std::size_t> offsets;
    for (std::size_t k = 0; k < c_.towers; ++k) offsets.push_back(c_.grads[k][i].offset);
    return offsets;
  }

  /// Variable i's plain reference, from the arena as it was before the calls; computed once.
  const std::vector<reference_element<S>>& reference_of(std::size_t i) {
    if (references_.empty()) references_.resize(model_.v());
    if (references_[i].empty() && c_.grads[0][i].count() > 0)
      references_[i] = double_accumulation_ ? reference<S, double>(before_.data(), offsets_of(i), c_.grads[0][i].count())
                                            : reference<S, S>(before_.data(), offsets_of(i), c_.grads[0][i].count());
    return references_[i];
  }

  /// Variable i's bounds under the fused options; computed once.
  const std::vector<bounded_element>& bounds_of(std::size_t i) {
    if (bounds_.empty()) bounds_.resize(model_.v());
    const std::size_t n = c_.grads[0][i].count();
    if (bounds_[i].empty() && n > 0) {
      const std::vector<std::size_t> offsets = offsets_of(i);
      bounds_[i].resize(n);
      for (std::size_t j = 0; j < n; ++j) bounds_[i][j] = bound_element(before_.data(), offsets, j, params_);
    }
    return bounds_[i];
  }

  /// The elements of variable i in options.range (all for the allocating API).
  [[nodiscard]] span_of range_of(std::size_t i, bool allocating) const {
    const std::size_t n = c_.grads[0][i].count();
    if (allocating) return {0, n};
    const std::size_t lo = std::min(n, range_begin_ > flat_[i] ? range_begin_ - flat_[i] : 0);
    const std::size_t hi = std::max(lo, std::min(n, range_end_ > flat_[i] ? range_end_ - flat_[i] : 0));
    return {lo, hi};
  }

  /// An input element of variable i in [lo, hi) is NaN or infinite on some tower.
  GRADAVG_FUZZ_UNTRACED bool input_nonfinite(std::size_t i, span_of r) const {
    for (std::size_t k = 0; k < c_.towers; ++k)
      for (std::size_t j = r.lo; j < r.hi; ++j)
        if (!std::isfinite(before_[c_.grads[k][i].offset + j])) return true;
    return false;
  }

  /// A written mean or square as a term of the statistics: itself when the output type is the
  /// accumulator's, else within its rounding to the output (unknown once that overflowed).
  void add_output_term(statistic_sum& sum, S v, bool squared) const {
    const long double x = v;
    if (params_.out_is_acc || std::isnan(x)) {
      sum.add(squared ? x * x : x, 0);
    } else if (std::isinf(x)) {
      sum.unknown = true;
    } else {
      const long double d = params_.out_epsilon * 2 * std::fabs(x) + params_.out_denorm;
      sum.add(squared ? x * x : x, squared ? 2 * std::fabs(x) * d + d * d : d);
    }
  }

  static void add_bounded_term(statistic_sum& sum, const bounded& b) {
    if (std::isnan(b.value)) sum.add(b.value, 0);
    else if (b.may_overflow) sum.unknown = true;
    else sum.add(b.value, b.tol);
  }

  /// Checks variable i's results in [r.lo, r.hi) (mean and square index like the gradient;
  /// square null when not output) and adds its terms to the call's statistics and its own.
  GRADAVG_FUZZ_UNTRACED void check_values(std::size_t i, const S* mean, const S* square, span_of r, bool flagged,
                                          const std::string& what, statistics& total, statistics& own) {
    if (zero_ && flagged) {  // every output element +0; statistics those of zeros
      for (std::size_t j = r.lo; j < r.hi; ++j) {
        if (!same_bits(mean[j], S(0)) || (square != nullptr && !same_bits(square[j], S(0))))
          fail(c_, what + ": element " + std::to_string(j) + " of a variable with a non-finite input is not +0");
      }
      return;
    }
    const bool stats = c_.fused.statistics;
    if (params_.unrepresentable) {
      for (statistics* s : {&total, &own}) s->mean_squared.unknown = s->mean_of_squares.unknown = true;
      return;
    }
    const std::vector<reference_element<S>>* ref = unit_ ? &reference_of(i) : nullptr;
    const std::vector<bounded_element>* bounds = !unit_ || stats ? &bounds_of(i) : nullptr;
    for (std::size_t j = r.lo; j < r.hi; ++j) {
      if (ref != nullptr) {
        if (!same_value(mean[j], (*ref)[j].mean))
          fail(c_, what + " means: element " + std::to_string(j) + " is " + std::to_string(double(mean[j])) + ", want " +
                       std::to_string(double((*ref)[j].mean)));
        if (square != nullptr && !same_value(square[j], (*ref)[j].square))
          fail(c_, what + " squares: element " + std::to_string(j) + " is " + std::to_string(double(square[j])) +
                       ", want " + std::to_string(double((*ref)[j].square)));
      } else {
        const bounded_element& b = (*bounds)[j];
        if (!within(mean[j], b.mean))
          fail(c_, what + " means: element " + std::to_string(j) + " is " + to_text(mean[j]) + ", want " + to_text(b.mean));
        if (square != nullptr && !within(square[j], b.square))
          fail(c_, what + " squares: element " + std::to_string(j) + " is " + to_text(square[j]) + ", want " +
                       to_text(b.square));
      }
      if (!stats) continue;
      for (statistics* s : {&total, &own}) {
        add_output_term(s->mean_squared, mean[j], true);
        if (square != nullptr) add_output_term(s->mean_of_squares, square[j], false);
        else add_bounded_term(s->mean_of_squares, (*bounds)[j].square);
      }
    }
  }

  static std::string to_text(long double v) {
    std::ostringstream os;
    os.precision(21);
    os << v;
    return os.str();
  }
  static std::string to_text(const bounded& b) {
    return to_text(b.value) + " +- " + to_text(b.tol) + (b.may_overflow ? " (or non-finite: may overflow)" : "");
  }
  static bool same_bits(S a, S b) { return std::memcmp(&a, &b, sizeof(S)) == 0; }

  /// Variable i's results checked; returns whether it holds an element in range.
  GRADAVG_FUZZ_UNTRACED void check_variable(std::size_t i, const S* mean, const S* square, bool allocating,
                                            const std::string& what, statistics& total, std::size_t& flagged_count) {
    const span_of r = range_of(i, allocating);
    if (r.lo == r.hi) {
      if (i < per_variable_.size() && !entry_unchanged(per_variable_[i]))
        fail(c_, what + ": options.compute.per_variable[" + std::to_string(i) + "] written for a variable without elements in range");
      return;
    }
    const bool flagged = input_nonfinite(i, r);
    flagged_count += flagged ? 1 : 0;
    statistics own;
    check_values(i, mean, square, r, flagged, what, total, own);
    if (i >= per_variable_.size()) return;
    const gradavg::variable_statistics& e = per_variable_[i];
    const std::string entry = what + ": options.compute.per_variable[" + std::to_string(i) + "]";
    if (e.nonfinite != (detect_ ? flagged : c_.fused.per_variable_flag))
      fail(c_, entry + ".nonfinite is " + (e.nonfinite ? "true" : "false") +
                   (detect_ ? "" : ", written although on_nonfinite is ignore"));
    if (!c_.fused.statistics) {
      if (e.sum_mean_squared != -1234.5 || e.sum_mean_of_squares != -6789.25)
        fail(c_, entry + ": sums written although statistics are off");
    } else if (zero_ && flagged) {
      if (e.sum_mean_squared != 0 || e.sum_mean_of_squares != 0)
        fail(c_, entry + ": a zeroed variable's sums are not 0");
    } else {
      if (!own.mean_squared.matches(e.sum_mean_squared))
        fail(c_, entry + ".sum_mean_squared is " + to_text(e.sum_mean_squared) + ", want " + own.mean_squared.describe());
      if (!own.mean_of_squares.matches(e.sum_mean_of_squares))
        fail(c_, entry + ".sum_mean_of_squares is " + to_text(e.sum_mean_of_squares) + ", want " +
                     own.mean_of_squares.describe());
    }
  }

  /// The summary's counts, non-finite report and statistics.
  void check_report(const gradavg::summary& s, const std::string& api, std::size_t averaged, std::size_t skipped,
                    bool checked, const statistics& total, std::size_t flagged) {
    if ((s.averaged != averaged || s.skipped != skipped) &&
        !(s.skipped == skipped && s.averaged == averaged_or_empty_range_ && tolerated("averaged-counts-empty-range")))
      fail(c_, api + ": summary says " + std::to_string(s.averaged) + " averaged, " + std::to_string(s.skipped) +
                   " skipped; want " + std::to_string(averaged) + ", " + std::to_string(skipped));
    if (s.towers != c_.towers) fail(c_, api + ": summary says towers " + std::to_string(s.towers));
    const auto& weights = c_.fused.weights;
    const auto weighted = static_cast<std::size_t>(
        weights.empty() ? c_.towers : std::count_if(weights.begin(), weights.end(), [](double w) { return w > 0; }));
    if (s.weighted_towers != weighted)
      fail(c_, api + ": summary.weighted_towers is " + std::to_string(s.weighted_towers) + ", want " +
                   std::to_string(weighted));
    if (!checked) return;
    if (s.nonfinite_variables != (detect_ ? flagged : 0) &&
        !(!detect_ && s.nonfinite_variables == flagged && tolerated("nonfinite-counted-under-ignore")))
      fail(c_, api + ": summary.nonfinite_variables is " + std::to_string(s.nonfinite_variables) + ", want " +
                   std::to_string(detect_ ? flagged : 0));
    if (s.statistics != c_.fused.statistics)
      fail(c_, api + ": summary.statistics is " + (s.statistics ? "true" : "false"));
    if (!c_.fused.statistics) {
      if ((!std::isnan(s.sum_mean_squared) || !std::isnan(s.sum_mean_of_squares)) &&
          !tolerated("sums-without-statistics"))
        fail(c_, api + ": statistics off but sums not NaN");
      return;
    }
    if (!total.mean_squared.matches(s.sum_mean_squared))
      fail(c_, api + ": summary.sum_mean_squared is " + to_text(s.sum_mean_squared) + ", want " + total.mean_squared.describe());
    if (!total.mean_of_squares.matches(s.sum_mean_of_squares))
      fail(c_, api + ": summary.sum_mean_of_squares is " + to_text(s.sum_mean_of_squares) + ", want " +
                   total.mean_of_squares.describe());
    // noise(samples_per_tower) refuses a negative or non-finite sample count, and only that.
    const double samples = c_.fused.samples_per_tower;
    bool refused = false;
    try {
      (void)s.noise(samples);
    } catch (const gradavg::statistics_error&) {
      refused = true;
    }
    if (refused == (std::isfinite(samples) && samples >= 0))
      fail(c_, api + ": noise(" + to_text(samples) + ") " + (refused ? "threw" : "did not throw"));
  }

  GRADAVG_FUZZ_UNTRACED void check_allocating(const gradavg::averaged_gradients<owned<S>, int>& r) {
    std::size_t averaged = 0, skipped = 0, flagged = 0;
    statistics total;
    for (std::size_t i = 0; i < model_.v(); ++i) {
      const int variable = c_.vars[0][i];
      if (model_.skipped(i)) {
        if (skipped >= r.skipped.size() || r.skipped[skipped].index != i || r.skipped[skipped].variable != variable)
          fail(c_, "average_gradients: skipped list wrong at variable #" + std::to_string(i));
        if (i < per_variable_.size() && !entry_unchanged(per_variable_[i]))
          fail(c_, "average_gradients: options.compute.per_variable[" + std::to_string(i) + "] written for a skipped variable");
        ++skipped;
        continue;
      }
      const dims& want = c_.grads[0][i].shape;
      const S* out[2] = {nullptr, nullptr};
      for (int sq = 0; sq <= (c_.include_square ? 1 : 0); ++sq) {
        const auto& list = sq ? r.squares : r.gradients;
        const std::string what = std::string("average_gradients ") + (sq ? "squares" : "means") + " of #" + std::to_string(i);
        if (averaged >= list.size()) fail(c_, what + ": missing");
        const owned<S>& t = list[averaged].first;
        if (list[averaged].second != variable) fail(c_, what + ": paired with the wrong variable");
        const dims got{static_cast<int>(t.shape.rank), t.shape.dims[0], t.shape.rank == 2 ? t.shape.dims[1] : 0,
                       t.shape.order == gradavg::storage_order::row_major};
        if (t.shape.rank < 1 || t.shape.rank > 2 || !same_shape(got, want) || t.values.size() != want.size())
          fail(c_, what + ": shape " + describe(got) + ", want " + describe(want));
        out[sq] = t.values.data();
      }
      check_variable(i, out[0], out[1], true, "average_gradients #" + std::to_string(i), total, flagged);
      ++averaged;
    }
    if (r.gradients.size() != averaged || r.skipped.size() != skipped ||
        r.squares.size() != (c_.include_square ? averaged : 0))
      fail(c_, "average_gradients: " + std::to_string(r.gradients.size()) + " means, " +
                   std::to_string(r.squares.size()) + " squares, " + std::to_string(r.skipped.size()) +
                   " skipped; want " + std::to_string(averaged) + ", " +
                   std::to_string(c_.include_square ? averaged : 0) + ", " + std::to_string(skipped));
    check_report(r.report, "average_gradients", averaged, skipped, true, total, flagged);
  }

  /// Every arena element: unchanged, or the results where an averaged variable's output lies in
  /// range (anything there when the results are not checked).
  GRADAVG_FUZZ_UNTRACED void check_into(const gradavg::summary& sum, bool checked) {
    std::vector<std::uint8_t> written(c_.arena_size, 0);  // in an averaged variable's output, in range
    std::size_t averaged = 0, skipped = 0;
    for (std::size_t i = 0; i < model_.v(); ++i) {
      if (model_.skipped(i)) {
        ++skipped;
        continue;
      }
      const span_of r = range_of(i, false);
      averaged += whole_range_ || r.lo < r.hi ? 1 : 0;
      const std::size_t size = c_.grads[0][i].count();  // the count that tolerated deviation gives
      averaged_or_empty_range_ +=
          whole_range_ || (size != 0 && flat_[i] < range_end_ && flat_[i] + size > range_begin_) ? 1 : 0;
      for (int sq = 0; sq <= (c_.pass_squares ? 1 : 0); ++sq) {
        const slot_desc& o = (sq ? c_.squares : c_.means)[i];
        std::fill(written.begin() + static_cast<std::ptrdiff_t>(o.offset + r.lo),
                  written.begin() + static_cast<std::ptrdiff_t>(o.offset + r.hi), std::uint8_t{1});
      }
    }
    for (std::size_t j = 0; j < c_.arena_size; ++j)
      if (!written[j] && std::memcmp(&arena_[j], &before_[j], sizeof(S)) != 0)
        fail(c_, "average_gradients_into changed arena element " + std::to_string(j) +
                     ", which is no averaged variable's output in range");
    statistics total;
    std::size_t flagged = 0;
    // Checked layouts have no two outputs overlapping, so each holds its own results.
    if (checked)
      for (std::size_t i = 0; i < model_.v(); ++i) {
        if (model_.skipped(i)) {
          if (i < per_variable_.size() && !entry_unchanged(per_variable_[i]))
            fail(c_, "average_gradients_into: options.compute.per_variable[" + std::to_string(i) + "] written for a skipped variable");
          continue;
        }
        const S* square = c_.pass_squares ? arena_ + c_.squares[i].offset : nullptr;
        check_variable(i, arena_ + c_.means[i].offset, square, false, "average_gradients_into #" + std::to_string(i), total,
                       flagged);
      }
    check_report(sum, "average_gradients_into", averaged, skipped, checked, total, flagged);
  }

  const case_desc& c_;
  model model_;
  S* arena_ = nullptr;
  std::vector<S> before_;
  std::vector<std::vector<reference_element<S>>> references_;  // by variable
  std::vector<std::vector<bounded_element>> bounds_;           // by variable
  std::vector<gradavg::variable_statistics> per_variable_;
  fused_params params_;
  bool double_accumulation_ = false;  // float summed in double, rounded once to float
  bool unit_ = true;                  // unit weights (or none) and scale 1: the plain results, bitwise
  bool zero_ = false, detect_ = false;
  std::vector<std::size_t> flat_;  // variable i's first flat index
  std::size_t range_begin_ = 0, range_end_ = 0;
  bool whole_range_ = true;
  std::size_t averaged_or_empty_range_ = 0;
};

template <class S>
void run(const case_desc& c) {
  if (c.pointer_slots)
    runner<S, true>(c).run();
  else
    runner<S, false>(c).run();
}

}  // namespace fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fuzz::case_desc c = fuzz::decoder(data, size).decode();
  static const bool verbose = std::getenv("GRADAVG_FUZZ_VERBOSE") != nullptr;  // prints each case
  if (verbose) std::fprintf(stderr, "case: %s\n", fuzz::describe(c).c_str());
  if (c.is_double)
    fuzz::run<double>(c);
  else
    fuzz::run<float>(c);
  return 0;
}
