// libFuzzer target: decodes bytes into one call of average_gradients_into and one of
// average_gradients — towers, shapes, absent gradients, variables, outputs, aliasing layouts and
// options, every gradient and output in one arena so that overlaps are real — and checks both
// against a scalar model of the README's contract written here, independently of the library:
//   - either the error the model allows (class and variable index), and then every byte of the
//     arena unchanged,
//   - or success with mean = (sum over towers in tower order, in the element type) / T bitwise
//     (any NaN equals any NaN), squares = (g_0² + fma-or-not g_1² + ...) / T rounded one way for
//     the whole call, every other byte of the arena unchanged, and the counts and skipped list right.
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
static_assert(gradavg::options{}.aliasing == default_aliasing,
              "options{}.aliasing changed: update fuzz::default_aliasing, the model of the default");

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
    return c;
  }

 private:
  std::uint8_t byte() { return in_.ConsumeIntegral<std::uint8_t>(); }

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

enum class fault { tower, variable_mismatch, missing_gradient, shape, output, aliasing, other };

const char* name(fault f) {
  switch (f) {
    case fault::tower: return "tower_error";
    case fault::variable_mismatch: return "variable_mismatch_error";
    case fault::missing_gradient: return "missing_gradient_error";
    case fault::shape: return "shape_error";
    case fault::output: return "output_error";
    case fault::aliasing: return "aliasing_error";
    default: return "another exception";
  }
}

/// One thing wrong: the error class it raises, and the variable index (or indices, for an
/// overlap between two variables' buffers) the error may report; npos when about no variable.
struct problem {
  fault kind;
  std::size_t index, other_index;
};

/// What one call may do: throw one of `errors`, or succeed when success_allowed; with
/// success_checked the results must then match the reference.
struct expectation {
  std::vector<problem> errors;
  bool success_allowed = false;
  bool success_checked = false;
  gradavg::alias_check mode = default_aliasing;  // what the call checks
  bool set_mode = false;                           // false: options.aliasing left at its default
};

/// Precedence, as the model states it: the checks run in stages, and only problems of the
/// first stage that finds any may be reported (any of them, in any order within the stage):
///   1. towers: none, or towers holding different numbers of entries       tower_error
///   2. inputs, every variable: variable mismatch, gradient present on some towers only, shape
///      mismatch or strided gradient      variable_mismatch_ / missing_gradient_ / shape_error
///   3. outputs (into): count, null or misshapen or strided output of an averaged variable,
///      include_square without squares                                      output_error
///   4. overlaps (into), as options.aliasing says                           aliasing_error
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
        if (!o.present || !same_shape(o.shape, c_.grads[0][i].shape) || o.strided) out.push_back({fault::output, i, i});
      }
    };
    check(c_.means);
    if (c_.pass_squares) check(c_.squares);
    else if (c_.include_square) out.push_back({fault::output, npos, npos});
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

  /// The expectation for average_gradients_into.
  [[nodiscard]] expectation into() const {
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

  /// The expectation for average_gradients (no outputs to check).
  [[nodiscard]] expectation allocating() const {
    expectation e;
    if (tower_stage(e.errors) || input_stage(e.errors)) return e;
    e.success_allowed = e.success_checked = true;
    return e;
  }

  [[nodiscard]] std::size_t v() const { return c_.variables(); }
  [[nodiscard]] bool skipped(std::size_t i) const { return !c_.grads[0][i].present; }

 private:
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

/// Reference of one element over T towers: mean, and the mean of squares with every product
/// but the first fused into its sum, and with none fused.
template <class S>
struct reference_element {
  S mean, fused, unfused;
};

template <class S>
GRADAVG_FUZZ_UNTRACED std::vector<reference_element<S>> reference(const S* arena,
                                                                const std::vector<std::size_t>& offsets,
                                                                std::size_t n) {
#pragma STDC FP_CONTRACT OFF
  std::vector<reference_element<S>> r(n);
  const S t = static_cast<S>(offsets.size());
  for (std::size_t j = 0; j < n; ++j) {
    S a = arena[offsets[0] + j];
    S fused = a * a;
    S unfused = fused;
    for (std::size_t k = 1; k < offsets.size(); ++k) {
      const S x = arena[offsets[k] + j];
      a = a + x;
      fused = std::fma(x, x, fused);
      const S product = x * x;
      unfused = unfused + product;
    }
    r[j] = {a / t, fused / t, unfused / t};
  }
  return r;
}

// ---- Running a case. ------------------------------------------------------------------------

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
  }
  return s.empty() ? "nothing" : s;
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
    return p.kind == t->kind && (t->index == p.index || t->index == p.other_index);
  });
  if (!known)
    fail(c, std::string(api) + " threw " + name(t->kind) + " (variable_index " +
                (t->index == npos ? std::string("npos") : std::to_string(t->index)) + ": " + t->what +
                "); the model expects " + (e.success_allowed ? "success or " : "") + "one of: " + list(e.errors));
  if (t->index != npos && std::string(t->what).find("#" + std::to_string(t->index)) == std::string::npos)
    fail(c, std::string(api) + ": the message does not name variable #" + std::to_string(t->index) + ": " + t->what);
  return false;
}

