// gradavg::c10d over gloo against gloo's own allreduce, and libtorch's c10d_data_parallel against
// backward alone, on ResNet-50 and BERT-base parameter layouts (model_shapes.hpp), float, one
// tower (replica) per rank. One process per rank, started the torchrun way: torchrun
// --nproc_per_node=2 --no_python, tests/support/launch_ranks.sh, or scripts/netlink.sh each (an
// emulated link; GLOO_SOCKET_IFNAME names the rank's port). Methods, each timed once per round,
// rounds interleaved (each round starts one method later):
//   allreduce          the group's allreduce (SUM) of one flat tensor of the layout's floats, alone:
//                      gloo's own exchange of the same bytes
//   gradavg            gradavg::c10d::average_gradients_into with a workspace and a plan (owners
//                      sum in rank order: bitwise the same on every rank)
//   gradavg/bf16       the same with options.exchange.compression = bfloat16
//   backward           a libtorch module holding parameters of the layout's shapes (forward reads
//                      one element of each, backward writes every gradient element): the step
//                      without averaging; bench/ddp_peer.py's `backward`
//   c10d_data_parallel the same step with c10d_data_parallel (25 MiB buckets, DDP's default),
//                      finish() included: bench/ddp_peer.py's `ddp` is its peer on the same link
//   c10d_data_parallel/bf16  the same with options.exchange.compression = bfloat16: the peer of
//                      ddp_peer.py's `ddp_fp16_hook`
// A method's time in a round is the slowest rank's (MAX over the group); a point is the median over
// --rounds rounds, after one warm-up round. gradavg's results are hashed and compared across ranks
// every round: the bench exits 1 if any differs.
//
//   gradavg_bench_c10d [--model resnet50|bert_base|all] [--rounds N] [--fusion-kib K]
// --fusion-kib: options.exchange.fusion_bytes of the gradavg methods and c10d_data_parallel, in KiB
// (default 0: automatic).
#include <gradavg/gradavg.hpp>
#include <gradavg/torch_c10d.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model_shapes.hpp"

