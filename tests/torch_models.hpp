// Small libtorch models shared by the libtorch tests (one process and across ranks).
#pragma once

#include <torch/torch.h>

#include <cstdint>

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

}  // namespace gradavg_test::models
