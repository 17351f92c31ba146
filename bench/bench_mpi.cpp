// gradavg::mpi against the ways users average across processes today, on ResNet-50 and BERT-base
// parameter layouts (model_shapes.hpp) and small_1000x64 (1,000 variables of 64 floats: where the
// per-call agreement weighs most), float gradients, T towers per rank (--towers, default 1
// and 8), mean alone and mean + squares. Methods, each timed once per round, rounds interleaved:
//   allreduce      one in-place MPI_Allreduce over the bytes gradavg moves (P floats, 2P with
//                  squares), alone: the communication gradavg's local work would hide behind
//   local          the local pass alone: gradavg::average_gradients_into over this rank's towers
//   per_variable   a local Eigen sum of the rank's towers, one in-place MPI_Allreduce per variable
//                  (and per squares variable), a divide (PyTorch's C++ dist-mnist example)
//   horovod_64mib  local Eigen sum, pack into a 64 MiB fusion buffer, MPI_Allreduce, unpack,
//                  divide: separate passes (Horovod's way); only with --horovod 1
//   exchange_p2p   gradavg's exchange alone, without the local pass: per bucket (automatic size,
//                  three in flight), each slice to its owner, the owner's sum in rank order, the sum
//                  back to every rank, by MPI_Isend / MPI_Irecv; only with --schedules 1
//   exchange_collectives  the same through MPI_Ialltoallv and MPI_Iallgatherv; --schedules 1
//   gradavg/F      gradavg::mpi::average_gradients_into with a workspace, fusion buffers of F MiB
//                  (--fusion-mib, a comma-separated list; 0: automatic_fusion_bytes); with
//                  --point-to-point 1 also gradavg/F/point_to_point (options.exchange.method)
//   gradavg/F/plan the first gradavg/F with a gradavg::plan kept across rounds (every call after
//                  the first: no agreement collective); only with --plan 1 (the default)
//   gradavg/auto/bf16/plan, gradavg/auto/fp16/plan, gradavg/auto/int8_ef/plan  the same with
//                  options.exchange.compression bfloat16, float16 and int8 (with error feedback: a
//                  residual kept across calls, a new seed each call), each with a plan of its own;
//                  only with --compression 1
//   gradavg/auto/sharded/plan  options.exchange.output = sharded (each rank receives its shard's
//                  means: a reduce-scatter), with a plan; gather_shards, gather_shards/bf16: the
//                  gather of every rank's shard of the means afterwards (raw, and in bfloat16);
//                  gradavg/auto/sharded+gather: the two back to back, whose result is the
//                  replicated means (hashed against gradavg/auto's); only with --sharded 1; with
//                  --point-to-point 1 also gradavg/auto/sharded/point_to_point/plan
// A method's time in a round is the slowest rank's (MPI_MAX, after a barrier); a point is the
// median over --rounds rounds, after one warm-up round; each round starts one method later.
// Every gradavg result (every fusion size, every round) is hashed and compared across ranks and
// with the first of its wire format (int8 with error feedback: across ranks only): the bench
// exits 1 if any differs. Before the models, a link check: each rank exchanges 32 MiB with rank ^ 1
// (MPI_Sendrecv, median of 5), reported in Gbit/s per direction.
//
//   mpiexec -n 2 gradavg_bench_mpi [--model resnet50|bert_base|small_1000x64|all] [--towers 1,8]
//       [--squares 0|1|2 (both)] [--rounds N] [--fusion-mib 0,16] [--threads N] [--horovod 0|1]
//       [--schedules 0|1] [--point-to-point 0|1] [--plan 0|1] [--compression 0|1] [--sharded 0|1]
//       [--gap-ms N] [--timeline 0|1]
// --timeline 1: also gradavg/auto/plan/timeline, the planned call with a gradavg::timeline
// attached (its events cleared before each call): its cost against gradavg/auto/plan, and the
// overlap its profile reports (call_profile::overlap(), rank 0's median) beside the bench's own,
// (local + exchange_collectives - gradavg/auto/plan) / local, with --schedules 1. With
// GRADAVG_TIMELINE set, the last call's events are written there (one model, towers and squares
// setting per run: each writes over the last).
// --gap-ms N: every rank sleeps N ms before each timed call, so that each starts on an idle link
// (a shaped link's token bucket full, as after a training step's compute); default 0: back to
// back, where a method that starts sending sooner finds the bucket emptier.
#include <gradavg/gradavg.hpp>
#include <gradavg/mpi.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <Eigen/Core>

