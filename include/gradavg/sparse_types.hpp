// gradavg: the row-sparse gradient vocabulary — what TensorFlow calls IndexedSlices and a sparse
// embedding's gradient is: some rows of a dense tensor, named by their indices.
//
// A row-sparse gradient g stands for a dense tensor of shape dense_shape = [rows, d1, ..., dk]
// (row-major, k >= 0) that is zero except in the rows it lists. indices[n] is the row that values
// row n belongs to: in [0, rows), in any order, repeated where the same row is given twice. Each
// values row holds row_length = d1 * ... * dk elements, the rows one after another:
// values_shape is [indices.size(), d1, ..., dk].
// Its dense value, densify(g): row r is the values rows of index r summed in index order in the
// value type (the first taken as it is, each next one added: Eigen::half and Eigen::bfloat16 add
// through float and round), and 0 where no index is r.
//
// The sparse_traits<T> customisation point reads a type as such a gradient:
//   using index_type = ...;                 // std::int32_t or std::int64_t
//   using value_type = ...;                 // float, double, Eigen::half or Eigen::bfloat16
//   static std::span<const index_type> indices(const T&);
//   static const value_type* values(const T&);   // the first element of the values rows
//   static gradavg::shape values_shape(const T&);
//   static gradavg::shape dense_shape(const T&);
// and optionally present(t) (false: the seed's None) and contiguous(t) (false: the values rows are
// strided, which is refused), as tensor_traits has them. They are called on the calling thread
// during validation only, like tensor_traits' (tensor.hpp).
//
// Shipped: row_sparse (a view over memory the caller owns, made by rows_of from spans or from a
// pair of Eigen objects) and sparse_rows (owning, coalesced: what the averaging calls write).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "statistics.hpp"
#include "tensor.hpp"

namespace gradavg {

/// A row-sparse gradient over memory the caller owns (see the file comment).
template <class Index, class Value>
struct row_sparse {
  std::span<const Index> indices;
  const Value* values = nullptr;
  shape values_shape{};
  shape dense_shape{};
  bool contiguous = true;  ///< false: the values rows are not packed row after row (refused)
};

/// Coalesced row-sparse values that own their memory: indices ascending, each once, and one values
/// row for each. What the averaging calls write when the output passed is one of these.
template <class Index, class Value>
struct sparse_rows {
  using index_type = Index;
  using value_type = Value;

  std::vector<Index> indices;
  std::vector<Value> values;  ///< indices.size() rows of row_length() elements
  shape dense_shape{};

