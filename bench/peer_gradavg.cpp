// Peer "gradavg": the library under test, through its public API only. The nested range of
// (gradient, variable id) pairs is built once here, outside the timed loop.
#include <stdexcept>
#include <utility>
#include <vector>

#include <gradavg/gradavg.hpp>

#include "peers.hpp"

namespace gradavg_bench {
namespace {

template <class S>
class gradavg_runner final : public runner {
 public:
  explicit gradavg_runner(const problem<S>& p) : means_{{p.mean, p.elements}} {
    if (p.threads != 1) throw std::runtime_error("gradavg: single-threaded only in this bench");
    grads_.resize(p.towers.size());
    for (std::size_t t = 0; t < p.towers.size(); ++t)
      grads_[t].emplace_back(std::span<const S>(p.towers[t], p.elements), 0);
    if (p.sq != nullptr) squares_.emplace_back(p.sq, p.elements);
  }

  void run() override {
    last_ = squares_.empty() ? gradavg::average_gradients_into(grads_, means_, opts_)
                             : gradavg::average_gradients_into(grads_, means_, squares_, opts_);
  }

 private:
  std::vector<std::vector<std::pair<std::span<const S>, int>>> grads_;
  std::vector<std::span<S>> means_, squares_;
  gradavg::options opts_;  // defaults: what a user gets without tuning
  gradavg::summary last_;
};

}  // namespace

template <class S>
std::unique_ptr<runner> make_gradavg(const problem<S>& p) {
  return std::make_unique<gradavg_runner<S>>(p);
}

template std::unique_ptr<runner> make_gradavg<float>(const problem<float>&);
template std::unique_ptr<runner> make_gradavg<double>(const problem<double>&);

}  // namespace gradavg_bench

namespace gradavg_bench {
namespace {

/// Variable id = index in the model's parameter list; each tower lists the same variables in
/// the same order, as a framework's (gradient, variable) list does.
template <class S>
class gradavg_vars_runner final : public runner {
 public:
  explicit gradavg_vars_runner(const var_problem<S>& p) {
    if (p.threads != 1) throw std::runtime_error("gradavg: single-threaded only in this bench");
    const std::size_t vars = p.offsets.size();
    grads_.resize(p.towers.size());
    for (std::size_t t = 0; t < p.towers.size(); ++t) {
      grads_[t].reserve(vars);
      for (std::size_t v = 0; v < vars; ++v)
        grads_[t].emplace_back(std::span<const S>(p.towers[t] + p.offsets[v], p.sizes[v]),
                               static_cast<int>(v));
    }
    for (std::size_t v = 0; v < vars; ++v) {
      means_.emplace_back(p.mean + p.offsets[v], p.sizes[v]);
      if (p.sq != nullptr) squares_.emplace_back(p.sq + p.offsets[v], p.sizes[v]);
    }
  }

  void run() override {
    last_ = squares_.empty() ? gradavg::average_gradients_into(grads_, means_, opts_)
                             : gradavg::average_gradients_into(grads_, means_, squares_, opts_);
  }

 private:
  std::vector<std::vector<std::pair<std::span<const S>, int>>> grads_;
  std::vector<std::span<S>> means_, squares_;
  gradavg::options opts_;  // defaults: what a user gets without tuning
  gradavg::summary last_;
};

}  // namespace

template <class S>
std::unique_ptr<runner> make_gradavg_vars(const var_problem<S>& p) {
  return std::make_unique<gradavg_vars_runner<S>>(p);
}

template std::unique_ptr<runner> make_gradavg_vars<float>(const var_problem<float>&);
template std::unique_ptr<runner> make_gradavg_vars<double>(const var_problem<double>&);

}  // namespace gradavg_bench
