// gradavg: libtorch's row-sparse gradients averaged without densifying them: a torch::Tensor in
// the sparse COO layout with one sparse dimension (what torch::nn::Embedding with
// EmbeddingOptions(...).sparse(true) leaves in its weight's grad()) read as sparse.hpp reads a
// row-sparse gradient, its dtype found at run time.
//
// A gradient here is a CPU tensor of layout torch::kSparse, sparse_dim() 1, coalesced or not
// (repeated indices add, in their order, as densify() says in sparse_types.hpp: no coalesce() is
// asked of the caller), with values of dtype float, double, half or bfloat16 packed row after row
// (_values() contiguous); its dense shape is its sizes(). An undefined tensor is the seed's None.
// Anything else is gradavg's error naming the variable and the tower: a dense or other-layout
// tensor or one on another device (unsupported_tensor_error), another dtype than the call's
// (element_type_error: one call reads one dtype, the first defined gradient's), an index outside
// the rows (index_error). The results are sparse.hpp's, bit for bit: the dense call's over
// to_dense() of every gradient.
//
// Link the CMake target gradavg::torch.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "detail/isa.hpp"
#include "detail/types.hpp"
#include "errors.hpp"
#include "options.hpp"
#include "results.hpp"
#include "sparse.hpp"
#include "sparse_types.hpp"
#include "torch_tensor.hpp"

namespace gradavg {

namespace libtorch {

/// A torch::Tensor read as a row-sparse gradient whose values are of type V (float, double,
/// Eigen::half for torch::kHalf, Eigen::bfloat16 for torch::kBFloat16); null or undefined: absent.
/// A view: the tensor must outlive the call.
template <class V>
struct sparse_coo {
  const at::Tensor* tensor = nullptr;
};

/// A dense torch::Tensor written as an output of element type O (the calls below make one per
/// output once they know the gradients' dtype). A view, like sparse_coo.
template <class O>
struct dense_output {
  const at::Tensor* tensor = nullptr;
};

}  // namespace libtorch

namespace shared_detail {

/// The dtype whose elements have V's bit layout.
template <class V>
constexpr at::ScalarType scalar_type_of_value() noexcept {
  if constexpr (std::is_same_v<V, double>)
    return at::kDouble;
  else if constexpr (std::is_same_v<V, Eigen::half>)
    return at::kHalf;
  else if constexpr (std::is_same_v<V, Eigen::bfloat16>)
    return at::kBFloat16;
  else
    return at::kFloat;
}

/// Throws unless t is a CPU sparse COO tensor with one sparse dimension and values of dtype
/// `values`.
inline void check_sparse_coo(const at::Tensor& t, at::ScalarType values) {
  if (!t.device().is_cpu())
    throw unsupported_tensor_error("a tensor on device " + t.device().str() + "; gradavg reads CPU tensors (.cpu())");
  if (t.layout() != at::kSparse)
    throw unsupported_tensor_error(std::string("a tensor of layout ") + c10::str(t.layout()) +
                                   "; this call reads sparse COO gradients (Embedding with sparse(true)): a dense "
                                   "gradient goes to the dense call (gradavg/torch.hpp)");
  if (t.sparse_dim() != 1)
    throw unsupported_tensor_error("a sparse tensor with " + std::to_string(t.sparse_dim()) +
                                   " sparse dimensions; gradavg reads row-sparse ones (sparse_dim() 1)");
  if (t.scalar_type() != values)
    throw element_type_error(std::string("values of dtype ") + c10::toString(t.scalar_type()) + " but the call's are " +
                             c10::toString(values) + " (its first defined gradient's): one call reads one dtype");
}

}  // namespace shared_detail

template <class V>
struct sparse_traits<libtorch::sparse_coo<V>> {
  using index_type = std::int64_t;
  using value_type = V;
  static constexpr bool view = true;
  using G = libtorch::sparse_coo<V>;

  static bool present(const G& g) noexcept { return g.tensor != nullptr && g.tensor->defined(); }
  static std::span<const std::int64_t> indices(const G& g) {
    shared_detail::check_sparse_coo(*g.tensor, shared_detail::scalar_type_of_value<V>());
    const at::Tensor ix = g.tensor->_indices();
    return {ix.data_ptr<std::int64_t>(), static_cast<std::size_t>(ix.size(1))};
  }
  static const V* values(const G& g) {
    shared_detail::check_sparse_coo(*g.tensor, shared_detail::scalar_type_of_value<V>());
    return static_cast<const V*>(g.tensor->_values().data_ptr());
  }
  static shape values_shape(const G& g) {
    const at::Tensor v = g.tensor->_values();
    return shape::from_dims(std::span<const std::int64_t>(v.sizes().data(), v.sizes().size()));
  }
  static shape dense_shape(const G& g) {
    const auto sizes = g.tensor->sizes();
    return shape::from_dims(std::span<const std::int64_t>(sizes.data(), sizes.size()));
  }
  /// The values rows packed, and the indices' one row too.
  static bool contiguous(const G& g) {
    const at::Tensor ix = g.tensor->_indices();
    return g.tensor->_values().is_contiguous() && (ix.size(1) <= 1 || ix.stride(1) == 1);
  }
};

template <class O>
struct tensor_traits<libtorch::dense_output<O>> {
  using value_type = O;
  static constexpr bool view = true;
  using T = libtorch::dense_output<O>;

