// Tower data for the benchmark binaries: one set of towers at a time, regenerated when the
// element type or P changes. 16-bit towers (Eigen::half, Eigen::bfloat16) hold the float towers'
// values rounded to nearest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <typeindex>
#include <variant>
#include <vector>

#include <Eigen/Core>

#include "common.hpp"

namespace gradavg_bench {

/// Tower t always holds the same values for a given (type, P), whatever T a benchmark uses, so
/// a T-sweep reads a prefix of one set. Registering benchmarks so that (type, P) runs are
/// contiguous keeps regeneration rare. Pointers returned stay valid until a call with another
/// type or P.
class tower_cache {
 public:
  template <class S>
  std::vector<const S*> get(std::size_t towers, std::size_t elements) {
    if (type_ != std::type_index(typeid(S)) || elements_ != elements) {
      data_ = std::monostate{};  // free the old set before allocating the new one
      data_ = std::vector<aligned_buffer<S>>{};
      type_ = std::type_index(typeid(S));
      elements_ = elements;
    }
    auto& set = std::get<std::vector<aligned_buffer<S>>>(data_);
    while (set.size() < towers) {
      set.emplace_back(elements);
      fill(set.back().span(), static_cast<std::uint32_t>(1000 + set.size()));
    }
    std::vector<const S*> out;
    for (std::size_t t = 0; t < towers; ++t) out.push_back(set[t].data());
    return out;
  }

 private:
  template <class S>
  static void fill(std::span<S> out, std::uint32_t seed) {
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, double>) {
      fill_uniform(out, seed);
    } else {
      aligned_buffer<float> values(out.size());
      fill_uniform(values.span(), seed);
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = S(values.data()[i]);
    }
  }

  std::type_index type_ = std::type_index(typeid(void));
  std::size_t elements_ = 0;
  std::variant<std::monostate, std::vector<aligned_buffer<float>>,
               std::vector<aligned_buffer<double>>, std::vector<aligned_buffer<Eigen::half>>,
               std::vector<aligned_buffer<Eigen::bfloat16>>>
      data_;
};

/// The binary's one tower cache.
inline tower_cache& towers_cache() {
  static tower_cache c;
  return c;
}

}  // namespace gradavg_bench
