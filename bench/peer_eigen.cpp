// Peer "eigen_per_tower": one Eigen expression pass per tower, as a user of plain Eigen would
// write the average without any fusion across towers.
#include <stdexcept>

#include <Eigen/Core>

#include "peers.hpp"

namespace gradavg_bench {
namespace {

/// mean = (g_0 + ... + g_{T-1}) / T over the n values at towers[t] + offset, one pass per
/// tower; then the same for squares when sq is not null.
template <class S>
void eigen_average(std::span<const S* const> towers, std::size_t offset, std::size_t n, S* mean,
                   S* sq) {
  using vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;  // Eigen::VectorXf for float
  using vec_map = Eigen::Map<vec>;
  using cvec_map = Eigen::Map<const vec>;
  const auto len = static_cast<Eigen::Index>(n);
  const S inv = S(1) / static_cast<S>(towers.size());
  vec_map out(mean, len);
  out = cvec_map(towers[0] + offset, len);
  for (std::size_t t = 1; t < towers.size(); ++t) out += cvec_map(towers[t] + offset, len);
  out *= inv;
  if (sq == nullptr) return;
  vec_map sq_out(sq, len);
  sq_out = cvec_map(towers[0] + offset, len).array().square().matrix();
  for (std::size_t t = 1; t < towers.size(); ++t)
    sq_out += cvec_map(towers[t] + offset, len).array().square().matrix();
  sq_out *= inv;
}

template <class S>
class eigen_per_tower final : public runner {
 public:
  explicit eigen_per_tower(const problem<S>& p) : p_(p) {
    if (p.threads != 1) throw std::runtime_error("eigen_per_tower: single-threaded only");
  }
  void run() override { eigen_average<S>(p_.towers, 0, p_.elements, p_.mean, p_.sq); }

 private:
  problem<S> p_;
};

template <class S>
class eigen_per_tower_vars final : public runner {
 public:
  explicit eigen_per_tower_vars(const var_problem<S>& p) : p_(p) {
    if (p.threads != 1) throw std::runtime_error("eigen_per_tower: single-threaded only");
  }
  void run() override {
    for (std::size_t v = 0; v < p_.offsets.size(); ++v) {
      const std::size_t off = p_.offsets[v];
      eigen_average<S>(p_.towers, off, p_.sizes[v], p_.mean + off,
                       p_.sq == nullptr ? nullptr : p_.sq + off);
    }
  }

 private:
  var_problem<S> p_;
};

}  // namespace

template <class S>
std::unique_ptr<runner> make_eigen_per_tower(const problem<S>& p) {
  return std::make_unique<eigen_per_tower<S>>(p);
}

template <class S>
std::unique_ptr<runner> make_eigen_per_tower_vars(const var_problem<S>& p) {
  return std::make_unique<eigen_per_tower_vars<S>>(p);
}

template std::unique_ptr<runner> make_eigen_per_tower<float>(const problem<float>&);
template std::unique_ptr<runner> make_eigen_per_tower<double>(const problem<double>&);
template std::unique_ptr<runner> make_eigen_per_tower_vars<float>(const var_problem<float>&);
template std::unique_ptr<runner> make_eigen_per_tower_vars<double>(const var_problem<double>&);

}  // namespace gradavg_bench
