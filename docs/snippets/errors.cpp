#include <gradavg/gradavg.hpp>

#include <ostream>

// Where the seed raised ValueError("None gradient error") (a gradient None on some towers
// only), gradavg throws missing_gradient_error; every gradavg exception derives from
// gradavg::error and is thrown before anything is written. Here a bad step is reported and
// skipped: tower 0's gradients, the means outputs, are left as they were.
bool average_or_skip(const tower_gradients& tower_grads, mean_outputs& means, std::ostream& log) {
  try {
    gradavg::average_gradients_into(tower_grads, means);
    return true;
  } catch (const gradavg::error& e) {  // e.variable_index(): the position of the variable at fault
    log << "step skipped: " << e.what() << '\n';
    return false;
  }
}
