// A tensor type that counts how often its shape is read: for the tests of how many times a call
// reads each gradient.
#pragma once

#include <gradavg/tensor.hpp>

#include <cstddef>
#include <vector>

namespace gradavg_test {

/// A vector of floats; each tensor_traits::shape of it adds one to *reads when reads is set
/// (the results the allocating calls make leave it null).
struct counted_vector {
  std::vector<float> values;
  std::size_t* reads = nullptr;
};

}  // namespace gradavg_test

template <>
struct gradavg::tensor_traits<gradavg_test::counted_vector> {
  using value_type = float;
  using result_type = gradavg_test::counted_vector;
  static const float* data(const gradavg_test::counted_vector& t) noexcept { return t.values.data(); }
  static float* mutable_data(gradavg_test::counted_vector& t) noexcept { return t.values.data(); }
  static gradavg::shape shape(const gradavg_test::counted_vector& t) noexcept {
    if (t.reads != nullptr) ++*t.reads;
    return gradavg::shape::vector(t.values.size());
  }
  static gradavg_test::counted_vector make(const gradavg::shape& s) { return {std::vector<float>(s.size()), nullptr}; }
};
