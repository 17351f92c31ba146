// What the libtorch training examples share: a small convolutional network for scikit-learn's 8x8
// digits (a 3x3 convolution in channels_last memory order, batch normalisation, a linear layer),
// the digits.csv reader (64 pixel values 0..16, then the label; scripts/fetch-digits.sh gets it),
// the held-out accuracy, and the reference gradient a data-parallel step must reproduce.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace digits {

/// [n, 64] pixels -> [n, 1, 8, 8] -> conv 3x3, 8 channels (channels_last) -> BatchNorm -> ReLU ->
/// linear to 10 classes. The convolution's weight is channels_last, so libtorch gives it
/// channels_last gradients (a gradient takes its parameter's strides); BatchNorm's running
/// statistics are buffers, which each replica updates from its own slice in train mode.
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)));
    norm = register_module("norm", torch::nn::BatchNorm2d(8));
    out = register_module("out", torch::nn::Linear(8 * 8 * 8, 10));
    torch::NoGradGuard no_grad;
    conv->weight.set_data(conv->weight.contiguous(at::MemoryFormat::ChannelsLast));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto image = x.view({-1, 1, 8, 8}).contiguous(at::MemoryFormat::ChannelsLast);
    return out(torch::relu(norm(conv(image))).flatten(1));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d norm{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Net);

struct dataset {
  torch::Tensor x;  // [n, 64] float, pixels scaled to [0, 1]
  torch::Tensor y;  // [n] int64 labels
};

/// The digits split the same way in every process: a fixed shuffle (seed 1), then 80% to train
/// on and 20% held out.
inline std::pair<dataset, dataset> split_held_out(const dataset& all) {
  torch::manual_seed(1);
  const auto n = all.y.size(0);
  const auto order = torch::randperm(n);
  const auto n_train = n * 4 / 5;
  return {{all.x.index({order.slice(0, 0, n_train)}), all.y.index({order.slice(0, 0, n_train)})},
          {all.x.index({order.slice(0, n_train)}), all.y.index({order.slice(0, n_train)})}};
}

/// digits.csv: 65 integers a line. Returns nothing when the file cannot be opened.
inline std::optional<dataset> load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::vector<float> pixels;
  std::vector<std::int64_t> labels;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::stringstream fields(line);
    std::string field;
    for (int j = 0; j < 65 && std::getline(fields, field, ','); ++j) {
      const int v = std::stoi(field);
      if (j < 64)
        pixels.push_back(static_cast<float>(v) / 16.0f);
      else
        labels.push_back(v);
    }
  }
  const auto n = static_cast<std::int64_t>(labels.size());
  if (n == 0 || pixels.size() != labels.size() * 64) return std::nullopt;
  return dataset{torch::from_blob(pixels.data(), {n, 64}).clone(),
                 torch::from_blob(labels.data(), {n}, torch::kInt64).clone()};
}

/// The share of d classified right, in eval() mode (BatchNorm's running statistics); the model
/// is left in train() mode.
inline double accuracy(Net& model, const dataset& d) {
  torch::NoGradGuard no_grad;
  model->eval();
  const double a = model->forward(d.x).argmax(1).eq(d.y).to(torch::kDouble).mean().item<double>();
  model->train();
  return a;
}

/// What data parallelism computes for one step: the mean over the batch's equal slices of each
/// slice's mean-loss gradient, each slice through `model` in train mode (BatchNorm's statistics
/// of that slice, as a replica sees it), summed in double. `model` is cloned, not changed.
inline std::vector<torch::Tensor> mean_slice_gradient(const Net& model, const torch::Tensor& x, const torch::Tensor& y,
                                                      std::int64_t slices) {
  Net copy = std::dynamic_pointer_cast<NetImpl>(model->clone());
  const auto params = copy->parameters();
  std::vector<torch::Tensor> sum(params.size());
  const std::int64_t per_slice = x.size(0) / slices;
  for (std::int64_t s = 0; s < slices; ++s) {
    copy->zero_grad();
    const auto rows = torch::indexing::Slice(s * per_slice, (s + 1) * per_slice);
    torch::nn::functional::cross_entropy(copy->forward(x.index({rows})), y.index({rows})).backward();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto g = params[i].grad().to(torch::kDouble);
      sum[i] = s == 0 ? g : sum[i] + g;
    }
  }
  for (auto& t : sum) t /= static_cast<double>(slices);
  return sum;
}

/// The largest |gradient - reference| over the largest |reference|, over every parameter.
inline double max_relative_difference(Net& model, const std::vector<torch::Tensor>& reference) {
  double difference = 0, scale = 0;
  const auto params = model->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    difference = std::max(difference, (params[i].grad().to(torch::kDouble) - reference[i]).abs().max().item<double>());
    scale = std::max(scale, reference[i].abs().max().item<double>());
  }
  return difference / scale;
}

/// Whether two models hold bitwise the same parameters and buffers.
inline bool same_state(Net& a, Net& b) {
  const auto pa = a->parameters(), pb = b->parameters();
  const auto ba = a->buffers(), bb = b->buffers();
  for (std::size_t i = 0; i < pa.size(); ++i)
    if (!torch::equal(pa[i], pb[i])) return false;
  for (std::size_t i = 0; i < ba.size(); ++i)
    if (!torch::equal(ba[i], bb[i])) return false;
  return true;
}

}  // namespace digits
