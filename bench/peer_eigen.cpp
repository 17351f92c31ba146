// Peer "eigen_per_tower": one Eigen expression pass per tower, as a user of plain Eigen would
// write the average without any fusion across towers. Threads: the element range is split into
// contiguous chunks (multiples of 64 elements), one per thread of a persistent pool, and each
// thread runs the per-tower passes on its chunk.
#include <algorithm>
#include <stdexcept>
#include <vector>

#include <Eigen/Core>

#include "parallel.hpp"
#include "peers.hpp"

namespace gradavg_bench {
namespace {

int checked_threads(int threads) {
  if (threads < 1) throw std::runtime_error("eigen_per_tower: threads must be >= 1");
  return threads;
}

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
  explicit eigen_per_tower(const problem<S>& p) : p_(p), pool_(checked_threads(p.threads)) {}

  void run() override {
    pool_.for_chunks(p_.elements, [this](std::size_t, std::size_t begin, std::size_t end) {
      if (begin < end)
        eigen_average<S>(p_.towers, begin, end - begin, p_.mean + begin,
                         p_.sq == nullptr ? nullptr : p_.sq + begin);
    });
  }

 private:
  problem<S> p_;
  chunk_pool pool_;
};

/// Every variable's elements, one after the other, form a flat range; a chunk of it runs
/// eigen_average on the piece of each variable it covers (variables in order, as with 1 thread).
template <class S>
class eigen_per_tower_vars final : public runner {
 public:
  explicit eigen_per_tower_vars(const var_problem<S>& p) : p_(p), pool_(checked_threads(p.threads)) {
    starts_.reserve(p.sizes.size() + 1);
    std::size_t flat = 0;
    for (std::size_t n : p.sizes) {
      starts_.push_back(flat);
      flat += n;
    }
    starts_.push_back(flat);
  }

  void run() override {
    pool_.for_chunks(starts_.back(), [this](std::size_t, std::size_t first, std::size_t last) {
      for (std::size_t v = 0; v + 1 < starts_.size() && starts_[v] < last; ++v) {
        if (starts_[v + 1] <= first) continue;
        const std::size_t begin = std::max(first, starts_[v]) - starts_[v];  // within variable v
        const std::size_t end = std::min(last, starts_[v + 1]) - starts_[v];
        const std::size_t off = p_.offsets[v] + begin;
        eigen_average<S>(p_.towers, off, end - begin, p_.mean + off,
                         p_.sq == nullptr ? nullptr : p_.sq + off);
      }
    });
  }

 private:
  var_problem<S> p_;
  chunk_pool pool_;
  std::vector<std::size_t> starts_;  // flat index of each variable's first element, then the total
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
