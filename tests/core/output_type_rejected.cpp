// Must not compile: half gradients averaged into double outputs. Outputs hold the gradients'
// element type, or float for 16-bit gradients; the test output_type_rejected builds this and
// expects the library's message.
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>

#include <utility>
#include <vector>

int main() {
  const std::vector<Eigen::half> g(4, Eigen::half(1.0f));
  const std::vector<std::vector<std::pair<const std::vector<Eigen::half>*, int>>> towers{{{&g, 0}}, {{&g, 0}}};
  std::vector<std::vector<double>> means{std::vector<double>(4)};
  gradavg::average_gradients_into(towers, means);
}
