// Trainable parameter shapes of two real models, in the order their frameworks list them.
//
//   ResNet-50 (torchvision naming): 161 tensors, 25,557,032 parameters
//     53 convolutions [out, in, kh, kw] (no bias), 53 batch norms x {weight, bias},
//     fc.weight [1000, 2048], fc.bias [1000].
//   BERT-base, uncased (Hugging Face naming, with pooler): 199 tensors, 109,482,240 parameters
//     embeddings: word [30522, 768] + position [512, 768] + token type [2, 768]
//                 + LayerNorm {weight, bias} [768]                  5 tensors, 23,837,184
//     12 layers x 16 tensors, 7,087,872 each                     192 tensors, 85,054,464:
//       query, key, value, attention output: weight [768, 768] + bias [768]
//       attention LayerNorm {weight, bias} [768]
//       intermediate weight [3072, 768] + bias [3072]
//       output weight [768, 3072] + bias [768]
//       output LayerNorm {weight, bias} [768]
//     pooler: weight [768, 768] + bias [768]                       2 tensors, 590,592
// main() checks both totals against these numbers before running anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace gradavg_bench {

struct param_shape {
  std::string name;
  std::vector<std::int64_t> dims;

  [[nodiscard]] std::size_t size() const {
    std::size_t n = 1;
    for (std::int64_t d : dims) n *= static_cast<std::size_t>(d);
    return n;
  }
};

struct model_shapes {
  std::string name;
  std::vector<param_shape> params;
  std::size_t expected_tensors = 0;
  std::size_t expected_params = 0;
};

inline model_shapes resnet50_shapes() {
  model_shapes m{"resnet50", {}, 161, 25'557'032};
  auto& p = m.params;
  auto bn = [&p](const std::string& prefix, std::int64_t c) {
    p.push_back({prefix + ".weight", {c}});
    p.push_back({prefix + ".bias", {c}});
  };
  p.push_back({"conv1.weight", {64, 3, 7, 7}});
  bn("bn1", 64);
  // Bottleneck stages: (blocks, width); each block expands its width by 4.
  const std::int64_t blocks[4] = {3, 4, 6, 3};
  const std::int64_t widths[4] = {64, 128, 256, 512};
  std::int64_t in = 64;
  for (int s = 0; s < 4; ++s) {
    const std::int64_t w = widths[s], out = 4 * w;
    for (std::int64_t b = 0; b < blocks[s]; ++b) {
      const std::string pre = "layer" + std::to_string(s + 1) + "." + std::to_string(b);
      p.push_back({pre + ".conv1.weight", {w, in, 1, 1}});
      bn(pre + ".bn1", w);
      p.push_back({pre + ".conv2.weight", {w, w, 3, 3}});
      bn(pre + ".bn2", w);
      p.push_back({pre + ".conv3.weight", {out, w, 1, 1}});
      bn(pre + ".bn3", out);
      if (b == 0) {
        p.push_back({pre + ".downsample.0.weight", {out, in, 1, 1}});
        bn(pre + ".downsample.1", out);
      }
      in = out;
    }
  }
  p.push_back({"fc.weight", {1000, 2048}});
  p.push_back({"fc.bias", {1000}});
  return m;
}

inline model_shapes bert_base_shapes() {
  model_shapes m{"bert_base", {}, 199, 109'482'240};
  auto& p = m.params;
  constexpr std::int64_t hidden = 768, ffn = 3072, vocab = 30522, positions = 512, types = 2;
  auto linear = [&p](const std::string& prefix, std::int64_t out, std::int64_t in) {
    p.push_back({prefix + ".weight", {out, in}});
    p.push_back({prefix + ".bias", {out}});
  };
  auto layer_norm = [&p](const std::string& prefix) {
    p.push_back({prefix + ".weight", {hidden}});
    p.push_back({prefix + ".bias", {hidden}});
  };
  p.push_back({"embeddings.word_embeddings.weight", {vocab, hidden}});
  p.push_back({"embeddings.position_embeddings.weight", {positions, hidden}});
  p.push_back({"embeddings.token_type_embeddings.weight", {types, hidden}});
  layer_norm("embeddings.LayerNorm");
  for (int l = 0; l < 12; ++l) {
    const std::string pre = "encoder.layer." + std::to_string(l);
    linear(pre + ".attention.self.query", hidden, hidden);
    linear(pre + ".attention.self.key", hidden, hidden);
    linear(pre + ".attention.self.value", hidden, hidden);
    linear(pre + ".attention.output.dense", hidden, hidden);
    layer_norm(pre + ".attention.output.LayerNorm");
    linear(pre + ".intermediate.dense", ffn, hidden);
    linear(pre + ".output.dense", hidden, ffn);
    layer_norm(pre + ".output.LayerNorm");
  }
  linear("pooler.dense", hidden, hidden);
  return m;
}

}  // namespace gradavg_bench
