// Peers "gradavg" and "gradavg_nt": the library under test, through its public API only. The
// nested range of (gradient, variable id) pairs is built once here, outside the timed loop.
//
// Options: the defaults, but for threads — options{.run = {.threads = n, .pool = &pool}} with a
// gradavg::thread_pool(n) owned by the runner, so no thread is started in the timed loop — and,
// for gradavg_nt, stores = store_policy::streaming (outputs written with non-temporal stores).
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
        opts{.run = {.threads = static_cast<std::size_t>(threads), .stores = streaming ? gradavg::store_policy::streaming : gradavg::store_policy::regular, .pool = &pool}} {}

  static std::size_t checked(int threads) {
    if (threads < 1) throw std::runtime_error("gradavg: threads must be >= 1");
    return static_cast<std::size_t>(threads);
  }

  gradavg::thread_pool pool;
  gradavg::options opts;  // defaults otherwise: what a user gets without tuning
};

/// Variable v of tower t is the sizes[v] values at towers[t] + offsets[v] (see var_problem);
/// one variable at offset 0 is the grid's single-tensor problem.
template <class S>
class gradavg_runner final : public runner {
 public:
  gradavg_runner(const var_problem<S>& p, bool streaming) : setup_(p.threads, streaming) {
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

/// The grid's problem as a var_problem of one variable.
template <class S>
std::unique_ptr<runner> make_single(const problem<S>& p, bool streaming) {
  const std::size_t offset = 0;
  const var_problem<S> vp{p.towers, std::span<const std::size_t>(&offset, 1),
                          std::span<const std::size_t>(&p.elements, 1), p.mean, p.sq, p.threads};
  return std::make_unique<gradavg_runner<S>>(vp, streaming);
}

}  // namespace

template <class S>
std::unique_ptr<runner> make_gradavg(const problem<S>& p) {
  return make_single(p, false);
}

template <class S>
std::unique_ptr<runner> make_gradavg_nt(const problem<S>& p) {
  return make_single(p, true);
}

template <class S>
std::unique_ptr<runner> make_gradavg_vars(const var_problem<S>& p) {
  return std::make_unique<gradavg_runner<S>>(p, false);
}

template <class S>
std::unique_ptr<runner> make_gradavg_nt_vars(const var_problem<S>& p) {
  return std::make_unique<gradavg_runner<S>>(p, true);
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
