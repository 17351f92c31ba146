// gradavg internals: the table of buffers the checks record and the pass reads (a plan keeps it
// as its proof), and the byte ranges the overlap check sorts. Shared by every instruction-set
// level (pointers and sizes only).
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

/// A call's buffers as its checks recorded them, the table the pass, the kernel, a plan's check
/// and the MPI tables read: variable i's row of `stride` first bytes at firsts + i * stride — its
/// gradient on each tower, its means, its squares (when passed) — and its element count
/// elements[i], the same for every buffer of the row (0 for a skipped variable, whose first bytes
/// are then null or unused). One pointer per buffer and one count per variable: the least a step
/// reads to know its buffers.
struct buffer_table {
  const std::byte* const* firsts = nullptr;
  const std::size_t* elements = nullptr;
  std::size_t stride = 0;

  /// Variable i's row of first bytes.
  [[nodiscard]] const std::byte* const* row(std::size_t i) const noexcept { return firsts + i * stride; }
  /// Buffer `slot` of variable i's row, as T; outputs are writable (the checks recorded them from
  /// the caller's mutable outputs).
  template <class T>
  [[nodiscard]] T* buffer(std::size_t i, std::size_t slot) const noexcept {
    return const_cast<T*>(reinterpret_cast<const T*>(firsts[i * stride + slot]));
  }
};

/// Which buffer a byte range is: variable i's gradient on one tower, its means or its squares.
struct tagged_range {
  enum kind_t : std::uint8_t { gradient, means, squares };
  byte_range bytes;
  std::size_t variable;
  std::size_t tower;  // gradients only
  kind_t kind;
};

/// What a plan keeps of its checks (plan.hpp): the first byte, in call order, of every gradient
/// and output of the call that proved the layout — for each variable, its gradient on each tower,
/// its means output, its squares output — and each variable's element count (buffer_table), with
/// the tower count and whether squares were passed, and the overlap sort's room. A call that
/// proves again over the same buffers skips the sort; a failed call forgets the layout (proved
/// false).
struct layout_proof {
  std::vector<const std::byte*> firsts;  // the order above
  std::vector<std::size_t> elements;  // per variable
  std::vector<tagged_range> sorted;  // the sort's room
  std::size_t towers = 0;
  bool squares = false;
  std::size_t gradient_size = 0, output_size = 0;  // bytes per element: with the table, the bytes proved
  bool proved = false;

  [[nodiscard]] buffer_table table() const noexcept {
    return {firsts.data(), elements.data(), towers + (squares ? 2 : 1)};
  }
};

}  // namespace shared_detail
}  // namespace gradavg
