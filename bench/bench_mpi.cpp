// gradavg::mpi against the ways users average across processes today, on ResNet-50 and BERT-base
// parameter layouts (model_shapes.hpp), float gradients, 1 and 2 towers per rank, mean alone and
// mean + squares:
//   gradavg_mpi      gradavg::mpi::average_gradients_into (fusion buffers of --fusion-mib; 0, the
//                    default: gradavg::mpi::automatic_fusion_bytes)
//   per_variable     (a) a local Eigen sum of the rank's towers, one in-place MPI_Allreduce per
//                    variable, a divide (PyTorch's C++ dist-mnist example)
//   horovod_64mib    (b) local Eigen sum, pack into a 64 MiB fusion buffer, MPI_Allreduce, unpack,
//                    divide: separate passes (Horovod's way)
//   allreduce_only   MPI_Allreduce alone over the same bytes in the same bucket sizes as gradavg_mpi
//                    (the communication gradavg_mpi's local work would hide behind)
// Each point: --reps timed repetitions after 2 warm-ups; a repetition's time is the slowest rank's
// (MPI_MAX), the point's the median. Rank 0 prints one line per point.
//
//   mpiexec -n 2 gradavg_bench_mpi [--model resnet50|bert_base|all] [--towers 1|2|0 (both)]
//                                  [--squares 0|1|2 (both)] [--reps N] [--fusion-mib M]
#include <gradavg/gradavg.hpp>
#include <gradavg/mpi.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <Eigen/Core>

#include "model_shapes.hpp"

