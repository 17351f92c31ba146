// Small libtorch models, replicas of them with gradients, and a bitwise comparison of tensors,
// shared by the libtorch tests (one process and across ranks).
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace gradavg_test {

/// Whether two tensors are the same bits: both undefined, or of one dtype, sizes and strides
/// holding the same bytes.
inline bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

/// Towers of (gradient, name) entries of torch::Tensor.
using torch_entry = std::pair<at::Tensor, std::string>;
using torch_towers = std::vector<std::vector<torch_entry>>;

/// Outputs shaped like tower 0's gradients, of dtype, filled with -7.
inline std::vector<at::Tensor> outputs_like(const torch_towers& tg, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& e : tg[0]) out.push_back(torch::full(e.first.sizes(), -7.0, torch::dtype(dtype)));
  return out;
}

/// The mean of variable i over the towers, computed by torch in double.
inline at::Tensor reference_mean(const torch_towers& tg, std::size_t i) {
  std::vector<at::Tensor> g;
  for (const auto& tower : tg) g.push_back(tower[i].first.to(at::kDouble));
  return torch::stack(g).mean(0);
}

/// The same towers as std::span<const S> gradients (the plain-pointer path), and std::vector<O>
/// outputs shaped like tower 0's gradients: average(spans, outputs) runs the call, which returns
/// the outputs.
template <class S, class O, class Average>
std::vector<std::vector<O>> through_spans(const torch_towers& tg, Average&& average) {
  std::vector<std::vector<std::pair<std::span<const S>, std::string>>> st(tg.size());
  for (std::size_t k = 0; k < tg.size(); ++k)
    for (const auto& [g, name] : tg[k])
      st[k].emplace_back(std::span<const S>(static_cast<const S*>(g.data_ptr()), static_cast<std::size_t>(g.numel())),
                         name);
  std::vector<std::vector<O>> means;
  for (const auto& e : tg[0]) means.emplace_back(static_cast<std::size_t>(e.first.numel()));
  average(st, means);
  return means;
}

/// Runs step(k) for k in [0, count), each on a thread of its own; returns the first exception by
/// k (a replica's backward that throws), not thrown, or null.
template <class Step>
std::exception_ptr first_failure_on_threads(std::size_t count, const Step& step) {
  std::vector<std::exception_ptr> errors(count);
  std::vector<std::thread> threads;
  for (std::size_t k = 0; k < count; ++k)
    threads.emplace_back([&, k] {
      try {
        step(k);
      } catch (...) {
        errors[k] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) return e;
  return nullptr;
}

}  // namespace gradavg_test

namespace gradavg_test::models {

/// Two layers and a frozen one (its parameters have no gradient).
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
    frozen = register_module("frozen", torch::nn::Linear(3, 3));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return frozen(fc2(torch::relu(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, frozen{nullptr};
};
TORCH_MODULE(Net);

/// K replicas of one Net, replica k with the gradient of its own 8 rows of a batch; the frozen
/// layer's parameters require no gradient on any replica.
inline std::vector<Net> replicas_with_gradients(std::size_t k_count, std::uint64_t seed) {
  torch::manual_seed(seed);
  Net model;
  std::vector<Net> r{model};
  for (std::size_t k = 1; k < k_count; ++k) r.push_back(std::dynamic_pointer_cast<NetImpl>(model->clone()));
  // clone() makes submodules afresh: their parameters require gradients again.
  for (auto& replica : r)
    for (auto& p : replica->frozen->parameters()) p.set_requires_grad(false);
  const at::Tensor x = torch::randn({static_cast<std::int64_t>(8 * k_count), 6});
  const at::Tensor y = torch::randint(0, 3, {static_cast<std::int64_t>(8 * k_count)});
  for (std::size_t k = 0; k < k_count; ++k) {
    const auto rows = torch::indexing::Slice(static_cast<std::int64_t>(8 * k), static_cast<std::int64_t>(8 * (k + 1)));
    torch::nn::functional::cross_entropy(r[k]->forward(x.index({rows})), y.index({rows})).backward();
  }
  return r;
}

/// A body and two heads; the aux head takes part in the loss only where asked.
struct TwoHeadsImpl : torch::nn::Cloneable<TwoHeadsImpl> {
  TwoHeadsImpl() { reset(); }
  void reset() override {
    body = register_module("body", torch::nn::Linear(6, 8));
    head = register_module("head", torch::nn::Linear(8, 3));
    aux = register_module("aux", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_aux) {
    const torch::Tensor h = torch::relu(body(x));
    return use_aux ? head(h) + aux(h) : head(h);
  }
  torch::nn::Linear body{nullptr}, head{nullptr}, aux{nullptr};
};
TORCH_MODULE(TwoHeads);

/// A linear layer, batch normalisation (running_mean, running_var, num_batches_tracked) and a head.
struct BatchNormNetImpl : torch::nn::Cloneable<BatchNormNetImpl> {
  explicit BatchNormNetImpl(std::int64_t width = 8) : width(width) { reset(); }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(6, width));
    bn = register_module("bn", torch::nn::BatchNorm1d(width));
    head = register_module("head", torch::nn::Linear(width, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(bn(fc(x))); }
  std::int64_t width;
  torch::nn::Linear fc{nullptr}, head{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(BatchNormNet);

/// A bfloat16 body and a float head.
struct MixedImpl : torch::nn::Cloneable<MixedImpl> {
  MixedImpl() { reset(); }
  void reset() override {
    body = register_module("body", torch::nn::Linear(6, 8));
    body->to(torch::kBFloat16);
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(torch::relu(body(x.to(torch::kBFloat16))).to(torch::kFloat));
  }
  torch::nn::Linear body{nullptr}, head{nullptr};
};
TORCH_MODULE(Mixed);

/// Identity forward; backward throws when armed: a replica whose backward fails midway.
struct failing_identity : torch::autograd::Function<failing_identity> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, bool armed) {
    ctx->saved_data["armed"] = armed;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    if (ctx->saved_data["armed"].toBool()) throw std::runtime_error("backward failed on purpose");
    return {g[0], at::Tensor()};
  }
};

/// A channels_last convolution with batch normalisation, two hidden layers and two heads (aux in
/// the loss where asked): 12 parameters in named_parameters() order conv.weight, conv.bias,
/// bn.weight, bn.bias, fc1.*, fc2.*, head.*, aux.*.
struct DeepImpl : torch::nn::Cloneable<DeepImpl> {
  DeepImpl() { reset(); }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    fc1 = register_module("fc1", torch::nn::Linear(4 * 4 * 4, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 16));
    head = register_module("head", torch::nn::Linear(16, 3));
    aux = register_module("aux", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_aux = true, bool fail = false) {
    at::Tensor h = torch::relu(fc1(torch::relu(bn(conv(x))).flatten(1)));
    h = torch::relu(fc2(failing_identity::apply(h, fail)));
    return use_aux ? head(h) + aux(h) : head(h);
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr}, aux{nullptr};
};
TORCH_MODULE(Deep);

/// Every 4-d parameter of m in channels_last memory order (Module::to() takes no memory format in
/// the C++ frontend).
inline void to_channels_last(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters())
    if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
}

}  // namespace gradavg_test::models
