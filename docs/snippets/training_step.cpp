#include <gradavg/gradavg.hpp>

#include <cstddef>
#include <optional>
#include <thread>
#include <vector>

// The model: y = W x + b, trained on the mean squared error, plus an embedding that gets no
// gradient (frozen, or off the loss's path): None, std::nullopt here, on every tower.
struct model {
  Eigen::MatrixXf w;          // outputs x inputs
  Eigen::VectorXf b;          // outputs
  Eigen::VectorXf embedding;  // gets no gradient
};

// One tower's gradient buffers, allocated once (sized like w and b) and reused every step.
struct tower_buffers {
  Eigen::MatrixXf w;
  Eigen::VectorXf b;
};

// opt.compute_gradients(loss) / loss.backward() on one tower's shard (one sample per column):
// the gradient of the mean over samples of |W x + b - y|^2 / 2.
void compute_gradients(const model& m, const Eigen::Ref<const Eigen::MatrixXf>& x,
                       const Eigen::Ref<const Eigen::MatrixXf>& y, tower_buffers& g) {
  const Eigen::MatrixXf residual = ((m.w * x).colwise() + m.b - y) / static_cast<float>(x.cols());
  g.w.noalias() = residual * x.transpose();
  g.b = residual.rowwise().sum();
}

// Outputs of average_gradients_into, one per variable; null where the variable is skipped.
using mean_outputs = std::vector<std::optional<Eigen::Ref<Eigen::MatrixXf>>>;

// One step of data-parallel SGD: tower k computes the gradient of shard k of the batch, the
// towers' gradients are averaged into tower 0's buffers, and the model steps along the mean.
// With equal shards, the mean of the towers' gradients is the gradient of the whole batch.
gradavg::summary train_step(model& m, std::vector<tower_buffers>& grads, const Eigen::MatrixXf& x,
                            const Eigen::MatrixXf& y, float learning_rate,
                            gradavg::executor& pool) {
  const Eigen::Index shard = x.cols() / static_cast<Eigen::Index>(grads.size());
  {
    std::vector<std::jthread> towers;  // one thread per tower, where TensorFlow had one GPU
    for (std::size_t k = 0; k < grads.size(); ++k)
      towers.emplace_back([&, k] {
        const Eigen::Index first = static_cast<Eigen::Index>(k) * shard;
        compute_gradients(m, x.middleCols(first, shard), y.middleCols(first, shard), grads[k]);
      });
  }  // joined: the synchronisation point of the seed's docstring

  // The seed's tower_grads, as views of the towers' buffers; the embedding is None everywhere.
  tower_gradients tower_grads;
  for (const tower_buffers& g : grads)
    tower_grads.push_back({{g.w, "w"}, {g.b, "b"}, {std::nullopt, "embedding"}});

  // In place: the means overwrite tower 0's gradients. The skipped embedding needs no output.
  // threads = 0: as many as the pool has (calls this small use one; see docs/threads.md).
  mean_outputs means{grads[0].w, grads[0].b, std::nullopt};
  const gradavg::summary done =
      gradavg::average_gradients_into(tower_grads, means, {.run = {.threads = 0, .pool = &pool}});

  // opt.apply_gradients(average_grads) / optimizer.step(): the skipped embedding does not move.
  m.w -= learning_rate * grads[0].w;
  m.b -= learning_rate * grads[0].b;
  return done;  // done.averaged == 2, done.skipped == 1
}