namespace {

using namespace gradavg_bench;  // model_shapes

::c10d::ProcessGroup* group = nullptr;

/// The largest of every rank's value (one allreduce).
double slowest(double value) {
  std::vector<at::Tensor> t{at::from_blob(&value, {1}, at::TensorOptions(at::kDouble))};
  ::c10d::AllreduceOptions how;
  how.reduceOp = ::c10d::ReduceOp::MAX;
  group->allreduce(t, how)->wait();
  return value;
}

/// f's time in ms on the slowest rank, every rank starting after a barrier.
double time_ms(const std::function<void()>& f) {
  group->barrier()->wait();
  const auto start = std::chrono::steady_clock::now();
  f();
  return slowest(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

std::uint64_t hash_of(const std::vector<std::vector<float>>& vs) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& v : vs) {
    const auto* b = reinterpret_cast<const unsigned char*>(v.data());
    for (std::size_t i = 0; i < v.size() * sizeof(float); i += 64) h = (h ^ b[i]) * 1099511628211ull;
  }
  return h;
}

/// Parameters of a layout's shapes; forward reads one element of each (ddp_peer.py's Layout).
struct LayoutImpl : torch::nn::Module {
  explicit LayoutImpl(const model_shapes& m) {
    for (std::size_t i = 0; i < m.params.size(); ++i)
      params.push_back(register_parameter("p" + std::to_string(i), torch::zeros(m.params[i].dims)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor total = x;
    for (auto& p : params) total = total + p.view(-1)[0] * x;
    return total.sum();
  }
  std::vector<torch::Tensor> params;
};
TORCH_MODULE(Layout);

bool run_model(const model_shapes& m, int rounds, std::size_t fusion_bytes) {
  const int rank = group->getRank();
  std::size_t floats = 0;
  std::vector<std::vector<std::pair<std::span<const float>, std::size_t>>> towers(1);
  std::vector<std::vector<float>> grads, means;
  for (const auto& p : m.params) {
    grads.emplace_back(p.size());
    for (std::size_t j = 0; j < p.size(); ++j) grads.back()[j] = static_cast<float>((j * 7 + rank * 3) % 13) * 0.25f;
    means.emplace_back(p.size());
    floats += p.size();
  }
  for (std::size_t i = 0; i < grads.size(); ++i) towers[0].emplace_back(grads[i], i);
  at::Tensor flat = torch::ones({static_cast<std::int64_t>(floats)});

  gradavg::c10d::workspace work;
  gradavg::plan plain_plan, bf16_plan;
  gradavg::c10d::options plain, bf16;
  plain.exchange.work = bf16.exchange.work = &work;
  plain.exchange.fusion_bytes = bf16.exchange.fusion_bytes = fusion_bytes;
  bf16.exchange.compression = gradavg::compression::bfloat16;
  Layout model(m), averaged(m);
  gradavg::c10d::options dp_options;
  dp_options.exchange.fusion_bytes = fusion_bytes;
  gradavg::libtorch::c10d_data_parallel dp(*group, std::vector<Layout>{averaged}, dp_options, {},
                                           {.bytes = std::size_t{25} << 20});
  Layout averaged_bf16(m);
  gradavg::c10d::options dp_bf16_options = dp_options;
  dp_bf16_options.exchange.compression = gradavg::compression::bfloat16;
  gradavg::libtorch::c10d_data_parallel dp_bf16(*group, std::vector<Layout>{averaged_bf16}, dp_bf16_options, {},
                                                {.bytes = std::size_t{25} << 20});
  const at::Tensor x = torch::ones({4});
  bool same = true;
  auto checked = [&](gradavg::plan& p, const gradavg::c10d::options& o) {
    return [&] {
      gradavg::c10d::average_gradients_into(p, *group, towers, means, o);
      const std::uint64_t h = hash_of(means);
      std::uint64_t both[2] = {h, ~h};
      gradavg::c10d::detail::reduce_words(*group, both, 2, ::c10d::ReduceOp::MAX);
      same = same && both[0] == ~both[1];
    };
  };
  const std::vector<std::pair<const char*, std::function<void()>>> methods = {
      {"allreduce", [&] {
         std::vector<at::Tensor> t{flat};
         group->allreduce(t)->wait();
       }},
      {"gradavg", checked(plain_plan, plain)},
      {"gradavg/bf16", checked(bf16_plan, bf16)},
      {"backward", [&] {
         model->zero_grad(false);
         model->forward(x).backward();
       }},
      {"c10d_data_parallel", [&] {
         averaged->zero_grad(false);
         averaged->forward(x).backward();
         dp.finish();
       }},
      {"c10d_data_parallel/bf16", [&] {
         averaged_bf16->zero_grad(false);
         averaged_bf16->forward(x).backward();
         dp_bf16.finish();
       }},
  };
  std::vector<std::vector<double>> times(methods.size());
  for (int r = 0; r <= rounds; ++r)
    for (std::size_t i = 0; i < methods.size(); ++i) {
      const std::size_t k = (i + static_cast<std::size_t>(r)) % methods.size();
      const double ms = time_ms(methods[k].second);
      if (r > 0) times[k].push_back(ms);
    }
  if (rank == 0) {
    std::printf("%-9s c10d over gloo, %d ranks, %zu floats: ", m.name.c_str(), group->getSize(), floats);
    for (std::size_t k = 0; k < methods.size(); ++k)
      std::printf(" %s %.3g [%.3g-%.3g]", methods[k].first, median(times[k]),
                  *std::min_element(times[k].begin(), times[k].end()),
                  *std::max_element(times[k].begin(), times[k].end()));
    std::printf(" ms\n  gradavg / allreduce %.3f, c10d_data_parallel / backward %.3f%s\n",
                median(times[1]) / median(times[0]), median(times[4]) / median(times[3]),
                same ? "" : "  FAILED: results differ between ranks");
    std::fflush(stdout);
  }
  return same;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "resnet50";
  int rounds = 5;
  std::size_t fusion_bytes = 0;
  for (int a = 1; a + 1 < argc; a += 2) {
    const std::string_view arg = argv[a];
    if (arg == "--model") model = argv[a + 1];
    else if (arg == "--rounds") rounds = std::max(1, std::atoi(argv[a + 1]));
    else if (arg == "--fusion-kib") fusion_bytes = static_cast<std::size_t>(std::atol(argv[a + 1])) << 10;
    else {
      std::fprintf(stderr, "usage: %s [--model resnet50|bert_base|all] [--rounds N] [--fusion-kib K]\n", argv[0]);
      return 2;
    }
  }
  torch::set_num_threads(1);
  const auto owned = gradavg::c10d::process_group_from_environment();
  group = owned.get();
  bool ok = true;
  for (const model_shapes& m : {resnet50_shapes(), bert_base_shapes()})
    if (model == "all" || model == m.name) ok = run_model(m, rounds, fusion_bytes) && ok;
  return ok ? 0 : 1;
}