  /// Elements per row: the product of dense_shape's dimensions after the first.
  [[nodiscard]] std::size_t row_length() const noexcept {
    std::size_t n = 1;
    for (std::size_t d = 1; d < dense_shape.rank; ++d) n *= static_cast<std::size_t>(dense_shape.dims[d]);
    return n;
  }
};

/// Primary template: not a row-sparse gradient. Specialise it (see the file comment).
template <class T>
struct sparse_traits {};

/// The index types a row-sparse gradient may have.
template <class I>
concept sparse_index = std::same_as<I, std::int32_t> || std::same_as<I, std::int64_t>;

/// T is readable as a row-sparse gradient through sparse_traits.
template <class T>
concept sparse_tensor = requires(const T& t) {
  typename sparse_traits<T>::index_type;
  typename sparse_traits<T>::value_type;
  { sparse_traits<T>::indices(t) } -> std::convertible_to<std::span<const typename sparse_traits<T>::index_type>>;
  { sparse_traits<T>::values(t) } -> std::convertible_to<const typename sparse_traits<T>::value_type*>;
  { sparse_traits<T>::values_shape(t) } -> std::same_as<shape>;
  { sparse_traits<T>::dense_shape(t) } -> std::same_as<shape>;
};

template <class Index, class Value>
struct sparse_traits<row_sparse<Index, Value>> {
  using index_type = Index;
  using value_type = Value;
  static constexpr bool view = true;
  static std::span<const Index> indices(const row_sparse<Index, Value>& g) noexcept { return g.indices; }
  static const Value* values(const row_sparse<Index, Value>& g) noexcept { return g.values; }
  static gradavg::shape values_shape(const row_sparse<Index, Value>& g) noexcept { return g.values_shape; }
  static gradavg::shape dense_shape(const row_sparse<Index, Value>& g) noexcept { return g.dense_shape; }
  static bool contiguous(const row_sparse<Index, Value>& g) noexcept { return g.contiguous; }
};

template <class Index, class Value>
struct sparse_traits<sparse_rows<Index, Value>> {
  using index_type = Index;
  using value_type = Value;
  static std::span<const Index> indices(const sparse_rows<Index, Value>& g) noexcept { return g.indices; }
  static const Value* values(const sparse_rows<Index, Value>& g) noexcept { return g.values.data(); }
  static gradavg::shape values_shape(const sparse_rows<Index, Value>& g) noexcept {
    gradavg::shape s = g.dense_shape;
    if (s.rank == 0) s.rank = 1;
    s.dims[0] = static_cast<std::int64_t>(g.indices.size());
    // A values vector of another length than the rows need shows as a row length that differs.
    const std::size_t rows = g.indices.size(), length = g.row_length();
    if (rows > 0 && g.values.size() != rows * length) {
      s = gradavg::shape::matrix(static_cast<std::int64_t>(rows), static_cast<std::int64_t>(g.values.size() / rows));
      if (g.values.size() % rows != 0) s.dims[1] = -1;
    }
    return s;
  }
  static gradavg::shape dense_shape(const sparse_rows<Index, Value>& g) noexcept { return g.dense_shape; }
};

/// A row_sparse view of `indices` and the values rows at `values` (row_length elements each, row
/// after row) of a dense tensor of shape dense_shape.
template <sparse_index Index, class Value>
row_sparse<Index, Value> rows_of(std::span<const Index> indices, const Value* values, const shape& dense_shape) noexcept {
  row_sparse<Index, Value> g{indices, values, dense_shape, dense_shape, true};
  if (g.values_shape.rank == 0) g.values_shape.rank = 1;
  g.values_shape.dims[0] = static_cast<std::int64_t>(indices.size());
  return g;
}

/// A row_sparse view of an Eigen vector of indices and an Eigen matrix of values (one row per
/// index) of a dense [dense_rows, values.cols()] tensor. Both must stay alive while it is read;
/// values must be row-major with packed rows (a col-major or strided one is refused by the call,
/// naming the variable).
template <class IndexVector, class ValueMatrix>
  requires sparse_index<std::remove_const_t<typename IndexVector::Scalar>>
auto rows_of(const IndexVector& indices, const ValueMatrix& values, std::int64_t dense_rows) noexcept {
  using Index = std::remove_const_t<typename IndexVector::Scalar>;
  using Value = std::remove_const_t<typename ValueMatrix::Scalar>;
  row_sparse<Index, Value> g;
  g.indices = std::span<const Index>(indices.data(), static_cast<std::size_t>(indices.size()));
  g.values = values.data();
  const bool rows_packed = ValueMatrix::IsRowMajor || values.rows() <= 1 || values.cols() <= 1;
  g.values_shape = shape::matrix(static_cast<std::int64_t>(values.rows()), static_cast<std::int64_t>(values.cols()),
                                 rows_packed ? storage_order::row_major : storage_order::col_major);
  g.dense_shape = shape::matrix(dense_rows, static_cast<std::int64_t>(values.cols()));
  g.contiguous = (indices.size() <= 1 || indices.innerStride() == 1) &&
                 (values.size() <= 1 || ((values.innerSize() <= 1 || values.innerStride() == 1) &&
                                         (values.outerSize() <= 1 || values.outerStride() == values.innerSize())));
  return g;
}

namespace shared_detail {

/// The scratch of the averaging calls over row-sparse gradients (detail/sparse_pass.hpp).
struct sparse_scratch {
  /// A values row: its index, tower and position in the tower's values.
  struct entry {
    std::uint64_t row;
    std::size_t tower;
    std::size_t position;
  };
  /// The table rows of the index rows that `listing` towers list (blocks[listing]): each reads
  /// `towers` buffers (a row of zeros first, unless every tower lists the row).
  struct block {
    std::size_t rows, elements, towers;
    std::size_t first_row, first_slot;  // in elements and in firsts
    std::size_t next;                   // the next row to fill
  };
  /// A buffer the overlap check sorts: a gradient's indices or values, or an output.
  struct tagged_bytes {
    const std::byte* first;
    const std::byte* last;
    std::size_t variable;
    std::size_t tower;
    std::uint8_t kind;  // 0 indices, 1 values, 2 means, 3 squares
  };
  std::vector<unsigned char> present;      // per variable: averaged (not skipped)
  std::vector<shape> dense;                // per variable: its dense shape
  std::vector<std::size_t> starts;         // counting order: per dense row, its first entry
  std::vector<entry> entries;              // every values row, by (variable, row, tower, position)
  std::vector<std::size_t> first_entry;    // per variable, and one past the last
  std::vector<std::size_t> first_row;      // per variable: its first row in index order, and the end
  std::vector<std::size_t> groups;         // per row of one variable, in index order: its first entry
  std::vector<block> blocks;               // per count of towers listing a row
  std::vector<const std::byte*> values;    // per tower: the variable's first values element
  std::vector<const std::byte*> firsts;    // the table the kernel reads (buffer_table)
  std::vector<std::size_t> elements;
  std::vector<std::byte> bytes;            // the zero row, then the sums of repeated indices
  std::vector<variable_statistics> rows;   // per table row, fused calls only
  std::vector<tagged_bytes> ranges;

  [[nodiscard]] std::size_t capacity_bytes() const noexcept {
    return present.capacity() + dense.capacity() * sizeof(shape) +
           (starts.capacity() + first_entry.capacity() + first_row.capacity() + groups.capacity() +
            elements.capacity()) *
               sizeof(std::size_t) +
           entries.capacity() * sizeof(entry) + (values.capacity() + firsts.capacity()) * sizeof(const std::byte*) +
           bytes.capacity() + rows.capacity() * sizeof(variable_statistics) + ranges.capacity() * sizeof(tagged_bytes) +
           blocks.capacity() * sizeof(block);
  }
};

struct sparse_access;

}  // namespace shared_detail

/// The scratch of the averaging calls over row-sparse gradients (the rows' order, the table the
/// kernel reads, the sums of repeated indices), kept between calls: a training loop's calls with
/// the same workspace allocate nothing once it has grown to their size. Calls without one
/// allocate their scratch. Not thread-safe: one call at a time. Shared by every instruction-set
/// level.
class sparse_workspace {
 public:
  sparse_workspace() = default;

  /// Bytes of scratch held.
  [[nodiscard]] std::size_t capacity_bytes() const noexcept { return scratch_.capacity_bytes(); }

 private:
  friend struct shared_detail::sparse_access;
  shared_detail::sparse_scratch scratch_;
};

namespace shared_detail {
struct sparse_access {
  static sparse_scratch& of(sparse_workspace& w) noexcept { return w.scratch_; }
};
}  // namespace shared_detail

}  // namespace gradavg