namespace {

using gradavg_bench::model_shapes;

struct config {
  std::string model = "all";
  int towers = 0;   // 0: 1 and 2
  int squares = 2;  // 2: without and with
  int reps = 10;
  std::size_t fusion_mib = 0;  // 0: gradavg's automatic bucket size
};

int rank_of() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// Median over reps of the slowest rank's time of f, in milliseconds.
double time_ms(int reps, const std::function<void()>& f) {
  for (int w = 0; w < 2; ++w) f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    f();
    double mine = MPI_Wtime() - start, slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    t.push_back(slowest * 1e3);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

using Map = Eigen::Map<Eigen::ArrayXf>;
using ConstMap = Eigen::Map<const Eigen::ArrayXf>;

struct problem {
  std::vector<std::size_t> sizes;
  std::vector<std::vector<std::vector<float>>> grads;  // [tower][variable]
  std::vector<std::vector<float>> means, squares;
  std::vector<std::vector<std::pair<std::span<const float>, std::size_t>>> entries;
  std::size_t total = 0;

  problem(const model_shapes& m, int towers) {
    std::mt19937 gen(static_cast<unsigned>(rank_of() + 1));
    std::uniform_real_distribution<float> dist(-1, 1);
    for (const auto& p : m.params) sizes.push_back(p.size());
    for (std::size_t n : sizes) total += n;
    grads.resize(static_cast<std::size_t>(towers));
    for (auto& t : grads)
      for (std::size_t n : sizes) {
        t.emplace_back(n);
        for (float& x : t.back()) x = dist(gen);
      }
    for (std::size_t n : sizes) {
      means.emplace_back(n, 0.0f);
      squares.emplace_back(n, 0.0f);
    }
    entries.resize(grads.size());
    for (std::size_t k = 0; k < grads.size(); ++k)
      for (std::size_t i = 0; i < sizes.size(); ++i) entries[k].emplace_back(grads[k][i], i);
  }

  /// Local sums of variable i (and of its squares) into out / sq, with Eigen.
  void local_sum(std::size_t i, float* out, float* sq) const {
    Map o(out, static_cast<Eigen::Index>(sizes[i]));
    o = ConstMap(grads[0][i].data(), o.size());
    for (std::size_t k = 1; k < grads.size(); ++k) o += ConstMap(grads[k][i].data(), o.size());
    if (sq) {
      Map s(sq, o.size());
      s = ConstMap(grads[0][i].data(), o.size()).square();
      for (std::size_t k = 1; k < grads.size(); ++k) s += ConstMap(grads[k][i].data(), o.size()).square();
    }
  }
};

void run_model(const model_shapes& m, int towers, bool with_squares, const config& cfg, int ranks) {
  problem p(m, towers);
  const float total_towers = static_cast<float>(towers * ranks);
  gradavg::mpi::workspace work;
  gradavg::mpi::options opts;
  opts.work = &work;
  opts.fusion_bytes = cfg.fusion_mib << 20;
  const std::size_t V = p.sizes.size();

  auto gradavg_mpi = [&] {
    if (with_squares) gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, p.entries, p.means, p.squares, opts);
    else gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, p.entries, p.means, opts);
  };
  auto per_variable = [&] {
    for (std::size_t i = 0; i < V; ++i) {
      float* out = p.means[i].data();
      float* sq = with_squares ? p.squares[i].data() : nullptr;
      p.local_sum(i, out, sq);
      const int n = static_cast<int>(p.sizes[i]);
      MPI_Allreduce(MPI_IN_PLACE, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      Map(out, n) /= total_towers;
      if (sq) {
        MPI_Allreduce(MPI_IN_PLACE, sq, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        Map(sq, n) /= total_towers;
      }
    }
  };
  // Horovod: fusion buffer of 64 MiB; tensors packed in order (squares after their means), a tensor
  // larger than the buffer reduced on its own.
  const std::size_t fusion_floats = (std::size_t{64} << 20) / sizeof(float);
  std::vector<float> fusion(fusion_floats);
  std::vector<std::vector<float>> summed(V), summed_sq(V);
  for (std::size_t i = 0; i < V; ++i) {
    summed[i].resize(p.sizes[i]);
    if (with_squares) summed_sq[i].resize(p.sizes[i]);
  }
  auto horovod = [&] {
    for (std::size_t i = 0; i < V; ++i) p.local_sum(i, summed[i].data(), with_squares ? summed_sq[i].data() : nullptr);
    std::vector<float*> tensors, outs;
    std::vector<std::size_t> lengths;
    for (std::size_t i = 0; i < V; ++i) {
      tensors.push_back(summed[i].data());
      outs.push_back(p.means[i].data());
      lengths.push_back(p.sizes[i]);
      if (with_squares) {
        tensors.push_back(summed_sq[i].data());
        outs.push_back(p.squares[i].data());
        lengths.push_back(p.sizes[i]);
      }
    }
    std::size_t t = 0;
    while (t < tensors.size()) {
      if (lengths[t] > fusion_floats) {  // alone, in place
        MPI_Allreduce(MPI_IN_PLACE, tensors[t], static_cast<int>(lengths[t]), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        std::memcpy(outs[t], tensors[t], lengths[t] * sizeof(float));
        Map(outs[t], static_cast<Eigen::Index>(lengths[t])) /= total_towers;
        ++t;
        continue;
      }
      std::size_t used = 0, first = t;
      for (; t < tensors.size() && lengths[t] <= fusion_floats && used + lengths[t] <= fusion_floats; ++t) {
        std::memcpy(fusion.data() + used, tensors[t], lengths[t] * sizeof(float));  // pack
        used += lengths[t];
      }
      MPI_Allreduce(MPI_IN_PLACE, fusion.data(), static_cast<int>(used), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      used = 0;
      for (std::size_t u = first; u < t; ++u) {  // unpack, then divide: separate passes
        std::memcpy(outs[u], fusion.data() + used, lengths[u] * sizeof(float));
        used += lengths[u];
      }
      for (std::size_t u = first; u < t; ++u) Map(outs[u], static_cast<Eigen::Index>(lengths[u])) /= total_towers;
    }
  };
  // The bytes gradavg_mpi moves, in its bucket sizes, reduced by MPI alone.
  const std::size_t bucket_floats =
      (opts.fusion_bytes != 0 ? opts.fusion_bytes : gradavg::mpi::automatic_fusion_bytes(ranks)) / sizeof(float);
  const std::size_t all_floats = p.total * (with_squares ? 2 : 1);
  std::vector<float> flat(std::min(all_floats, bucket_floats));
  auto allreduce_only = [&] {
    for (std::size_t done = 0; done < all_floats; done += bucket_floats) {
      const int n = static_cast<int>(std::min(bucket_floats, all_floats - done));
      MPI_Allreduce(MPI_IN_PLACE, flat.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
  };

  struct method {
    const char* name;
    std::function<void()> f;
  };
  const method methods[] = {{"gradavg_mpi", gradavg_mpi},
                            {"per_variable", per_variable},
                            {"horovod_64mib", horovod},
                            {"allreduce_only", allreduce_only}};
  double ms[4];
  for (int j = 0; j < 4; ++j) ms[j] = time_ms(cfg.reps, methods[j].f);
  if (rank_of() == 0) {
    std::printf("%-9s towers/rank %d %-14s", m.name.c_str(), towers, with_squares ? "mean+squares" : "mean");
    for (int j = 0; j < 4; ++j) std::printf("  %s %7.1f ms", methods[j].name, ms[j]);
    std::printf("  | (a)/gradavg %.2fx  (b)/gradavg %.2fx  gradavg/allreduce %.2fx\n", ms[1] / ms[0], ms[2] / ms[0],
                ms[0] / ms[3]);
    std::fflush(stdout);
  }
}

bool parse(int argc, char** argv, config& c) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--model") c.model = v;
    else if (a == "--towers") c.towers = std::atoi(v);
    else if (a == "--squares") c.squares = std::atoi(v);
    else if (a == "--reps") c.reps = std::max(1, std::atoi(v));
    else if (a == "--fusion-mib") c.fusion_mib = static_cast<std::size_t>(std::max(0, std::atoi(v)));
    else return false;
  }
  return argc % 2 == 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  config cfg;
  if (!parse(argc, argv, cfg)) {
    if (rank_of() == 0) std::fprintf(stderr, "usage: see bench/bench_mpi.cpp\n");
    MPI_Finalize();
    return 2;
  }
  if (rank_of() == 0) {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(version, &len);
    const std::size_t fusion_bytes = cfg.fusion_mib != 0 ? cfg.fusion_mib << 20 : gradavg::mpi::automatic_fusion_bytes(ranks);
    std::printf("%d ranks; fusion buffers %zu KiB%s; %.*s\n", ranks, fusion_bytes >> 10, cfg.fusion_mib != 0 ? "" : " (automatic)",
                static_cast<int>(std::strcspn(version, ",\n")), version);
  }
  for (const model_shapes& m : {gradavg_bench::resnet50_shapes(), gradavg_bench::bert_base_shapes()}) {
    if (cfg.model != "all" && cfg.model != m.name) continue;
    for (int towers : {1, 2}) {
      if (cfg.towers != 0 && cfg.towers != towers) continue;
      for (int sq : {0, 1})
        if (cfg.squares == 2 || cfg.squares == sq) run_model(m, towers, sq == 1, cfg, ranks);
    }
  }
  MPI_Finalize();
  return 0;
}
