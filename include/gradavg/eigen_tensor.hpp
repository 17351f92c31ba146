// gradavg: Eigen's Tensor module — Eigen::Tensor and Eigen::TensorMap (of mutable tensors, const
// tensors, or tensors of const elements), any rank up to gradavg::shape::max_rank, either layout, of float, double, Eigen::half or Eigen::bfloat16.
// Shape: the tensor's dimensions and layout. Results of the allocating API are Eigen::Tensor.
// The traits need only the declarations of Tensor and TensorMap: this header does not include the
// Tensor module (a unit that uses Eigen::Tensor includes it, before or after gradavg's headers).
#pragma once

#include <Eigen/Core>

#include <array>
#include <type_traits>

#include "detail/isa.hpp"
#include "tensor.hpp"

// The Tensor module's class templates, as the module declares them (its
// TensorForwardDeclarations.h declares them again, with their default arguments).
namespace Eigen {
template <typename Scalar, int NumIndices, int Options, typename IndexType>
class Tensor;
template <typename PlainObjectType, int Options, template <class> class MakePointer>
class TensorMap;
}  // namespace Eigen

namespace gradavg {
namespace shared_detail {

template <class T>
gradavg::shape eigen_tensor_shape(const T& t) noexcept {
  constexpr int rank = T::NumDimensions;
  static_assert(rank <= static_cast<int>(gradavg::shape::max_rank), "gradavg: tensor rank above shape::max_rank");
  gradavg::shape s;
  s.rank = static_cast<std::size_t>(rank);
  for (int d = 0; d < rank; ++d) s.dims[static_cast<std::size_t>(d)] = static_cast<std::int64_t>(t.dimension(d));
  s.order = static_cast<int>(T::Layout) == static_cast<int>(Eigen::RowMajor) ? storage_order::row_major
                                                                             : storage_order::col_major;
  return s;
}

template <class Scalar, int Rank, int Layout, class Index>
Eigen::Tensor<Scalar, Rank, Layout, Index> make_eigen_tensor(const gradavg::shape& s) {
  Eigen::Tensor<Scalar, Rank, Layout, Index> t;
  if constexpr (Rank > 0) {
    std::array<Index, static_cast<std::size_t>(Rank)> dims;
    for (int d = 0; d < Rank; ++d) dims[static_cast<std::size_t>(d)] = static_cast<Index>(s.dims[static_cast<std::size_t>(d)]);
    t.resize(dims);
  }
  return t;
}

}  // namespace shared_detail

template <class Scalar, int Rank, int Options, class Index>
struct tensor_traits<Eigen::Tensor<Scalar, Rank, Options, Index>> {
  using tensor_type = Eigen::Tensor<Scalar, Rank, Options, Index>;
  using value_type = Scalar;
  using result_type = Eigen::Tensor<Scalar, Rank, Options & Eigen::RowMajor, Index>;

  static const Scalar* data(const tensor_type& t) noexcept { return t.data(); }
  static Scalar* mutable_data(tensor_type& t) noexcept { return t.data(); }
  static gradavg::shape shape(const tensor_type& t) noexcept { return shared_detail::eigen_tensor_shape(t); }
  static result_type make(const gradavg::shape& s) {
    return shared_detail::make_eigen_tensor<Scalar, Rank, Options & Eigen::RowMajor, Index>(s);
  }
};

template <class Plain, int MapOptions, template <class> class MakePointer>
struct tensor_traits<Eigen::TensorMap<Plain, MapOptions, MakePointer>> {
  using map_type = Eigen::TensorMap<Plain, MapOptions, MakePointer>;
  using plain_type = std::remove_const_t<Plain>;
  // Read-only either way: TensorMap<const Tensor<float, N>> or TensorMap<Tensor<const float, N>>
  // (TensorFlow's ConstTensor spelling).
  static constexpr bool read_only = std::is_const_v<Plain> || std::is_const_v<typename plain_type::Scalar>;
  using value_type = std::remove_const_t<typename plain_type::Scalar>;
  using result_type = Eigen::Tensor<value_type, plain_type::NumDimensions, plain_type::Options & Eigen::RowMajor,
                                    typename plain_type::Index>;
  static constexpr bool view = true;

  static const value_type* data(const map_type& t) noexcept { return t.data(); }
  static value_type* mutable_data(map_type& t) noexcept
    requires(!read_only)
  {
    return t.data();
  }
  static gradavg::shape shape(const map_type& t) noexcept { return shared_detail::eigen_tensor_shape(t); }
  static result_type make(const gradavg::shape& s) {
    return shared_detail::make_eigen_tensor<value_type, plain_type::NumDimensions, plain_type::Options & Eigen::RowMajor,
                                     typename plain_type::Index>(s);
  }
};

}  // namespace gradavg
