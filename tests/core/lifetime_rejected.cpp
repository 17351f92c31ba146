// Must not compile: a tower yielding (std::vector, variable) pairs by value, whose gradients own
// their elements. The test lifetime_rejected builds this and expects the library's message.
#include <gradavg/gradavg.hpp>

#include <ranges>
#include <utility>
#include <vector>

int main() {
  const std::vector<std::vector<float>> data{{1.0f, 2.0f}};
  auto tower = data | std::views::transform([](const std::vector<float>& g) { return std::pair(g, 0); });
  const std::vector towers{tower};
  std::vector<std::vector<float>> means{{0.0f, 0.0f}};
  gradavg::average_gradients_into(towers, means);
}
