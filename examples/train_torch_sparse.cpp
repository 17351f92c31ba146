// Data-parallel training in libtorch with a sparse embedding, threads as replicas: a bag-of-words
// classifier (torch::nn::Embedding with sparse(true), the mean of a document's word vectors, then
// a linear layer) on documents it generates: 4 topics over a vocabulary of 20,000 words; a
// document is 24 words, a third drawn from its topic's 150 words, the rest from the whole
// vocabulary. K replicas start in sync (broadcast_parameters); each computes the gradient of its
// slice of every batch on its own thread; gradavg::libtorch::average_module_gradients averages the
// embedding's sparse gradients without densifying them (a coalesced sparse mean in every
// replica's .grad()) and the linear layer's dense ones; each replica's SGD takes the same step.
//
// Checks, each failing the program (exit 1): the first step's averaged gradients against the mean
// of the slices' gradients computed one slice at a time by one model, densified (max relative
// difference under 1e-5); the embedding's averaged gradient sparse, with only the rows some
// replica looked up; every replica's parameters identical at the end; held-out accuracy of at
// least 90%.
//
//   train_torch_sparse [--replicas 4] [--epochs 8] [--quiet]
#include <gradavg/torch.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include "support.hpp"

namespace {

constexpr std::int64_t vocabulary = 20000, topics = 4, topic_words = 150, words_per_document = 24, width = 16;

struct BagImpl : torch::nn::Module {
  BagImpl()
      : words(register_module("words", torch::nn::Embedding(torch::nn::EmbeddingOptions(vocabulary, width).sparse(true)))),
        head(register_module("head", torch::nn::Linear(width, topics))) {}
  at::Tensor forward(const at::Tensor& documents) { return head->forward(words->forward(documents).mean(1)); }
  torch::nn::Embedding words;
  torch::nn::Linear head;
};
TORCH_MODULE(Bag);

struct documents {
  at::Tensor words;   // [n, words_per_document] int64
  at::Tensor topics;  // [n] int64
};

/// n documents: each topic's words are a fixed random set of the vocabulary.
documents generate(std::int64_t n, std::mt19937& gen) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(vocabulary));
  for (std::size_t w = 0; w < all.size(); ++w) all[w] = static_cast<std::int64_t>(w);
  std::mt19937 topic_gen(5);  // the same topics for every call
  std::shuffle(all.begin(), all.end(), topic_gen);
  std::uniform_int_distribution<std::int64_t> any(0, vocabulary - 1), topic(0, topics - 1), of_topic(0, topic_words - 1);
  documents d{at::empty({n, words_per_document}, at::kLong), at::empty({n}, at::kLong)};
  auto* w = d.words.data_ptr<std::int64_t>();
  auto* t = d.topics.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < n; ++i) {
    t[i] = topic(gen);
    for (std::int64_t j = 0; j < words_per_document; ++j)
      w[i * words_per_document + j] =
          j % 3 == 0 ? all[static_cast<std::size_t>(t[i] * topic_words + of_topic(gen))] : any(gen);
  }
  return d;
}

double accuracy(Bag& model, const documents& d) {
  torch::NoGradGuard no_grad;
  return model->forward(d.words).argmax(1).eq(d.topics).to(at::kDouble).mean().item<double>();
}

