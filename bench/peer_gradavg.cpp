// Peers "gradavg" and "gradavg_nt": the library under test, through its public API only. The
// nested range of (gradient, variable id) pairs is built once here, outside the timed loop.
//
// Options: the defaults, but for threads — options{.threads = n, .pool = &pool} with a
// gradavg::thread_pool(n) owned by the runner, so no thread is started in the timed loop — and,
// for gradavg_nt, streaming_stores = true (outputs written with non-temporal stores).
#include <stdexcept>
#include <utility>
#include <vector>

#include <gradavg/gradavg.hpp>

#include "peers.hpp"

namespace gradavg_bench {
namespace {

/// The pool and options every gradavg runner uses. Declared first in the runners, so the pool
/// outlives every call made with the options pointing to it.
struct gradavg_setup {
  gradavg_setup(int threads, bool streaming)
      : pool(checked(threads)),
        opts{.threads = static_cast<std::size_t>(threads), .streaming_stores = streaming, .pool = &pool} {}

  static std::size_t checked(int threads) {
    if (threads < 1) throw std::runtime_error("gradavg: threads must be >= 1");
    return static_cast<std::size_t>(threads);
  }

  gradavg::thread_pool pool;
  gradavg::options opts;  // defaults otherwise: what a user gets without tuning
};

template <class S>
class gradavg_runner final : public runner {
 public:
  gradavg_runner(const problem<S>& p, bool streaming)
      : setup_(p.threads, streaming), means_{{p.mean, p.elements}} {
    grads_.resize(p.towers.size());
    for (std::size_t t = 0; t < p.towers.size(); ++t)
      grads_[t].emplace_back(std::span<const S>(p.towers[t], p.elements), 0);
    if (p.sq != nullptr) squares_.emplace_back(p.sq, p.elements);
  }

  void run() override {
    last_ = squares_.empty() ? gradavg::average_gradients_into(grads_, means_, setup_.opts)
                             : gradavg::average_gradients_into(grads_, means_, squares_, setup_.opts);
  }

 private:
  gradavg_setup setup_;
  std::vector<std::vector<std::pair<std::span<const S>, int>>> grads_;
  std::vector<std::span<S>> means_, squares_;
  gradavg::summary last_;
};

/// Variable id = index in the model's parameter list; each tower lists the same variables in
/// the same order, as a framework's (gradient, variable) list does.
template <class S>
class gradavg_vars_runner final : public runner {
 public:
  gradavg_vars_runner(const var_problem<S>& p, bool streaming) : setup_(p.threads, streaming) {
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
    last_ = squares_.empty() ? gradavg::average_gradients_into(grads_, means_, setup_.opts)
                             : gradavg::average_gradients_into(grads_, means_, squares_, setup_.opts);
  }

 private:
  gradavg_setup setup_;
  std::vector<std::vector<std::pair<std::span<const S>, int>>> grads_;
  std::vector<std::span<S>> means_, squares_;
  gradavg::summary last_;
};

}  // namespace

template <class S>
std::unique_ptr<runner> make_gradavg(const problem<S>& p) {
  return std::make_unique<gradavg_runner<S>>(p, false);
}

template <class S>
std::unique_ptr<runner> make_gradavg_nt(const problem<S>& p) {
  return std::make_unique<gradavg_runner<S>>(p, true);
}

template <class S>
std::unique_ptr<runner> make_gradavg_vars(const var_problem<S>& p) {
  return std::make_unique<gradavg_vars_runner<S>>(p, false);
}

template <class S>
std::unique_ptr<runner> make_gradavg_nt_vars(const var_problem<S>& p) {
  return std::make_unique<gradavg_vars_runner<S>>(p, true);
}

template std::unique_ptr<runner> make_gradavg<float>(const problem<float>&);
template std::unique_ptr<runner> make_gradavg<double>(const problem<double>&);
template std::unique_ptr<runner> make_gradavg_nt<float>(const problem<float>&);
template std::unique_ptr<runner> make_gradavg_nt<double>(const problem<double>&);
template std::unique_ptr<runner> make_gradavg_vars<float>(const var_problem<float>&);
template std::unique_ptr<runner> make_gradavg_vars<double>(const var_problem<double>&);
template std::unique_ptr<runner> make_gradavg_nt_vars<float>(const var_problem<float>&);
template std::unique_ptr<runner> make_gradavg_nt_vars<double>(const var_problem<double>&);

}  // namespace gradavg_bench
