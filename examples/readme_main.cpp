// The README's example: two towers, three variables, one of them without a gradient.
#include <gradavg/gradavg.hpp>

#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

int main() {
  // A tower lists one gradient type; Ref<const MatrixXf> views a VectorXf or a MatrixXf without
  // copying. std::nullopt is an absent gradient (TensorFlow's None).
  using gradient = std::optional<Eigen::Ref<const Eigen::MatrixXf>>;
  Eigen::MatrixXf w0{{1, 2}, {3, 4}}, w1{{3, 2}, {1, 0}};
  Eigen::VectorXf b0{{1, -1, 2}}, b1{{3, 1, 0}};
  std::vector<std::vector<std::pair<gradient, std::string>>> tower_grads{
      {{w0, "dense/w"}, {b0, "dense/b"}, {std::nullopt, "embedding"}},
      {{w1, "dense/w"}, {b1, "dense/b"}, {std::nullopt, "embedding"}}};

  const Eigen::IOFormat flat(Eigen::StreamPrecision, Eigen::DontAlignCols, ", ", "; ", "", "", "[", "]");
  auto avg = gradavg::average_gradients(tower_grads, gradavg::include_square);
  for (std::size_t i = 0; i < avg.gradients.size(); ++i)
    std::cout << avg.gradients[i].second << ": mean " << avg.gradients[i].first.format(flat)
              << ", mean of squares " << avg.squares[i].first.format(flat) << '\n';
  for (const auto& s : avg.skipped) std::cout << "skipped: " << s.variable << '\n';

  // In place: the means overwrite tower 0's gradients; the skipped variable needs no output.
  std::vector<std::optional<Eigen::Ref<Eigen::MatrixXf>>> means{w0, b0, std::nullopt};
  gradavg::average_gradients_into(tower_grads, means);
  std::cout << "in place: w0 " << w0.format(flat) << ", b0 " << b0.format(flat) << '\n';
}