/// The largest difference between a's averaged gradients and `expected` (densified), relative to
/// the largest element of `expected`.
double max_relative_difference(Bag& a, const std::vector<at::Tensor>& expected) {
  double worst = 0;
  const auto params = a->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const at::Tensor g = params[i].grad().is_sparse() ? params[i].grad().to_dense() : params[i].grad();
    const double scale = std::max(expected[i].abs().max().item<double>(), 1e-30);
    worst = std::max(worst, (g - expected[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  int replica_count = 4, epochs = 8;
  bool quiet = false;
  for (int a = 1; a < argc; ++a) {
    const std::string_view arg = argv[a];
    std::optional<int> value;
    if (arg == "--quiet") {
      quiet = true;
    } else if (a + 1 < argc && arg == "--replicas" && (value = parse_int(argv[a + 1], 1, 64))) {
      replica_count = *value, ++a;
    } else if (a + 1 < argc && arg == "--epochs" && (value = parse_int(argv[a + 1], 1, 10000))) {
      epochs = *value, ++a;
    } else {
      std::fprintf(stderr, "usage: %s [--replicas K] [--epochs N] [--quiet]\n", argv[0]);
      return 2;
    }
  }
  torch::manual_seed(1);
  torch::set_num_threads(1);  // the replicas are the parallelism
  std::mt19937 gen(2);
  const documents train = generate(4096, gen), test = generate(1024, gen);
  const auto k_count = static_cast<std::size_t>(replica_count);
  const std::int64_t per_replica = 16, batch = per_replica * replica_count;

  std::vector<Bag> replicas(k_count);
  gradavg::libtorch::broadcast_parameters(replicas);
  std::vector<std::unique_ptr<torch::optim::SGD>> optimizers;
  for (auto& r : replicas)
    optimizers.push_back(std::make_unique<torch::optim::SGD>(r->parameters(), torch::optim::SGDOptions(2.0)));

  bool checked_first_step = false;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    const auto shuffle = torch::randperm(train.topics.size(0));
    double loss_sum = 0;
    int steps = 0;
    for (std::int64_t start = 0; start + batch <= train.topics.size(0); start += batch, ++steps) {
      const auto rows = shuffle.slice(0, start, start + batch);
      const auto x = train.words.index({rows}), y = train.topics.index({rows});
      std::vector<double> losses(k_count);
      {
        std::vector<std::jthread> threads;
        for (std::size_t k = 0; k < k_count; ++k)
          threads.emplace_back([&, k] {
            torch::set_num_threads(1);  // a new thread starts with OpenMP's default team size
            const auto begin = static_cast<std::int64_t>(k) * per_replica;
            auto& r = replicas[k];
            r->zero_grad(/*set_to_none=*/true);
            auto loss = torch::nn::functional::cross_entropy(r->forward(x.slice(0, begin, begin + per_replica)),
                                                             y.slice(0, begin, begin + per_replica));
            loss.backward();
            losses[k] = loss.item<double>();
          });
      }
      std::vector<at::Tensor> expected;  // the first step's reference: one model, slice by slice
      if (!checked_first_step) {
        Bag one;
        for (std::size_t i = 0; i < one->parameters().size(); ++i)
          one->parameters()[i].data().copy_(replicas[0]->parameters()[i].data());
        for (std::size_t k = 0; k < k_count; ++k) {
          const auto begin = static_cast<std::int64_t>(k) * per_replica;
          one->zero_grad(true);
          torch::nn::functional::cross_entropy(one->forward(x.slice(0, begin, begin + per_replica)),
                                               y.slice(0, begin, begin + per_replica))
              .backward();
          const auto params = one->parameters();
          for (std::size_t i = 0; i < params.size(); ++i) {
            const at::Tensor g = params[i].grad().is_sparse() ? params[i].grad().to_dense() : params[i].grad();
            if (k == 0) expected.push_back(g / replica_count);
            else expected[i] += g / replica_count;
          }
        }
      }
      const auto report = gradavg::libtorch::average_module_gradients(replicas);
      if (report.report.averaged != 3) {
        std::fprintf(stderr, "FAILED: %zu parameters averaged, 3 expected\n", report.report.averaged);
        return 1;
      }
      if (!checked_first_step) {
        const double difference = max_relative_difference(replicas[0], expected);
        const at::Tensor g = replicas[0]->words->weight.grad();
        const std::int64_t listed = g.is_sparse() ? g._nnz() : -1;
        const std::int64_t looked_up = std::get<0>(at::_unique(x)).size(0);
        std::printf("step 0: averaged gradients vs the slices' mean gradient: max relative difference %.3g (tolerance "
                    "1e-05); the embedding's mean holds %lld of %lld rows, those %lld words the batch looked up\n",
                    difference, static_cast<long long>(listed), static_cast<long long>(vocabulary),
                    static_cast<long long>(looked_up));
        if (!(difference <= 1e-5) || !g.is_sparse() || !g.is_coalesced() || listed != looked_up) {
          std::fprintf(stderr, "FAILED: the averaged gradient differs from the reference, or is not sparse\n");
          return 1;
        }
        checked_first_step = true;
      }
      for (auto& o : optimizers) o->step();
      for (double l : losses) loss_sum += l / static_cast<double>(k_count);
    }
    if (!quiet)
      std::printf("epoch %3d: training loss %.4f, held-out accuracy %.1f%%\n", epoch + 1, loss_sum / steps,
                  100 * accuracy(replicas[0], test));
  }

  for (std::size_t k = 1; k < k_count; ++k)
    for (std::size_t i = 0; i < replicas[0]->parameters().size(); ++i)
      if (!torch::equal(replicas[0]->parameters()[i], replicas[k]->parameters()[i])) {
        std::fprintf(stderr, "FAILED: replica %zu's parameters differ from replica 0's\n", k);
        return 1;
      }
  const double test_accuracy = accuracy(replicas[0], test);
  std::printf("%zu replicas (threads), %d epochs, batch %lld, a %lld x %lld sparse embedding: held-out accuracy "
              "%.1f%% on %lld documents\n",
              k_count, epochs, static_cast<long long>(batch), static_cast<long long>(vocabulary),
              static_cast<long long>(width), 100 * test_accuracy, static_cast<long long>(test.topics.size(0)));
  if (test_accuracy < 0.9) {
    std::fprintf(stderr, "FAILED: held-out accuracy under 90%%\n");
    return 1;
  }
  return 0;
}
