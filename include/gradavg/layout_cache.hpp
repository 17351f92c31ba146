// gradavg: layout_cache — scratch memory for average_gradients_into's overlap check, and the
// buffer layout its last successful call proved free of forbidden overlaps. Owned by the caller,
// passed as options.check.layout, reused across calls (typically one per training loop). A plan
// (plan.hpp) keeps this proof and the rest of the checks' too; prefer it in a training loop.
//
// Shared by every instruction-set level of a program (it holds pointers and sizes only).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace gradavg {

namespace shared_detail {

/// Bytes a buffer occupies: [first, last). Trivial, so scratch arrays of them cost nothing to
/// declare; byte_range{} is empty.
struct byte_range {
  const std::byte* first;
  const std::byte* last;  // one past the end

  [[nodiscard]] bool empty() const noexcept { return first == last; }
  [[nodiscard]] bool overlaps(const byte_range& o) const noexcept {
    const std::less<const std::byte*> before;
    return !empty() && !o.empty() && before(first, o.last) && before(o.first, last);
  }
  friend bool operator==(const byte_range&, const byte_range&) = default;
};

/// Which buffer a byte range is: variable i's gradient on one tower, its means or its squares.
struct tagged_range {
  enum kind_t : std::uint8_t { gradient, means, squares };
  byte_range bytes;
  std::size_t variable;
  std::size_t tower;  // gradients only
  kind_t kind;
};

struct layout_cache_access;

}  // namespace shared_detail

/// Pass one as options.check.layout to average_gradients_into to make its default overlap check
/// (alias_check::all) allocate nothing after the first call and cost O(N) instead of
/// O(N log N) when the buffers are the same as in the previous call.
///
/// What it remembers: the exact byte range, in call order, of every gradient and output of the
/// last call that passed the check — for each variable, its gradient on each tower, its means
/// output, its squares output. A call compares each buffer it reads with the remembered one, range
/// by range (no hashing); if every range and the tower count and squares/no-squares are equal,
/// the same overlap verdict holds and the sort is skipped. Anything else — one pointer or size
/// different, a variable more or fewer — re-runs the full check and remembers the new layout once
/// it passes. A failed call forgets the layout.
///
/// Not thread-safe: one cache serves one call at a time. Copying gives an independent cache.
class layout_cache {
 public:
  layout_cache() = default;

  /// Forgets the remembered layout (memory is kept for reuse).
  void clear() noexcept { proved_ = false; }

 private:
  friend struct shared_detail::layout_cache_access;

  std::vector<shared_detail::byte_range> layout_;     // canonical order, see above
  std::vector<shared_detail::tagged_range> sorted_;   // scratch for the sort
  std::size_t towers_ = 0;
  bool squares_ = false;
  bool proved_ = false;
};

namespace shared_detail {

/// The library's access to a layout_cache's members.
struct layout_cache_access {
  static std::vector<byte_range>& layout(layout_cache& c) noexcept { return c.layout_; }
  static std::vector<tagged_range>& sorted(layout_cache& c) noexcept { return c.sorted_; }
  static std::size_t& towers(layout_cache& c) noexcept { return c.towers_; }
  static bool& squares(layout_cache& c) noexcept { return c.squares_; }
  static bool& proved(layout_cache& c) noexcept { return c.proved_; }
};

}  // namespace shared_detail
}  // namespace gradavg