/// Which roundings of the squares a call's results are consistent with: bit 0 fused, bit 1 not.
/// Every element of a call must be rounded the same way (the scalar tail as the packets). Once
/// gradavg names the rule as a constant (fused exactly where the target has FMA), start from it.
struct square_rounding {
  unsigned possible = 3;
  GRADAVG_FUZZ_UNTRACED void check(const case_desc& c, const char* where, std::size_t j, double got_d, bool fused_ok, bool unfused_ok) {
    if (!fused_ok && !unfused_ok)
      fail(c, std::string(where) + ": mean of squares element " + std::to_string(j) + " is " + std::to_string(got_d) +
                  ", neither the fused nor the unfused reference");
    possible &= (fused_ok ? 1u : 0u) | (unfused_ok ? 2u : 0u);
    if (possible == 0)
      fail(c, std::string(where) + ": mean of squares element " + std::to_string(j) +
                  " is rounded unlike the other elements of the call (fused in some, not in others)");
  }
};

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
    before_.assign(arena_, arena_ + c.arena_size);
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

    gradavg::options opts;
    opts.include_square = c_.include_square;
    opts.threads = c_.threads;
    opts.streaming_stores = c_.streaming;
    opts.pool = c_.use_pool ? &shared_pool() : nullptr;

    // The allocating API reads the inputs only.
    const expectation ea = model_.allocating();
    std::optional<gradavg::averaged_gradients<owned<S>, int>> result;
    const auto ta = outcome_of([&] { result.emplace(gradavg::average_gradients(tg, opts)); });
    if (!arena_unchanged()) fail(c_, "average_gradients changed the arena");
    if (check_outcome(c_, "average_gradients", ta, ea)) check_allocating(*result);

    const expectation ei = model_.into();
    if (ei.set_mode) opts.aliasing = ei.mode;
    gradavg::summary sum;
    const auto ti = outcome_of([&] {
      sum = c_.pass_squares ? gradavg::average_gradients_into(tg, means, squares, opts)
                            : gradavg::average_gradients_into(tg, means, opts);
    });
    if (!check_outcome(c_, "average_gradients_into", ti, ei)) {
      if (!arena_unchanged())
        fail(c_, "average_gradients_into threw " + std::string(name(ti->kind)) + " but changed the arena");
      return;
    }
    check_into(sum, ei.success_checked);
  }

 private:
  GRADAVG_FUZZ_UNTRACED bool arena_unchanged() const {
    return c_.arena_size == 0 || std::memcmp(arena_, before_.data(), c_.arena_size * sizeof(S)) == 0;
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

  /// Variable i's reference, from the arena as it was before the calls; computed once.
  const std::vector<reference_element<S>>& reference_of(std::size_t i) {
    if (references_.empty()) references_.resize(model_.v());
    if (references_[i].empty() && c_.grads[0][i].count() > 0) {
      std::vector<std::size_t> offsets;
      for (std::size_t k = 0; k < c_.towers; ++k) offsets.push_back(c_.grads[k][i].offset);
      references_[i] = reference(before_.data(), offsets, c_.grads[0][i].count());
    }
    return references_[i];
  }

  GRADAVG_FUZZ_UNTRACED void check_allocating(const gradavg::averaged_gradients<owned<S>, int>& r) {
    std::size_t averaged = 0, skipped = 0;
    for (std::size_t i = 0; i < model_.v(); ++i) {
      const int variable = c_.vars[0][i];
      if (model_.skipped(i)) {
        if (skipped >= r.skipped.size() || r.skipped[skipped].index != i || r.skipped[skipped].variable != variable)
          fail(c_, "average_gradients: skipped list wrong at variable #" + std::to_string(i));
        ++skipped;
        continue;
      }
      const dims& want = c_.grads[0][i].shape;
      const std::vector<reference_element<S>>& ref = reference_of(i);
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
        for (std::size_t j = 0; j < want.size(); ++j) {
          if (sq)
            rounding_.check(c_, what.c_str(), j, double(t.values[j]), same_value(t.values[j], ref[j].fused),
                            same_value(t.values[j], ref[j].unfused));
          else if (!same_value(t.values[j], ref[j].mean))
            fail(c_, what + ": element " + std::to_string(j) + " is " + std::to_string(double(t.values[j])) +
                         ", want " + std::to_string(double(ref[j].mean)));
        }
      }
      ++averaged;
    }
    if (r.gradients.size() != averaged || r.skipped.size() != skipped ||
        r.squares.size() != (c_.include_square ? averaged : 0))
      fail(c_, "average_gradients: " + std::to_string(r.gradients.size()) + " means, " +
                   std::to_string(r.squares.size()) + " squares, " + std::to_string(r.skipped.size()) +
                   " skipped; want " + std::to_string(averaged) + ", " +
                   std::to_string(c_.include_square ? averaged : 0) + ", " + std::to_string(skipped));
  }

  /// Every arena element: unchanged, or the reference where an averaged variable's output lies
  /// (anything there when the results are not checked).
  GRADAVG_FUZZ_UNTRACED void check_into(const gradavg::summary& sum, bool checked) {
    std::vector<std::uint8_t> written(c_.arena_size, 0);  // in an averaged variable's output
    std::size_t averaged = 0;
    for (std::size_t i = 0; i < model_.v(); ++i) {
      if (model_.skipped(i)) continue;
      ++averaged;
      for (int sq = 0; sq <= (c_.pass_squares ? 1 : 0); ++sq) {
        const slot_desc& o = (sq ? c_.squares : c_.means)[i];
        std::fill_n(written.begin() + static_cast<std::ptrdiff_t>(o.offset), o.count(), std::uint8_t{1});
      }
    }
    if (sum.averaged != averaged || sum.skipped != model_.v() - averaged)
      fail(c_, "average_gradients_into: summary says " + std::to_string(sum.averaged) + " averaged, " +
                   std::to_string(sum.skipped) + " skipped; want " + std::to_string(averaged) + ", " +
                   std::to_string(model_.v() - averaged));
    for (std::size_t j = 0; j < c_.arena_size; ++j)
      if (!written[j] && std::memcmp(&arena_[j], &before_[j], sizeof(S)) != 0)
        fail(c_, "average_gradients_into changed arena element " + std::to_string(j) +
                     ", which is no averaged variable's output");
    if (!checked) return;
    // Checked layouts have no two outputs overlapping, so each holds its own results.
    for (std::size_t i = 0; i < model_.v(); ++i) {
      if (model_.skipped(i)) continue;
      const std::vector<reference_element<S>>& ref = reference_of(i);
      for (int sq = 0; sq <= (c_.pass_squares ? 1 : 0); ++sq) {
        const slot_desc& o = (sq ? c_.squares : c_.means)[i];
        const std::string what = std::string("average_gradients_into ") + (sq ? "squares" : "means") + " of #" + std::to_string(i);
        for (std::size_t j = 0; j < o.count(); ++j) {
          const S got = arena_[o.offset + j];
          if (sq)
            rounding_.check(c_, what.c_str(), j, double(got), same_value(got, ref[j].fused), same_value(got, ref[j].unfused));
          else if (!same_value(got, ref[j].mean))
            fail(c_, what + ": element " + std::to_string(j) + " is " + std::to_string(double(got)) + ", want " +
                         std::to_string(double(ref[j].mean)));
        }
      }
    }
  }

  const case_desc& c_;
  model model_;
  S* arena_ = nullptr;
  std::vector<S> before_;
  square_rounding rounding_;
  std::vector<std::vector<reference_element<S>>> references_;  // by variable
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
