// Peer "stacked_tensor": what the TensorFlow seed does. The towers are copied into one stacked
// T x P row-major tensor (TensorFlow's layout for tf.stack / tf.concat along a new leading
// axis), then reduced with .mean() over the tower dimension. The copy is part of the timed
// work, as it is in the seed's graph.
//
// EIGEN_USE_THREADS is defined for the whole bench target (see CMakeLists.txt), so the same
// code runs on an Eigen::ThreadPoolDevice when more than one thread is asked for.
#include <stdexcept>

#include <unsupported/Eigen/CXX11/Tensor>

#include "peers.hpp"

namespace gradavg_bench {
namespace {

template <class S, class Device>
class stacked_tensor final : public runner {
 public:
  stacked_tensor(const problem<S>& p, const Device& dev)
      : p_(p),
        dev_(dev),
        stacked_(static_cast<Eigen::Index>(p.towers.size()), static_cast<Eigen::Index>(p.elements)) {}

  void run() override {
    const auto n = static_cast<Eigen::Index>(p_.elements);
    for (std::size_t t = 0; t < p_.towers.size(); ++t)
      stacked_.chip(static_cast<Eigen::Index>(t), 0).device(dev_) = cvec_map(p_.towers[t], n);
    // A compile-time reduction axis, as TensorFlow passes it (Eigen::IndexList of
    // type2index<0>): it lets Eigen take its vectorised "preserve inner dims" path.
    const Eigen::IndexList<Eigen::type2index<0>> tower_dim;
    vec_map(p_.mean, n).device(dev_) = stacked_.mean(tower_dim);
    if (p_.sq != nullptr) vec_map(p_.sq, n).device(dev_) = stacked_.square().mean(tower_dim);
  }

 private:
  using vec_map = Eigen::TensorMap<Eigen::Tensor<S, 1, Eigen::RowMajor, Eigen::Index>>;
  using cvec_map = Eigen::TensorMap<const Eigen::Tensor<const S, 1, Eigen::RowMajor, Eigen::Index>>;
  problem<S> p_;
  const Device& dev_;
  Eigen::Tensor<S, 2, Eigen::RowMajor, Eigen::Index> stacked_;
};

/// Owns the pool and device that a threaded stacked_tensor evaluates on.
template <class S>
class threaded_stacked_tensor final : public runner {
 public:
  explicit threaded_stacked_tensor(const problem<S>& p)
      : pool_(p.threads), dev_(&pool_, p.threads), impl_(p, dev_) {}
  void run() override { impl_.run(); }

 private:
  Eigen::ThreadPool pool_;
  Eigen::ThreadPoolDevice dev_;
  stacked_tensor<S, Eigen::ThreadPoolDevice> impl_;
};

template <class S>
class default_stacked_tensor final : public runner {
 public:
  explicit default_stacked_tensor(const problem<S>& p) : impl_(p, dev_) {}
  void run() override { impl_.run(); }

 private:
  Eigen::DefaultDevice dev_;
  stacked_tensor<S, Eigen::DefaultDevice> impl_;
};

}  // namespace

template <class S>
std::unique_ptr<runner> make_stacked_tensor(const problem<S>& p) {
  if (p.threads < 1) throw std::runtime_error("stacked_tensor: threads must be >= 1");
  if (p.threads == 1) return std::make_unique<default_stacked_tensor<S>>(p);
  return std::make_unique<threaded_stacked_tensor<S>>(p);
}

template std::unique_ptr<runner> make_stacked_tensor<float>(const problem<float>&);
template std::unique_ptr<runner> make_stacked_tensor<double>(const problem<double>&);

}  // namespace gradavg_bench
