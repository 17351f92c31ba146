// gradavg: what the allocating average_gradients returns — the means (and means of squares)
// paired with their variables, the skipped variables and the call's summary — shared by every
// instruction-set level.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "statistics.hpp"

namespace gradavg {

/// A variable whose gradient was absent on every tower.
template <class Variable>
struct skipped_variable {
  std::size_t index;  ///< position in the towers' variable order
  Variable variable;  ///< tower 0's variable
};

/// What average_gradients returns: the seed's (average_grads, average_grads_square), plus the
/// variables it skipped, which the seed only printed.
template <class Tensor, class Variable>
struct averaged_gradients {
  /// (mean gradient, tower 0's variable) for every averaged variable, in variable order.
  std::vector<std::pair<Tensor, Variable>> gradients;
  /// (mean of squared gradients, variable), same order; empty unless include_square was passed.
  std::vector<std::pair<Tensor, Variable>> squares;
  /// Variables left out because their gradient was absent on every tower.
  std::vector<skipped_variable<Variable>> skipped;
  /// Counts, non-finite report and fused statistics, as average_gradients_into returns them.
  summary report;
};

}  // namespace gradavg
