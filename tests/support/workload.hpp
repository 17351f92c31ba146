// Test helpers for the thread tests: towers of float gradients over variables of given sizes,
// averaged into fresh outputs, and bitwise comparison of results.
#pragma once

#include <gradavg/gradavg.hpp>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "reference.hpp"
#include "support.hpp"

namespace gradavg_test {

using grads = std::vector<float>;

/// Towers over variables of awkward sizes, larger in total than several chunks.
struct workload {
  std::vector<std::vector<grads>> data;  // [tower][variable]
  std::vector<std::vector<std::pair<const grads*, int>>> tg;

  workload(std::size_t towers, const std::vector<std::size_t>& sizes) : data(towers), tg(towers) {
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i)
        data[k].push_back(random_values<float>(sizes[i], static_cast<std::uint32_t>(1000 * k + i)));
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i) tg[k].push_back({&data[k][i], static_cast<int>(i)});
  }

  /// Outputs shaped like the gradients, filled with -1.
  [[nodiscard]] std::vector<grads> outputs() const {
    std::vector<grads> out;
    for (const auto& g : data[0]) out.push_back(grads(g.size(), -1.0f));
    return out;
  }

  /// (means, squares) of a call with opts.
  std::pair<std::vector<grads>, std::vector<grads>> run(const gradavg::options& opts) const {
    std::vector<grads> means = outputs(), squares = outputs();
    gradavg::average_gradients_into(tg, means, squares, opts);
    return {means, squares};
  }
};

inline bool bitwise_equal(const std::vector<grads>& a, const std::vector<grads>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || !same_bits(a[i].data(), b[i].data(), a[i].size())) return false;
  return true;
}

}  // namespace gradavg_test
