// Row-sparse gradients across processes (gradavg::mpi over row-sparse towers) on BERT-base: its
// word embedding (30,522 x 768 floats) with --rows distinct rows listed per tower (default 4,096: a
// batch of 32 x 128 tokens), --towers towers per rank (default 1), against the dense exchange of
// the same embedding; and the whole step's exchange (BERT-base's other 198 tensors dense, plus
// the embedding sparse or dense). Methods, each timed once per round, rounds interleaved (each
// round starts one method later), a method's time the slowest rank's, a point the median over
// --rounds rounds after a warm-up round:
//   emb_sparse      gradavg::mpi::average_gradients_into over the row-sparse towers, into a
//                   sparse_rows (the call: local sums, every rank's listed rows to every rank, the
//                   sums in rank order)
//   emb_dense       gradavg::mpi::average_gradients_into over the same towers densified (the
//                   densifying itself not timed), into a dense output
//   emb_allreduce   one MPI_Allreduce of the dense embedding (94 MB), alone
//   layers          gradavg::mpi::average_gradients_into over the other 198 tensors (dense)
// Ratios (medians over rounds of per-round ratios): emb_sparse.over.emb_dense (the target 0.2),
// emb_sparse.over.emb_allreduce, and step_sparse.over.step_dense = (layers + emb_sparse) /
// (layers + emb_dense) (the target 0.85). Before the rounds, every rank checks the sparse call's
// rows against the dense call's output bit for bit (exit 1 otherwise).
//
//   mpiexec -n 2 gradavg_bench_mpi_sparse [--rows N] [--towers N] [--rounds N] [--layers 0|1]
//   scripts/netlink.sh run ./build/bench/gradavg_bench_mpi_sparse     (the emulated link)
#include <gradavg/gradavg.hpp>
#include <gradavg/mpi.hpp>
#include <gradavg/sparse.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model_shapes.hpp"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// The slowest rank's seconds for f (after a barrier).
double timed(const std::function<void()>& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  f();
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  std::size_t listed = 4096, towers = 1, rounds = 5;
  bool layers_too = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i];
    const auto value = static_cast<std::size_t>(std::strtoul(argv[i + 1], nullptr, 10));
    if (flag == "--rows") listed = value;
    else if (flag == "--towers") towers = value;
    else if (flag == "--rounds") rounds = value;
    else if (flag == "--layers") layers_too = value != 0;
  }
  constexpr std::int64_t vocabulary = 30522;
  constexpr std::size_t width = 768;
  const std::size_t dense_elements = static_cast<std::size_t>(vocabulary) * width;
  const gradavg::shape dense_shape = gradavg::shape::matrix(vocabulary, static_cast<std::int64_t>(width));

  // This rank's towers: `listed` distinct rows each, drawn at random.
  std::mt19937 gen(static_cast<std::uint32_t>(17 + rank));
  std::uniform_real_distribution<float> value(-1, 1);
  std::vector<std::int64_t> all(static_cast<std::size_t>(vocabulary));
  std::iota(all.begin(), all.end(), std::int64_t{0});
  std::vector<std::vector<std::int64_t>> indices(towers);
  std::vector<std::vector<float>> values(towers), densified(towers, std::vector<float>(dense_elements, 0.0f));
  using rows_view = gradavg::row_sparse<std::int64_t, float>;
  std::vector<std::vector<std::pair<rows_view, int>>> sparse_tg(towers);
  std::vector<std::vector<std::pair<std::vector<float>*, int>>> dense_tg(towers);
  for (std::size_t k = 0; k < towers; ++k) {
    std::shuffle(all.begin(), all.end(), gen);
    indices[k].assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(listed));
    values[k].resize(listed * width);
    for (float& x : values[k]) x = value(gen);
    for (std::size_t n = 0; n < listed; ++n)
      std::copy_n(values[k].begin() + static_cast<std::ptrdiff_t>(n * width), width,
                  densified[k].begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(indices[k][n]) * width));
    sparse_tg[k].emplace_back(gradavg::rows_of<std::int64_t, float>(indices[k], values[k].data(), dense_shape), 0);
    dense_tg[k].emplace_back(&densified[k], 0);
  }
  // BERT-base's other tensors, dense, filled with small values.
  const gradavg_bench::model_shapes bert = gradavg_bench::bert_base_shapes();
  std::vector<std::vector<std::vector<float>>> layer_grads(towers);
  std::vector<std::vector<float>> layer_means;
  std::vector<std::vector<std::pair<std::vector<float>*, int>>> layer_tg(towers);
  if (layers_too) {
    for (std::size_t k = 0; k < towers; ++k)
      for (std::size_t p = 1; p < bert.params.size(); ++p) layer_grads[k].emplace_back(bert.params[p].size(), 0.001f);
    for (std::size_t p = 1; p < bert.params.size(); ++p) layer_means.emplace_back(bert.params[p].size());
    for (std::size_t k = 0; k < towers; ++k)
      for (auto& g : layer_grads[k]) layer_tg[k].emplace_back(&g, 0);
  }

  gradavg::mpi::workspace work;
  gradavg::mpi::options opts;
  opts.exchange.work = &work;
  gradavg::plan layer_plan, dense_plan;
  gradavg::sparse_rows<std::int64_t, float> sparse_out;
  std::vector<gradavg::sparse_rows<std::int64_t, float>*> sparse_means{&sparse_out};
  std::vector<float> dense_out(dense_elements), allreduced(dense_elements);
  std::vector<std::vector<float>*> dense_means{&dense_out};
  std::vector<std::vector<float>*> layer_outputs;
  for (auto& m : layer_means) layer_outputs.push_back(&m);

  const std::vector<std::pair<const char*, std::function<void()>>> methods{
      {"emb_sparse", [&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, sparse_tg, sparse_means); }},
      {"emb_dense",
       [&] { gradavg::mpi::average_gradients_into(dense_plan, MPI_COMM_WORLD, dense_tg, dense_means, opts); }},
      {"emb_allreduce",
       [&] {
         MPI_Allreduce(densified[0].data(), allreduced.data(), static_cast<int>(dense_elements), MPI_FLOAT, MPI_SUM,
                       MPI_COMM_WORLD);
       }},
      {"layers",
       [&] {
         if (layers_too)
           gradavg::mpi::average_gradients_into(layer_plan, MPI_COMM_WORLD, layer_tg, layer_outputs, opts);
       }}};

  // Warm-up round, and the check: the sparse call's rows are the dense call's bits.
  for (const auto& m : methods) m.second();
  int wrong = 0;
  for (std::size_t n = 0; n < sparse_out.indices.size(); ++n)
    wrong |= std::memcmp(sparse_out.values.data() + n * width,
                         dense_out.data() + static_cast<std::size_t>(sparse_out.indices[n]) * width,
                         width * sizeof(float)) != 0;
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (wrong != 0) {
    if (rank == 0) std::fprintf(stderr, "gradavg_bench_mpi_sparse: the sparse rows differ from the dense call's\n");
    MPI_Finalize();
    return 1;
  }

  std::vector<std::vector<double>> times(methods.size());
  for (std::size_t round = 0; round < rounds; ++round)
    for (std::size_t m = 0; m < methods.size(); ++m) {
      const std::size_t pick = (m + round) % methods.size();
      times[pick].push_back(timed(methods[pick].second));
    }
  if (rank == 0) {
    std::printf("ranks %d, towers per rank %zu, rows per tower %zu, rows in the mean %zu, rounds %zu\n", ranks, towers,
                listed, sparse_out.indices.size(), rounds);
    for (std::size_t m = 0; m < methods.size(); ++m)
      std::printf("  %-14s %9.1f ms\n", methods[m].first, median(times[m]) * 1e3);
    auto ratio = [&](auto f) {
      std::vector<double> r;
      for (std::size_t i = 0; i < rounds; ++i) r.push_back(f(i));
      return median(r);
    };
    auto over = [&](std::size_t a, std::size_t b) {
      return ratio([&](std::size_t i) { return times[a][i] / times[b][i]; });
    };
    std::printf("  emb_sparse.over.emb_dense      %.3f\n", over(0, 1));
    std::printf("  emb_sparse.over.emb_allreduce  %.3f\n", over(0, 2));
    if (layers_too)
      std::printf("  step_sparse.over.step_dense    %.3f\n",
                  ratio([&](std::size_t i) { return (times[3][i] + times[0][i]) / (times[3][i] + times[1][i]); }));
  }
  MPI_Finalize();
  return 0;
}