#include "model_shapes.hpp"

namespace {

using gradavg_bench::model_shapes;

struct config {
  std::string model = "all";
  std::vector<int> towers = {1, 8};
  int squares = 2;  // 2: without and with
  int rounds = 5;
  std::vector<int> fusion_mib = {0};  // 0: gradavg's automatic bucket size
  std::size_t threads = 1;
  bool horovod = false;
  bool schedules = false;
  bool point_to_point = false;
  bool plan = true;
  bool compression = false;
  bool sharded = false;
  int gap_ms = 0;
  bool timeline = false;
};

int rank_of() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// The slowest rank's time of one call of f, in milliseconds, after gap_ms of idle link (every
/// rank sleeps, then a barrier).
double time_once_ms(const std::function<void()>& f, int gap_ms = 0) {
  if (gap_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  f();
  double mine = MPI_Wtime() - start, slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest * 1e3;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// FNV-1a over the bytes of every vector.
std::uint64_t hash_of(const std::vector<std::vector<float>>& vs) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& v : vs) {
    const auto* p = reinterpret_cast<const unsigned char*>(v.data());
    for (std::size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return h;
}

/// The median achieved rate of a 32 MiB MPI_Sendrecv with rank ^ 1, Gbit/s per direction (0 for
/// a rank without a partner).
double link_check_gbit() {
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const int partner = rank_of() ^ 1;
  const std::size_t bytes = std::size_t{32} << 20;
  std::vector<char> out(bytes, 1), in(bytes);
  auto exchange = [&] {
    if (partner < ranks)
      MPI_Sendrecv(out.data(), static_cast<int>(bytes), MPI_BYTE, partner, 7, in.data(), static_cast<int>(bytes),
                   MPI_BYTE, partner, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  };
  time_once_ms(exchange);  // warm-up
  std::vector<double> ms;
  for (int rep = 0; rep < 5; ++rep) ms.push_back(time_once_ms(exchange));
  return static_cast<double>(bytes) * 8 / (median(ms) * 1e-3) / 1e9;
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

struct method {
  std::string name;
  std::function<void()> f;
  int format = -1;  // a gradavg result in this gradavg::compression: hashed after every call (-1: none)
  // The link-time line: the wire format of what it sends (-1: no line), and how many values each
  // rank sends per value of the means (and squares): 2 (P - 1) / P for an allreduce's exchange,
  // (P - 1) / P for a reduce-scatter or a gather of the means alone.
  int wire = -1;
  double sent_per_value = 0;
};

/// Runs one cell; false when a gradavg result differed between ranks or from run to run.
bool run_model(const model_shapes& m, int towers, bool with_squares, const config& cfg, int ranks, double gbit) {
  problem p(m, towers);
  const float total_towers = static_cast<float>(towers * ranks);
  const std::size_t V = p.sizes.size();
  std::vector<method> methods;

  // allreduce: the same bytes in one call.
  const std::size_t all_floats = p.total * (with_squares ? 2 : 1);
  std::vector<float> flat(all_floats, 1.0f);
  methods.push_back({"allreduce", [&] {
                       MPI_Allreduce(MPI_IN_PLACE, flat.data(), static_cast<int>(all_floats), MPI_FLOAT, MPI_SUM,
                                     MPI_COMM_WORLD);
                     }});
  gradavg::options local_opts;
  local_opts.run.threads = cfg.threads;
  std::vector<std::vector<float>> local_means = p.means, local_squares = p.squares;
  methods.push_back({"local", [&] {
                       if (with_squares)
                         gradavg::average_gradients_into(p.entries, local_means, local_squares, local_opts);
                       else gradavg::average_gradients_into(p.entries, local_means, local_opts);
                     }});
  methods.push_back({"per_variable", [&] {
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
                     }});
  // Horovod: fusion buffer of 64 MiB; tensors packed in order (squares after their means), a tensor
  // larger than the buffer reduced on its own.
  const std::size_t fusion_floats = (std::size_t{64} << 20) / sizeof(float);
  std::vector<float> fusion;
  std::vector<std::vector<float>> summed, summed_sq;
  if (cfg.horovod) {
    fusion.resize(fusion_floats);
    summed.resize(V);
    summed_sq.resize(V);
    for (std::size_t i = 0; i < V; ++i) {
      summed[i].resize(p.sizes[i]);
      if (with_squares) summed_sq[i].resize(p.sizes[i]);
    }
    methods.push_back({"horovod_64mib", [&] {
                         std::vector<float*> tensors, outs;
                         std::vector<std::size_t> lengths;
                         for (std::size_t i = 0; i < V; ++i) {
                           p.local_sum(i, summed[i].data(), with_squares ? summed_sq[i].data() : nullptr);
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
                             MPI_Allreduce(MPI_IN_PLACE, tensors[t], static_cast<int>(lengths[t]), MPI_FLOAT,
                                           MPI_SUM, MPI_COMM_WORLD);
                             std::memcpy(outs[t], tensors[t], lengths[t] * sizeof(float));
                             Map(outs[t], static_cast<Eigen::Index>(lengths[t])) /= total_towers;
                             ++t;
                             continue;
                           }
                           std::size_t used = 0, first = t;
                           for (; t < tensors.size() && lengths[t] <= fusion_floats &&
                                  used + lengths[t] <= fusion_floats;
                                ++t) {
                             std::memcpy(fusion.data() + used, tensors[t], lengths[t] * sizeof(float));
                             used += lengths[t];
                           }
                           MPI_Allreduce(MPI_IN_PLACE, fusion.data(), static_cast<int>(used), MPI_FLOAT, MPI_SUM,
                                         MPI_COMM_WORLD);
                           used = 0;
                           for (std::size_t u = first; u < t; ++u) {
                             std::memcpy(outs[u], fusion.data() + used, lengths[u] * sizeof(float));
                             used += lengths[u];
                           }
                           for (std::size_t u = first; u < t; ++u)
                             Map(outs[u], static_cast<Eigen::Index>(lengths[u])) /= total_towers;
                         }
                       }});
  }
  // gradavg's exchange alone (no local pass), and the same exchange through MPI's nonblocking
  // collectives (MPI_Ialltoallv, the ordered sum, MPI_Iallgatherv): buckets of the automatic size,
  // three in flight, as gradavg pipelines them.
  const std::size_t bucket =
      std::min(all_floats, gradavg::mpi::automatic_fusion_bytes(ranks) / sizeof(float));
  const std::size_t stride = 2 * bucket + static_cast<std::size_t>(ranks);
  std::vector<float> sets(3 * stride);  // per set: the bucket, then every rank's slice
  std::vector<MPI_Request> requests(3 * 2 * static_cast<std::size_t>(ranks));
  std::vector<int> counts(static_cast<std::size_t>(ranks)), displs(counts.size()), recv_counts(counts.size()),
      recv_displs(counts.size());
  auto schedule = [&](bool collectives) {
    const std::size_t buckets = (all_floats + bucket - 1) / bucket;
    const int me = rank_of();
    const std::size_t R = static_cast<std::size_t>(ranks);
    auto len_of = [&](std::size_t b) { return std::min(bucket, all_floats - b * bucket); };
    auto at = [&](std::size_t len, std::size_t r) { return len * r / R; };
    std::size_t pending[3] = {};
    auto wait = [&](std::size_t s) {
      MPI_Waitall(static_cast<int>(pending[s]), requests.data() + s * 2 * R, MPI_STATUSES_IGNORE);
      pending[s] = 0;
    };
    auto scatter = [&](std::size_t b) {
      const std::size_t s = b % 3, len = len_of(b), mine = at(len, me + 1) - at(len, me);
      float* local = sets.data() + s * stride;
      float* recv = local + bucket;
      MPI_Request* req = requests.data() + s * 2 * R;
      if (collectives) {
        for (std::size_t r = 0; r < R; ++r) {
          counts[r] = static_cast<int>(at(len, r + 1) - at(len, r));
          displs[r] = static_cast<int>(at(len, r));
          recv_counts[r] = static_cast<int>(mine);
          recv_displs[r] = static_cast<int>(mine * r);
        }
        MPI_Ialltoallv(local, counts.data(), displs.data(), MPI_FLOAT, recv, recv_counts.data(), recv_displs.data(),
                       MPI_FLOAT, MPI_COMM_WORLD, req);
        pending[s] = 1;
        return;
      }
      for (std::size_t r = 0; r < R; ++r)
        if (r != static_cast<std::size_t>(me))
          MPI_Irecv(recv + mine * r, static_cast<int>(mine), MPI_FLOAT, static_cast<int>(r), 1, MPI_COMM_WORLD,
                    &req[pending[s]++]);
      for (std::size_t r = 0; r < R; ++r)
        if (r != static_cast<std::size_t>(me))
          MPI_Isend(local + at(len, r), static_cast<int>(at(len, r + 1) - at(len, r)), MPI_FLOAT,
                    static_cast<int>(r), 1, MPI_COMM_WORLD, &req[pending[s]++]);
    };
    auto reduce_and_gather = [&](std::size_t b) {
      const std::size_t s = b % 3, len = len_of(b), first = at(len, me), mine = at(len, me + 1) - first;
      wait(s);
      float* local = sets.data() + s * stride;
      const float* recv = local + bucket;
      for (std::size_t r = 0; r < R; ++r)  // the owner's sum, in rank order
        if (r != static_cast<std::size_t>(me))
          for (std::size_t j = 0; j < mine; ++j) local[first + j] += recv[mine * r + j];
      MPI_Request* req = requests.data() + s * 2 * R;
      if (collectives) {
        for (std::size_t r = 0; r < R; ++r) {
          counts[r] = static_cast<int>(at(len, r + 1) - at(len, r));
          displs[r] = static_cast<int>(at(len, r));
        }
        MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, local, counts.data(), displs.data(), MPI_FLOAT, MPI_COMM_WORLD,
                        req);
        pending[s] = 1;
        return;
      }
      for (std::size_t r = 0; r < R; ++r)
        if (r != static_cast<std::size_t>(me))
          MPI_Irecv(local + at(len, r), static_cast<int>(at(len, r + 1) - at(len, r)), MPI_FLOAT,
                    static_cast<int>(r), 2, MPI_COMM_WORLD, &req[pending[s]++]);
      for (std::size_t r = 0; r < R; ++r)
        if (r != static_cast<std::size_t>(me))
          MPI_Isend(local + first, static_cast<int>(mine), MPI_FLOAT, static_cast<int>(r), 2, MPI_COMM_WORLD,
                    &req[pending[s]++]);
    };
    for (std::size_t b = 0; b < buckets + 2; ++b) {
      if (b < buckets) scatter(b);
      if (b >= 1 && b - 1 < buckets) reduce_and_gather(b - 1);
      if (b >= 2) wait((b - 2) % 3);
    }
  };
  if (cfg.schedules) {
    methods.push_back({"exchange_p2p", [&] { schedule(false); }});
    methods.push_back({"exchange_collectives", [&] { schedule(true); }});
  }
  const std::size_t gradavg_methods = cfg.fusion_mib.size() * (cfg.point_to_point ? 2 : 1) + (cfg.plan ? 1 : 0);
  std::vector<gradavg::mpi::workspace> work(gradavg_methods);
  gradavg::plan plan;
  for (std::size_t f = 0; f < gradavg_methods; ++f) {
    const bool planned = cfg.plan && f + 1 == gradavg_methods;
    const int mib = cfg.fusion_mib[planned ? 0 : f % cfg.fusion_mib.size()];
    const bool point_to_point = !planned && f >= cfg.fusion_mib.size();
    methods.push_back({"gradavg/" + (mib == 0 ? std::string("auto") : std::to_string(mib) + "MiB") +
                           (point_to_point ? "/point_to_point" : "") + (planned ? "/plan" : ""),
                       [&, mib, f, point_to_point, planned] {
                         gradavg::mpi::options opts;
                         opts.exchange.work = &work[f];
                         opts.run.threads = cfg.threads;
                         opts.exchange.fusion_bytes = static_cast<std::size_t>(mib) << 20;
                         if (point_to_point) opts.exchange.method = gradavg::mpi::exchange_method::point_to_point;
                         if (planned && with_squares)
                           gradavg::mpi::average_gradients_into(plan, MPI_COMM_WORLD, p.entries, p.means, p.squares, opts);
                         else if (planned)
                           gradavg::mpi::average_gradients_into(plan, MPI_COMM_WORLD, p.entries, p.means, opts);
                         else if (with_squares)
                           gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, p.entries, p.means, p.squares, opts);
                         else gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, p.entries, p.means, opts);
                       },
                       0});
  }
  // The planned call again, recording into a timeline (cleared after each call: no file).
  const char* timeline_path = std::getenv("GRADAVG_TIMELINE");
  gradavg::timeline line(timeline_path != nullptr && *timeline_path != '\0' ? timeline_path : "/dev/null");
  gradavg::mpi::workspace timeline_work;
  gradavg::plan timeline_plan;
  std::vector<double> profile_overlap;
  std::size_t timeline_method = 0;
  if (cfg.timeline) {
    timeline_method = methods.size();
    methods.push_back({"gradavg/auto/plan/timeline",
                       [&] {
                         gradavg::mpi::options opts;
                         opts.exchange.work = &timeline_work;
                         opts.run.threads = cfg.threads;
                         opts.run.timeline = &line;
                         line.clear();
                         if (with_squares)
                           gradavg::mpi::average_gradients_into(timeline_plan, MPI_COMM_WORLD, p.entries, p.means,
                                                                p.squares, opts);
                         else gradavg::mpi::average_gradients_into(timeline_plan, MPI_COMM_WORLD, p.entries, p.means, opts);
                         profile_overlap.push_back(line.last_call().overlap());
                       },
                       0});
  }
  const std::size_t uncompressed_end = methods.size();
  const gradavg::compression formats[3] = {gradavg::compression::bfloat16, gradavg::compression::float16,
                                           gradavg::compression::int8};
  const char* format_names[3] = {"bf16", "fp16", "int8_ef"};
  std::vector<gradavg::mpi::workspace> compressed_work(3);
  std::vector<gradavg::plan> compressed_plans(3);
  std::vector<float> residual(cfg.compression ? p.total : 0, 0.0f);  // int8's error feedback
  std::uint64_t step = 0;
  for (int c = 0; c < (cfg.compression ? 3 : 0); ++c) {
    const auto format = formats[c];
    methods.push_back({std::string("gradavg/auto/") + format_names[c] + "/plan",
                       [&, c, format] {
                         gradavg::mpi::options opts;
                         opts.exchange.work = &compressed_work[static_cast<std::size_t>(c)];
                         opts.exchange.compression = format;
                         if (format == gradavg::compression::int8) {
                           opts.exchange.residual = residual;
                           opts.exchange.seed = ++step;
                         }
                         opts.run.threads = cfg.threads;
                         auto& pl = compressed_plans[static_cast<std::size_t>(c)];
                         if (with_squares)
                           gradavg::mpi::average_gradients_into(pl, MPI_COMM_WORLD, p.entries, p.means, p.squares, opts);
                         else gradavg::mpi::average_gradients_into(pl, MPI_COMM_WORLD, p.entries, p.means, opts);
                       },
                       static_cast<int>(format), static_cast<int>(format), 2.0 * (ranks - 1) / ranks});
  }
  // Sharded output and the gather of shards (the means as the parameters: the same element count).
  gradavg::mpi::workspace sharded_work, gather_work;
  gradavg::plan sharded_plan;
  gradavg::mpi::workspace sharded_p2p_work;
  gradavg::plan sharded_p2p_plan;
  auto sharded_with = [&](gradavg::mpi::exchange_method how) {
    const bool p2p = how == gradavg::mpi::exchange_method::point_to_point;
    gradavg::mpi::options opts;
    opts.exchange.work = p2p ? &sharded_p2p_work : &sharded_work;
    opts.exchange.output = gradavg::output_mode::sharded;
    opts.exchange.method = how;
    opts.run.threads = cfg.threads;
    auto& pl = p2p ? sharded_p2p_plan : sharded_plan;
    if (with_squares)
      gradavg::mpi::average_gradients_into(pl, MPI_COMM_WORLD, p.entries, p.means, p.squares, opts);
    else gradavg::mpi::average_gradients_into(pl, MPI_COMM_WORLD, p.entries, p.means, opts);
  };
  auto sharded_call = [&] { sharded_with(gradavg::mpi::exchange_method::collectives); };
  auto gather_call = [&](gradavg::compression format) {
    gradavg::mpi::options opts;
    opts.exchange.work = &gather_work;
    opts.exchange.compression = format;
    gradavg::mpi::gather_shards(MPI_COMM_WORLD, p.means, opts);
  };
  if (cfg.sharded) {
    const double half = static_cast<double>(ranks - 1) / ranks;
    const auto none = static_cast<int>(gradavg::compression::none);
    methods.push_back({"gradavg/auto/sharded/plan", sharded_call, -1, none, half});
    if (cfg.point_to_point)
      methods.push_back({"gradavg/auto/sharded/point_to_point/plan",
                         [&] { sharded_with(gradavg::mpi::exchange_method::point_to_point); }, -1, none, half});
    methods.push_back({"gather_shards", [&] { gather_call(gradavg::compression::none); }, -1, none,
                       half / (with_squares ? 2 : 1)});
    methods.push_back({"gather_shards/bf16", [&] { gather_call(gradavg::compression::bfloat16); }, -1,
                       static_cast<int>(gradavg::compression::bfloat16), half / (with_squares ? 2 : 1)});
    // The result of both: the replicated means (hashed; the squares stay sharded).
    methods.push_back({"gradavg/auto/sharded+gather",
                       [&] {
                         sharded_call();
                         gather_call(gradavg::compression::none);
                       },
                       -1, none, half * (with_squares ? 1.5 : 2)});
  }

  // Rounds: every method once per round, in order; round 0 is the warm-up.
  std::vector<std::vector<double>> times(methods.size());
  std::uint64_t reference[4] = {};
  bool same = true, have_reference[4] = {};
  std::uint64_t means_reference = 0;  // the means of format none (gradavg/auto), for sharded+gather
  bool have_means_reference = false;
  for (int round = 0; round <= cfg.rounds; ++round)
    for (std::size_t n = 0; n < methods.size(); ++n) {
      // Each round starts one method later: no method always follows the same one (a shaped
      // link's token bucket, say, is left fuller by a slow method than by a fast one).
      const std::size_t j = (n + static_cast<std::size_t>(round)) % methods.size();
      const double ms = time_once_ms(methods[j].f, cfg.gap_ms);
      if (round > 0) times[j].push_back(ms);
      if (methods[j].name == "gradavg/auto/sharded+gather") {
        // The gathered means against the replicated call's (gradavg/auto's, hashed first).
        const std::uint64_t h = hash_of(p.means);
        if (!have_means_reference) continue;  // gradavg/auto has not run yet in round 0
        int differs = h != means_reference ? 1 : 0;
        MPI_Allreduce(MPI_IN_PLACE, &differs, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        same = same && differs == 0;
        continue;
      }
      const int g = methods[j].format;
      if (g < 0) continue;
      const std::uint64_t h = hash_of(p.means) ^ (with_squares ? hash_of(p.squares) * 31 : 0);
      if (g == 0 && !have_means_reference) {
        means_reference = hash_of(p.means);
        have_means_reference = true;
      }
      // int8 with error feedback: a new seed and residual each call, so only the ranks compare.
      if (!have_reference[g] || g == static_cast<int>(gradavg::compression::int8)) {
        reference[g] = h;
        MPI_Bcast(&reference[g], 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
        have_reference[g] = true;
      }
      int differs = h != reference[g] ? 1 : 0;
      MPI_Allreduce(MPI_IN_PLACE, &differs, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
      same = same && differs == 0;
    }

  std::vector<double> med(methods.size());
  for (std::size_t j = 0; j < methods.size(); ++j) med[j] = median(times[j]);
  if (rank_of() == 0) {
    const double allreduce = med[0], local = med[1], per_variable = med[2];
    const std::size_t first_gradavg = uncompressed_end - gradavg_methods;
    std::size_t best = first_gradavg;
    for (std::size_t j = best; j < uncompressed_end; ++j)
      if (med[j] < med[best]) best = j;
    const double bound = std::max(local, allreduce);
    std::printf("%-9s T=%d %-12s", m.name.c_str(), towers, with_squares ? "mean+squares" : "mean");
    for (std::size_t j = 0; j < methods.size(); ++j) {
      // Milliseconds to three significant digits (the small model's calls take tens of µs).
      std::printf("  %s %.3g", methods[j].name.c_str(), med[j]);
      if (times[j].size() > 1) {
        const auto [lo, hi] = std::minmax_element(times[j].begin(), times[j].end());
        std::printf(" [%.3g-%.3g]", *lo, *hi);
      }
    }
    std::printf(" ms\n    %s: %.2fx allreduce, %.2fx max(local, allreduce); per_variable/gradavg %.2fx of %.2fx "
                "(perfect overlap); %s: %.2fx allreduce; %s\n",
                methods[first_gradavg].name.c_str(), med[first_gradavg] / allreduce, med[first_gradavg] / bound,
                per_variable / med[first_gradavg], (local + allreduce) / bound, methods[best].name.c_str(),
                med[best] / allreduce, same ? "bitwise the same on every rank and in every run" : "RESULTS DIFFER");
    if (cfg.timeline) {
      // The planned call's time with and without a timeline; overlap from the profile (the
      // warm-up round's left out) and from the bench's times.
      std::size_t planned = first_gradavg;
      for (std::size_t j = first_gradavg; j < timeline_method; ++j)
        if (methods[j].name == "gradavg/auto/plan") planned = j;
      std::vector<double> rounds(profile_overlap.begin() + 1, profile_overlap.end());
      std::printf("    %s: %.3fx %s; overlap from its profile %.0f%%", methods[timeline_method].name.c_str(),
                  med[timeline_method] / med[planned], methods[planned].name.c_str(), 100 * median(rounds));
      for (std::size_t j = 0; j < methods.size(); ++j)
        if (methods[j].name == "exchange_collectives")
          std::printf(", from the bench's times %.0f%% ((local + exchange_collectives - %s) / local)",
                      100 * std::clamp((local + med[j] - med[planned]) / local, 0.0, 1.0), methods[planned].name.c_str());
      std::printf("\n");
    }
    // The link's time for the bytes a rank sends (each direction): sent_per_value of the
    // encoded values (the format's bytes per block of values), at the link check's rate.
    namespace processes = gradavg::detail::processes;
    for (std::size_t j = uncompressed_end; j < methods.size(); ++j) {
      if (methods[j].wire < 0) continue;
      const processes::codec<float> format{static_cast<gradavg::compression>(methods[j].wire)};
      const double bytes_per_value = format.encodes() ? static_cast<double>(format.block_bytes()) /
                                                            static_cast<double>(processes::block_values)
                                                      : sizeof(float);
      const double sent = methods[j].sent_per_value * static_cast<double>(all_floats) * bytes_per_value;
      const double link_ms = sent * 8 / (gbit * 1e9) * 1e3;
      std::printf("    %s: %.2fx allreduce, %.2fx %s; the link's time for its bytes %.3g ms: %.2fx of it\n",
                  methods[j].name.c_str(), med[j] / allreduce, med[j] / med[best], methods[best].name.c_str(), link_ms,
                  med[j] / link_ms);
    }
    std::fflush(stdout);
  }
  // The last timed call's events (GRADAVG_TIMELINE), else nothing.
  if (cfg.timeline && line.file() != "/dev/null") line.write();
  else line.clear();
  return same;
}

std::vector<int> parse_list(const char* v) {
  std::vector<int> out;
  for (const char* s = v; *s != 0;) {
    char* end = nullptr;
    out.push_back(static_cast<int>(std::strtol(s, &end, 10)));
    if (end == s) return {};
    s = *end == ',' ? end + 1 : end;
  }
  return out;
}

bool parse(int argc, char** argv, config& c) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--model") c.model = v;
    else if (a == "--towers") c.towers = parse_list(v);
    else if (a == "--squares") c.squares = std::atoi(v);
    else if (a == "--rounds") c.rounds = std::max(1, std::atoi(v));
    else if (a == "--fusion-mib") c.fusion_mib = parse_list(v);
    else if (a == "--threads") c.threads = static_cast<std::size_t>(std::max(1, std::atoi(v)));
    else if (a == "--horovod") c.horovod = std::atoi(v) != 0;
    else if (a == "--schedules") c.schedules = std::atoi(v) != 0;
    else if (a == "--point-to-point") c.point_to_point = std::atoi(v) != 0;
    else if (a == "--plan") c.plan = std::atoi(v) != 0;
    else if (a == "--compression") c.compression = std::atoi(v) != 0;
    else if (a == "--sharded") c.sharded = std::atoi(v) != 0;
    else if (a == "--gap-ms") c.gap_ms = std::max(0, std::atoi(v));
    else if (a == "--timeline") c.timeline = std::atoi(v) != 0;
    else return false;
  }
  const auto positive = [](int x) { return x > 0; };
  const auto non_negative = [](int x) { return x >= 0 && x <= 1024; };
  return argc % 2 == 1 && !c.towers.empty() && std::all_of(c.towers.begin(), c.towers.end(), positive) &&
         !c.fusion_mib.empty() && std::all_of(c.fusion_mib.begin(), c.fusion_mib.end(), non_negative);
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
  const double gbit = link_check_gbit();
  if (rank_of() == 0) {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(version, &len);
    std::printf("%d ranks; link check %.2f Gbit/s per direction; automatic fusion buffers %zu KiB; threads %zu; "
                "%d rounds; %.*s\n",
                ranks, gbit, gradavg::mpi::automatic_fusion_bytes(ranks) >> 10, cfg.threads, cfg.rounds,
                static_cast<int>(std::strcspn(version, ",\n")), version);
    std::fflush(stdout);
  }
  bool same = true;
  model_shapes small{"small_1000x64", {}, 1000, 64'000};
  for (int i = 0; i < 1000; ++i) small.params.push_back({std::to_string(i), {64}});
  for (const model_shapes& m : {gradavg_bench::resnet50_shapes(), gradavg_bench::bert_base_shapes(), small}) {
    if (cfg.model != "all" && cfg.model != m.name) continue;
    for (int towers : cfg.towers)
      for (int sq : {0, 1})
        if (cfg.squares == 2 || cfg.squares == sq) same = run_model(m, towers, sq == 1, cfg, ranks, gbit) && same;
  }
  MPI_Finalize();
  return same ? 0 : 1;
}
