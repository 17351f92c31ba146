// gradavg internals: the byte ranges the overlap check sorts, and the layout a plan keeps of its
// last proof. Shared by every instruction-set level (pointers and sizes only).
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

/// How many T a table row's buffer holds.
template <class T>
[[nodiscard]] std::size_t elements_in(const byte_range& r) noexcept {
  return static_cast<std::size_t>(r.last - r.first) / sizeof(T);
}

/// A table row's output buffer, writable: the checks recorded it from the caller's mutable output.
template <class T>
[[nodiscard]] T* output_start(const byte_range& r) noexcept {
  return const_cast<T*>(reinterpret_cast<const T*>(r.first));
}

/// Which buffer a byte range is: variable i's gradient on one tower, its means or its squares.
struct tagged_range {
  enum kind_t : std::uint8_t { gradient, means, squares };
  byte_range bytes;
  std::size_t variable;
  std::size_t tower;  // gradients only
  kind_t kind;
};

/// What a plan keeps of its checks (plan.hpp): the exact byte range, in call order, of every
/// gradient and output of the call that proved the layout — for each variable, its gradient on
/// each tower, its means output, its squares output — with the tower count and whether squares
/// were passed, and the overlap sort's room. A call that proves again over the same ranges skips
/// the sort; a failed call forgets the layout (proved false).
struct layout_proof {
  std::vector<byte_range> layout;  // the order above
  std::vector<tagged_range> sorted;  // the sort's room
  std::size_t towers = 0;
  bool squares = false;
  bool proved = false;
};

}  // namespace shared_detail
}  // namespace gradavg
