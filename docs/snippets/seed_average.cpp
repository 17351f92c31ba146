#include <gradavg/gradavg.hpp>

#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

// tower_grads[k][i] is the (gradient, variable) pair of variable i on tower k: the seed's list
// of lists. Ref<const MatrixXf> views a tower's VectorXf or MatrixXf without copying it;
// std::nullopt is the seed's None. Variables here are names: any type works, and types with ==
// are checked to be the same on every tower.
using gradient = std::optional<Eigen::Ref<const Eigen::MatrixXf>>;
using tower_gradients = std::vector<std::vector<std::pair<gradient, std::string>>>;

// average_grads, average_grads_square = _average_gradients(tower_grads, include_square=True)
gradavg::averaged_gradients<Eigen::MatrixXf, std::string> average_like_the_seed(
    const tower_gradients& tower_grads, std::ostream& log) {
  auto averaged = gradavg::average_gradients(tower_grads, gradavg::include_square);
  // averaged.gradients is average_grads: (mean, variable) in variable order; averaged.squares is
  // average_grads_square, in the same order. A variable whose gradient is None on every tower is
  // in neither: the seed printed it, gradavg lists it (index, variable) in averaged.skipped.
  for (const auto& skipped : averaged.skipped)
    log << "None gradient for " << skipped.variable << '\n';
  return averaged;
}