  static bool present(const T& t) noexcept { return t.tensor != nullptr && t.tensor->defined(); }
  static const O* data(const T& t) { return mutable_data(t); }
  static O* mutable_data(const T& t) {
    shared_detail::check_readable(*t.tensor);
    if (t.tensor->scalar_type() != shared_detail::scalar_type_of_value<O>())
      throw output_error(std::string("an output of dtype ") + c10::toString(t.tensor->scalar_type()) +
                         " where the call writes " + c10::toString(shared_detail::scalar_type_of_value<O>()) +
                         " (the gradients' dtype, or float for 16-bit gradients: all outputs alike)");
    return static_cast<O*>(t.tensor->data_ptr());
  }
  /// Its sizes: a row-sparse gradient's dense value is row-major, so only a contiguous output
  /// holds it as the same sizes.
  static gradavg::shape shape(const T& t) {
    const auto sizes = t.tensor->sizes();
    return gradavg::shape::from_dims(std::span<const std::int64_t>(sizes.data(), sizes.size()));
  }
  static bool contiguous(const T& t) { return t.tensor->is_contiguous(); }
  static std::string describe(const T& t) { return tensor_traits<at::Tensor>::describe(*t.tensor); }
};

namespace libtorch {
GRADAVG_BEGIN_ISA_NAMESPACE

/// Towers of (gradient, variable) pairs, as the dense calls over torch::Tensor take them.
using tower_pairs = std::span<const std::vector<std::pair<at::Tensor, at::Tensor>>>;

namespace detail {

/// The call's gradients' dtype: the first defined gradient's, in tower then variable order, when
/// gradavg reads it (float otherwise, and where none is defined: the traits then name what is
/// wrong, where it is). TG: towers of (at::Tensor gradient, variable) pairs.
template <class TG>
at::ScalarType gradients_dtype(const TG& tg) noexcept {
  for (const auto& tower : tg)
    for (const auto& [g, v] : tower)
      if (g.defined()) {
        const at::ScalarType s = g.scalar_type();
        return s == at::kDouble || s == at::kHalf || s == at::kBFloat16 ? s : at::kFloat;
      }
  return at::kFloat;
}

/// Float where the gradients are 16-bit and the first defined output is float, else the
/// gradients' dtype (an output of another dtype is then the traits' output_error).
inline at::ScalarType outputs_dtype(at::ScalarType gradients, std::span<const at::Tensor> means) noexcept {
  if (gradients != at::kHalf && gradients != at::kBFloat16) return gradients;
  for (const at::Tensor& m : means)
    if (m.defined()) return m.scalar_type() == at::kFloat ? at::kFloat : gradients;
  return gradients;
}

/// Calls f.template operator()<S>() with the value type of the gradients' dtype (one gradavg
/// reads: gradients_dtype), through the element type list (detail/types.hpp).
template <class F>
decltype(auto) with_value_type(at::ScalarType gradients, F&& f) {
  return gradavg::detail::with_element(shared_detail::element_of(gradients), std::forward<F>(f));
}

/// Calls f.template operator()<S, O>() with the value types of those dtypes: O is float where the
/// outputs are and S's traits allow float outputs (16-bit S), else S.
template <class F>
decltype(auto) with_sparse_types(at::ScalarType gradients, at::ScalarType outputs, F&& f) {
  return with_value_type(gradients, [&]<class S>() {
    if constexpr (gradavg::detail::element_traits<S>::float_outputs)
      if (outputs == at::kFloat) return f.template operator()<S, float>();
    return f.template operator()<S, S>();
  });
}

/// tg's towers with each gradient as sparse_coo<V>, the variables copied (a tensor's reference
/// count, a name's view).
template <class V, class TG>
auto typed_towers(const TG& tg) {
  using Variable = typename std::ranges::range_value_t<std::ranges::range_value_t<TG>>::second_type;
  std::vector<std::vector<std::pair<sparse_coo<V>, Variable>>> towers(std::ranges::size(tg));
  for (std::size_t k = 0; k < towers.size(); ++k) {
    towers[k].reserve(std::ranges::size(tg[k]));
    for (const auto& [g, v] : tg[k]) towers[k].emplace_back(sparse_coo<V>{&g}, v);
  }
  return towers;
}

template <class O>
std::vector<dense_output<O>> typed_outputs(std::span<const at::Tensor> outputs) {
  std::vector<dense_output<O>> typed;
  typed.reserve(outputs.size());
  for (const at::Tensor& t : outputs) typed.push_back({&t});
  return typed;
}

/// Coalesced rows as a coalesced sparse COO tensor that owns them (no copy).
template <class V>
at::Tensor to_sparse_coo(sparse_rows<std::int64_t, V>&& rows) {
  auto owner = std::make_shared<sparse_rows<std::int64_t, V>>(std::move(rows));
  const auto n = static_cast<std::int64_t>(owner->indices.size());
  const shape& dense = owner->dense_shape;
  std::vector<std::int64_t> value_sizes{n};
  for (std::size_t d = 1; d < dense.rank; ++d) value_sizes.push_back(dense.dims[d]);
  const auto keep = [owner](void*) {};
  at::Tensor indices = at::from_blob(owner->indices.data(), {1, n}, keep, at::TensorOptions(at::kLong));
  at::Tensor values = at::from_blob(owner->values.data(), value_sizes, keep,
                                    at::TensorOptions(shared_detail::scalar_type_of_value<V>()));
  at::Tensor result = at::_sparse_coo_tensor_unsafe(indices, values, at::IntArrayRef(dense.dims.data(), dense.rank),
                                                    values.options().layout(at::kSparse));
  result._coalesced_(true);
  return result;
}

/// The allocating call over towers of (at::Tensor gradient, variable) pairs: each mean (and
/// square) a coalesced sparse COO tensor of the gradients' dtype.
template <class TG>
auto average_sparse_allocating(const TG& tg, bool with_squares, const options& opts) {
  using Variable = typename std::ranges::range_value_t<std::ranges::range_value_t<TG>>::second_type;
  return with_value_type(gradients_dtype(tg), [&]<class S>() {
    const auto towers = typed_towers<S>(tg);
    auto r = with_squares ? gradavg::average_gradients(towers, include_square, opts)
                          : gradavg::average_gradients(towers, opts);
    averaged_gradients<at::Tensor, Variable> result;
    result.report = r.report;
    result.skipped = std::move(r.skipped);
    for (auto& [rows, variable] : r.gradients) result.gradients.emplace_back(to_sparse_coo(std::move(rows)), variable);
    for (auto& [rows, variable] : r.squares) result.squares.emplace_back(to_sparse_coo(std::move(rows)), variable);
    return result;
  });
}

}  // namespace detail

/// Averages row-sparse gradients (see the file comment) into dense outputs the caller owns: for
/// each averaged variable i, means[i] (a defined, contiguous CPU tensor of the dense shape, of
/// the gradients' dtype or float for 16-bit gradients) receives the mean over
/// towers of the densified gradients, every element written; outputs of skipped variables are left
/// untouched and may be undefined. Everything is checked first: after an exception, the outputs
/// are unchanged. Allocates the calls' tables of views (a vector per tower) and scratch.
inline summary average_sparse_gradients_into(tower_pairs tower_grads, std::span<const at::Tensor> means,
                                             const options& opts = {}) {
  const at::ScalarType s = detail::gradients_dtype(tower_grads);
  return detail::with_sparse_types(s, detail::outputs_dtype(s, means), [&]<class S, class O>() {
    auto out = detail::typed_outputs<O>(means);
    return gradavg::average_gradients_into(detail::typed_towers<S>(tower_grads), out, opts);
  });
}

/// As above, and squares[i] receives the mean over towers of the squared densified gradients (of
/// the means' dtype).
inline summary average_sparse_gradients_into(tower_pairs tower_grads, std::span<const at::Tensor> means,
                                             std::span<const at::Tensor> squares, const options& opts = {}) {
  const at::ScalarType s = detail::gradients_dtype(tower_grads);
  return detail::with_sparse_types(s, detail::outputs_dtype(s, means), [&]<class S, class O>() {
    auto out = detail::typed_outputs<O>(means);
    auto sq = detail::typed_outputs<O>(squares);
    return gradavg::average_gradients_into(detail::typed_towers<S>(tower_grads), out, sq, opts);
  });
}

/// The seed's _average_gradients over row-sparse gradients: each averaged variable's mean as a
/// coalesced sparse COO tensor (is_coalesced(): indices ascending, each once) of the gradients'
/// dtype and dense shape, holding the rows some tower lists, paired with tower 0's variable; the
/// skipped variables; the summary.
inline averaged_gradients<at::Tensor, at::Tensor> average_sparse_gradients(tower_pairs tower_grads,
                                                                          const options& opts = {}) {
  return detail::average_sparse_allocating(tower_grads, false, opts);
}

/// As above, with the means of the squared gradients (the seed's include_square=True).
inline averaged_gradients<at::Tensor, at::Tensor> average_sparse_gradients(tower_pairs tower_grads, include_square_t,
                                                                          const options& opts = {}) {
  return detail::average_sparse_allocating(tower_grads, true, opts);
}

GRADAVG_END_ISA_NAMESPACE
}  // namespace libtorch
}  // namespace gradavg
