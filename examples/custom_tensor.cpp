// Plugging your own tensor and variable types into gradavg.
//
//   my_tensor       a row-major float matrix, adapted through gradavg::tensor_traits
//   layer_variable  a variable handle; its operator<< is how error messages name it
#include <gradavg/gradavg.hpp>

#include <array>
#include <cstdint>
#include <iostream>
#include <ostream>
#include <string>
#include <vector>

struct my_tensor {
  std::vector<float> values;           // row-major
  std::array<std::int64_t, 2> dims{};  // rows, cols
};

// The whole adapter: element access, shape, and how the allocating API creates results.
template <>
struct gradavg::tensor_traits<my_tensor> {
  using value_type = float;
  using result_type = my_tensor;
  static const float* data(const my_tensor& t) noexcept { return t.values.data(); }
  static float* mutable_data(my_tensor& t) noexcept { return t.values.data(); }
  static gradavg::shape shape(const my_tensor& t) noexcept {
    gradavg::shape s;  // storage order defaults to row-major
    s.rank = 2;
    s.dims[0] = t.dims[0];
    s.dims[1] = t.dims[1];
    return s;
  }
  static my_tensor make(const gradavg::shape& s) { return {std::vector<float>(s.size()), {s.dims[0], s.dims[1]}}; }
};

struct layer_variable {
  std::string layer;
  std::string name;
  bool operator==(const layer_variable&) const = default;  // lets gradavg check towers agree
  friend std::ostream& operator<<(std::ostream& os, const layer_variable& v) { return os << v.layer << '/' << v.name; }
};

// A pointer slot: nullptr is an absent gradient.
using tower = std::vector<gradavg::grad_and_var<const my_tensor*, layer_variable>>;

static void print(const char* label, const my_tensor& t) {
  std::cout << "  " << label << " [" << t.dims[0] << 'x' << t.dims[1] << "]:";
  for (float v : t.values) std::cout << ' ' << v;
  std::cout << '\n';
}

int main() {
  const layer_variable kernel{"dense", "kernel"}, bias{"dense", "bias"};
  const my_tensor k0{{1, 2, 3, 4, 5, 6}, {2, 3}}, k1{{3, 2, 1, 0, -1, -2}, {2, 3}};
  const my_tensor b0{{0.5f, -1}, {1, 2}}, b1{{1.5f, 3}, {1, 2}};
  const std::vector<tower> tower_grads{{{&k0, kernel}, {&b0, bias}}, {{&k1, kernel}, {&b1, bias}}};
  bool ok = true;

  // 1. Allocating API: results are my_tensor, made through tensor_traits<my_tensor>::make.
  std::cout << "average_gradients:\n";
  const auto avg = gradavg::average_gradients(tower_grads, gradavg::include_square);
  for (std::size_t i = 0; i < avg.gradients.size(); ++i) {
    std::cout << ' ' << avg.gradients[i].second << '\n';
    print("mean", avg.gradients[i].first);
    print("mean of squares", avg.squares[i].first);
  }
  ok = ok && avg.gradients[0].first.values == std::vector<float>{2, 2, 2, 2, 2, 2};

  // 2. Into outputs the caller owns: nothing is allocated.
  std::cout << "average_gradients_into:\n";
  std::vector<my_tensor> means{{std::vector<float>(6), {2, 3}}, {std::vector<float>(2), {1, 2}}};
  const gradavg::summary done = gradavg::average_gradients_into(tower_grads, means);
  std::cout << "  averaged " << done.averaged << ", skipped " << done.skipped << '\n';
  print("dense/bias mean", means[1]);
  ok = ok && means[1].values == std::vector<float>{1, 1};

  // 3. A mistake on purpose: tower 1 lost its bias gradient. gradavg throws before writing
  // anything, and the message names the variable through its operator<<.
  const std::vector<tower> broken{{{&k0, kernel}, {&b0, bias}}, {{&k1, kernel}, {nullptr, bias}}};
  try {
    gradavg::average_gradients_into(broken, means);
    std::cout << "no error?\n";
    ok = false;
  } catch (const gradavg::error& e) {
    std::cout << "gradavg::error (variable index " << e.variable_index() << "):\n  " << e.what() << '\n';
    ok = ok && e.variable_index() == 1 && means[1].values == std::vector<float>{1, 1};
  }
  return ok ? 0 : 1;
}
