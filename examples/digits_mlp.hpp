// What the libtorch training examples share: an MLP 64-64-10 for scikit-learn's 8x8 digits, the
// digits.csv reader (64 pixel values 0..16, then the label; scripts/fetch-digits.sh gets it), the
// held-out accuracy, and the comparison of two models' gradients.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace digits {

struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  MlpImpl() { reset(); }
  void reset() override {
    hidden = register_module("hidden", torch::nn::Linear(64, 64));
    out = register_module("out", torch::nn::Linear(64, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(torch::tanh(hidden(x))); }
  torch::nn::Linear hidden{nullptr}, out{nullptr};
};
TORCH_MODULE(Mlp);

struct dataset {
  torch::Tensor x;  // [n, 64] float, pixels scaled to [0, 1]
  torch::Tensor y;  // [n] int64 labels
};

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

inline double accuracy(Mlp& model, const dataset& d) {
  torch::NoGradGuard no_grad;
  return model->forward(d.x).argmax(1).eq(d.y).to(torch::kDouble).mean().item<double>();
}

/// The largest |a - b| over the largest |b|, over every parameter's gradient.
inline double max_relative_difference(Mlp& a, Mlp& b) {
  double difference = 0, scale = 0;
  const auto pa = a->parameters(), pb = b->parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    difference = std::max(difference, (pa[i].grad() - pb[i].grad()).abs().max().item<double>());
    scale = std::max(scale, pb[i].grad().abs().max().item<double>());
  }
  return difference / scale;
}

}  // namespace digits
