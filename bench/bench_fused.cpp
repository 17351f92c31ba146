// The fused training step (options.compute.weights, scale, on_nonfinite, statistics; 16-bit gradients),
// measured by alternation like bench_paired.cpp (rounds.hpp): every contender of a point runs once
// per round, the start rotating, and ratios are medians of per-round ratios. Every contender is
// checked against a double reference before the rounds (means, squares, and the fused sums of
// mean^2 and of the means of squares); a mismatch skips the point with its message.
//
// Points (P = 16Mi elements per tower by default, --fused_elements=N to change; threads 1 and all
// cores):
//   fused/float/T:<T>/P:<P>/threads:<n>   T in {8, 16}. Contenders:
//     copy, copy_nt           the copy limits over P floats (rounds.hpp, limits.hpp)
//     read                    the T towers read side by side, no output (limits::read_fold),
//                             credited as a mean: the mean's bandwidth if its write were free
//     mean, mean_nt           plain gradavg, means only (nt: streaming stores)
//     mean_sq, mean_sq_nt     plain gradavg, means and squares
//     weights                 options.weights (uneven: the last tower weighs 20, the others 32)
//     scale                   options.compute.scale = 2^-10
//     report                  options.compute.on_nonfinite = report
//     stats                   options.compute.statistics, means only
//     stats_sq                the same with a squares output
//     all, all_sq             weights + scale + report + statistics together, without and with squares
//     all_nt, all_sq_nt       the same with streaming stores (what store_policy::automatic picks for
//                             calls of streaming_threshold_bytes or more)
//     separate                the separate-pass way: plain mean, then a norm pass (double), then a
//                             non-finite pass, then a scale pass over the means, each on the
//                             same number of threads
//   fused16/<bfloat16|half>/T:<T>/P:<P>/threads:<n>   T in {2, 4, 8, 16}. Contenders:
//     copy, copy_nt           the copy limits over the same bytes (P 16-bit values as P/2 floats)
//     read                    as for float, over the 16-bit towers
//     mean, mean_nt, mean_sq, mean_sq_nt   gradavg with outputs in the gradients' type
//     mean_f32                gradavg with float outputs (mixed precision), means only
//     onednn_sum              oneDNN's sum on bf16 sources into bf16 (bfloat16 points, when
//                             oneDNN has a bf16 sum on this CPU; onednn_bf16_sum says)
// Bytes are credited STREAM-style at the element size (2 bytes for 16-bit): (T+1)·P (means),
// (T+2)·P (with squares); mean_f32 T·P·2 + P·4; copies 2·P. The separate way is credited as a mean.
// Counters:
//   GBps.<c>                credited bytes / median seconds of contender c
//   <f>.over.mean           median t(f) / t(mean), f in weights, scale, report, stats, all, separate
//   <f>.over.mean_sq        median t(f) / t(mean_sq), f in stats_sq, all_sq
//   all_nt.over.mean_nt, all_sq_nt.over.mean_sq_nt   the same for the streaming contenders
//   separate.over.all       median t(separate) / t(all)
//   <op>.best_nt            1 when <op>_nt's median is below <op>'s (op: mean, mean_sq)
//   <op>.of.copy, <op>.of.copy_nt   median bandwidth(best of <op>, <op>_nt) / bandwidth(copy)
//   mean_f32.of.copy_nt     likewise, for the float outputs
//   read.of.copy_nt         median bandwidth(read) / bandwidth(copy_nt): the ceiling of
//                           mean.of.copy_nt that reading the inputs alone sets
//   mean.over.read          median t(best of mean, mean_nt) / t(read): what the write and the
//                           arithmetic add to reading the inputs
//   mean.vs.onednn_sum      median t(onednn_sum) / t(best of mean, mean_nt)
//   read.vs.onednn_sum      median t(onednn_sum) / t(read): the most any pass that reads its
//                           inputs could gain on oneDNN, writing nothing
//   onednn_bf16_sum         1 when oneDNN's bf16 sum ran in the point, 0 when oneDNN has none
//                           (the label names oneDNN's implementation, or "unsupported")
// Flags (before Google Benchmark's own): --fused_rounds=N (default 11), --fused_elements=N
// (default 16777216; a positive multiple of 64).
#include <gradavg/gradavg.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.hpp"
#include "harness.hpp"
#include "limits.hpp"
#include "parallel.hpp"
#include "peers.hpp"
#include "rounds.hpp"
#include "towers.hpp"

namespace gradavg_bench {
namespace {

using bf16 = Eigen::bfloat16;
using half = Eigen::half;

/// The unscaling factor of the scale contenders: a loss scale of 1024.
constexpr double loss_unscale = 1.0 / 1024;
/// Samples behind one tower's gradient (the uneven weights' full batch).
constexpr double samples_per_tower = 32;

template <class S>
constexpr const char* element_name() {
  if constexpr (std::is_same_v<S, bf16>) return "bfloat16";
  else if constexpr (std::is_same_v<S, half>) return "half";
  else return type_name<S>();
}

/// Relative tolerance of an output of type O: the float sums' error, or rounding to 16 bits.
template <class O>
constexpr double output_tolerance() {
  if constexpr (std::is_same_v<O, bf16>) return 0x1p-8;
  else if constexpr (std::is_same_v<O, half>) return 0x1p-10;
  else return tolerance<O>();
}

/// Tolerance of the fused sums against the double reference: float means carry about T ulp of
/// the mean of |g| each, and near-zero means are a large relative error of a small term.
constexpr double sums_tolerance = 1e-4;

/// Uneven tower weights: samples per tower when the last tower's batch is short.
std::vector<double> uneven_weights(std::size_t towers) {
  std::vector<double> w(towers, samples_per_tower);
  w.back() = 20;
  return w;
}

/// The double reference's sums over all elements of mean^2 and of the means of squares.
struct reference_sums {
  double mean_squared = 0;
  double mean_of_squares = 0;
};

/// Checks mean[i] (and sq[i] unless null) for i in [0, n) against a double reference of the
/// weighted (weights empty: every tower weighs 1), scaled mean (and mean of squares) over towers;
/// the mean's error is taken relative to the weighted mean of |g| times |scale|, the square's
/// relative to itself. Fills sums. Returns an empty string, or the first mismatch.
template <class S, class O>
std::string check_outputs(std::span<const S* const> towers, std::size_t n, const O* mean, const O* sq,
                          std::span<const double> weights, double scale, reference_sums& sums) {
  std::vector<double> w(towers.size(), 1.0);
  if (!weights.empty()) std::copy(weights.begin(), weights.end(), w.begin());
  double weight_sum = 0;
  for (double x : w) weight_sum += x;
  const double tol = output_tolerance<O>();
  const double tiny = static_cast<double>(std::numeric_limits<O>::min());
  sums = {};
  for (std::size_t i = 0; i < n; ++i) {
    double a = 0, magnitude = 0, s = 0;
    for (std::size_t k = 0; k < towers.size(); ++k) {
      const double x = static_cast<double>(towers[k][i]);
      a += w[k] * x;
      magnitude += w[k] * std::abs(x);
      s += w[k] * x * x;
    }
    const double m = a / weight_sum * scale, q = s / weight_sum * scale * scale;
    // Written as !(err <= bound) so that NaN fails.
    if (!(std::abs(static_cast<double>(mean[i]) - m) <= tol * magnitude / weight_sum * std::abs(scale) + tiny))
      return "mean mismatch at " + std::to_string(i) + ": got " + std::to_string(static_cast<double>(mean[i])) +
             ", want " + std::to_string(m);
    if (sq != nullptr && !(std::abs(static_cast<double>(sq[i]) - q) <= tol * q + tiny))
      return "square mismatch at " + std::to_string(i) + ": got " + std::to_string(static_cast<double>(sq[i])) +
             ", want " + std::to_string(q);
    sums.mean_squared += m * m;
    sums.mean_of_squares += q;
  }
  return {};
}

/// Checks a fused sum against the reference's; empty on success.
std::string check_sum(const char* what, double got, double want) {
  if (std::abs(got - want) <= sums_tolerance * want) return {};
  return std::string(what) + " " + std::to_string(got) + ", want " + std::to_string(want);
}

/// gradavg::average_gradients_into over one variable per tower, with the features in `features`
/// and threads: options.run.threads = n on a gradavg::thread_pool(n) the runner owns. O: the outputs'
/// element type. Outputs: means, and squares unless sq is null.
template <class S, class O>
class gradavg_fused final : public runner {
 public:
  gradavg_fused(std::span<const S* const> towers, std::size_t elements, O* mean, O* sq, int threads,
                const gradavg::options& features)
      : pool_(static_cast<std::size_t>(std::max(1, threads))), opts_(features) {
    opts_.run.threads = static_cast<std::size_t>(std::max(1, threads));
    opts_.run.pool = &pool_;
    for (const S* t : towers) grads_.push_back({{std::span<const S>(t, elements), 0}});
    means_.emplace_back(mean, elements);
    if (sq != nullptr) squares_.emplace_back(sq, elements);
  }

  void run() override {
    last_ = squares_.empty() ? gradavg::average_gradients_into(grads_, means_, opts_)
                             : gradavg::average_gradients_into(grads_, means_, squares_, opts_);
  }

  /// The summary of the last call.
  [[nodiscard]] const gradavg::summary& last() const noexcept { return last_; }

 private:
  gradavg::thread_pool pool_;  // declared before opts_, which points to it
  gradavg::options opts_;
  std::vector<std::vector<std::pair<std::span<const S>, int>>> grads_;
  std::vector<std::span<O>> means_, squares_;
  gradavg::summary last_;
};

/// The separate-pass way, as training code writes it without a fused kernel: the plain mean
/// (gradavg, no options), then the squared norm of the means (Eigen, in double), then a check
/// that every mean is finite, then the means multiplied by the scale; each pass over [0, P) split
/// into one contiguous chunk per thread.
class separate_passes final : public runner {
 public:
  separate_passes(std::span<const float* const> towers, std::size_t elements, float* mean, int threads, double scale)
      : average_(towers, elements, mean, nullptr, threads, {}),
        pool_(threads),
        mean_(mean),
        elements_(elements),
        scale_(static_cast<float>(scale)),
        partial_norm_(pool_.threads()),
        partial_finite_(pool_.threads()) {}

  void run() override {
    using vec = Eigen::Map<Eigen::VectorXf>;
    average_.run();
    pool_.for_chunks(elements_, [this](std::size_t c, std::size_t b, std::size_t e) {
      partial_norm_[c] = vec(mean_ + b, static_cast<Eigen::Index>(e - b)).cast<double>().squaredNorm();
    });
    pool_.for_chunks(elements_, [this](std::size_t c, std::size_t b, std::size_t e) {
      partial_finite_[c] = vec(mean_ + b, static_cast<Eigen::Index>(e - b)).allFinite() ? 1 : 0;
    });
    pool_.for_chunks(elements_, [this](std::size_t, std::size_t b, std::size_t e) {
      vec(mean_ + b, static_cast<Eigen::Index>(e - b)) *= scale_;
    });
    double norm_squared = 0;
    for (double p : partial_norm_) norm_squared += p;
    sum_mean_squared_ = norm_squared * static_cast<double>(scale_) * static_cast<double>(scale_);
    finite_ = std::all_of(partial_finite_.begin(), partial_finite_.end(), [](char f) { return f != 0; });
  }

  /// The last call's squared norm of the scaled means, and whether every mean was finite.
  [[nodiscard]] double sum_mean_squared() const noexcept { return sum_mean_squared_; }
  [[nodiscard]] bool finite() const noexcept { return finite_; }

 private:
  gradavg_fused<float, float> average_;
  chunk_pool pool_;
  float* mean_;
  std::size_t elements_;
  float scale_;
  std::vector<double> partial_norm_;
  std::vector<char> partial_finite_;
  double sum_mean_squared_ = 0;
  bool finite_ = false;
};

/// Adds a gradavg contender: runs it once into poisoned outputs and checks its means, squares
/// and (with options.compute.statistics) fused sums. Returns an error.
template <class S, class O>
std::string add_gradavg(comparison& cmp, const std::string& name, std::span<const S* const> towers,
                        std::size_t elements, int threads, O* mean, O* sq, const gradavg::options& features,
                        double bytes) {
  auto r = std::make_unique<gradavg_fused<S, O>>(towers, elements, mean, sq, threads, features);
  poison(std::span<O>(mean, elements));
  if (sq != nullptr) poison(std::span<O>(sq, elements));
  r->run();
  reference_sums sums;
  std::string error = check_outputs<S, O>(towers, elements, mean, sq, features.compute.weights, features.compute.scale, sums);
  const gradavg::summary& got = r->last();
  if (error.empty() && features.compute.statistics) {
    error = check_sum("sum_mean_squared", got.sum_mean_squared, sums.mean_squared);
    if (error.empty()) error = check_sum("sum_mean_of_squares", got.sum_mean_of_squares, sums.mean_of_squares);
  }
  if (error.empty() && features.compute.on_nonfinite != gradavg::nonfinite_policy::ignore && got.nonfinite())
    error = "non-finite reported on finite inputs";
  if (!error.empty()) return name + ": " + error;
  cmp.contenders.emplace_back(name, std::move(r), bytes);
  return {};
}

/// Reports <op>.best_nt and <op>.of.<copy> for the faster of <op> and <op>_nt; returns it.
const contender& report_best(benchmark::State& state, const comparison& cmp, const std::string& op) {
  const contender& plain = *cmp.find(op);
  const contender& nt = *cmp.find(op + "_nt");
  const contender& best = median(nt.times) < median(plain.times) ? nt : plain;
  state.counters[op + ".best_nt"] = &best == &nt ? 1 : 0;
  for (const char* copy : {"copy", "copy_nt"})
    state.counters[op + ".of." + copy] = bandwidth_ratio(best, *cmp.find(copy));
  return best;
}

/// Reports read.of.copy_nt (the mean's bandwidth if its write were free, against the copy) and
/// mean.over.read for the faster mean.
void report_read(benchmark::State& state, const comparison& cmp, const contender& best_mean) {
  const contender& read = *cmp.find("read");
  state.counters["read.of.copy_nt"] = bandwidth_ratio(read, *cmp.find("copy_nt"));
  state.counters["mean.over.read"] = time_ratio(best_mean, read);
}

// ---- Float points: each fused feature against the plain mean. ------------------------------

void fused_float_point(benchmark::State& state, std::size_t tower_count, std::size_t elements, int threads) {
  comparison cmp;
  std::string error;
  try {
    const auto& towers = cmp.hold<std::vector<const float*>>(towers_cache().get<float>(tower_count, elements));
    const std::span<const float* const> tw(towers);
    const auto& weights = cmp.hold<std::vector<double>>(uneven_weights(tower_count));
    float* mean = cmp.hold<aligned_buffer<float>>(elements).data();
    float* sq = cmp.hold<aligned_buffer<float>>(elements).data();
    const double mean_bytes = credited_bytes<float>(op::mean, tower_count, elements);
    const double sq_bytes = credited_bytes<float>(op::mean_sq, tower_count, elements);

    struct variant {
      const char* name;
      bool squares;
      bool streaming;
      bool weighted;
      bool scaled;
      bool report;
      bool statistics;
    };
    const variant variants[] = {
        {"mean", false, false, false, false, false, false},  {"mean_nt", false, true, false, false, false, false},
        {"mean_sq", true, false, false, false, false, false}, {"mean_sq_nt", true, true, false, false, false, false},
        {"weights", false, false, true, false, false, false}, {"scale", false, false, false, true, false, false},
        {"report", false, false, false, false, true, false},  {"stats", false, false, false, false, false, true},
        {"stats_sq", true, false, false, false, false, true}, {"all", false, false, true, true, true, true},
        {"all_sq", true, false, true, true, true, true},      {"all_nt", false, true, true, true, true, true},
        {"all_sq_nt", true, true, true, true, true, true},
    };
    error = add_copies<float>(cmp, towers[0], elements, threads);
    if (error.empty()) error = add_read<float>(cmp, tw, elements, threads, mean_bytes);
    for (const variant& v : variants) {
      if (!error.empty()) break;
      gradavg::options o;
      o.run.stores = v.streaming ? gradavg::store_policy::streaming : gradavg::store_policy::regular;
      if (v.weighted) o.compute.weights = weights;
      if (v.scaled) o.compute.scale = loss_unscale;
      if (v.report) o.compute.on_nonfinite = gradavg::nonfinite_policy::report;
      o.compute.statistics = v.statistics;
      error = add_gradavg<float, float>(cmp, v.name, tw, elements, threads, mean, v.squares ? sq : nullptr, o,
                                        v.squares ? sq_bytes : mean_bytes);
    }
    if (error.empty()) {
      auto r = std::make_unique<separate_passes>(tw, elements, mean, threads, loss_unscale);
      poison(std::span<float>(mean, elements));
      r->run();
      reference_sums sums;
      error = check_outputs<float, float>(tw, elements, mean, nullptr, {}, loss_unscale, sums);
      if (error.empty()) error = check_sum("squared norm", r->sum_mean_squared(), sums.mean_squared);
      if (error.empty() && !r->finite()) error = "non-finite found in finite means";
      if (error.empty())
        cmp.contenders.emplace_back("separate", std::move(r), mean_bytes);
      else
        error = "separate: " + error;
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (skip_on_error(state, error)) return;
  run_rounds(state, cmp);
  report_read(state, cmp, report_best(state, cmp, "mean"));
  report_best(state, cmp, "mean_sq");
  const contender& mean = *cmp.find("mean");
  const contender& mean_sq = *cmp.find("mean_sq");
  for (const char* f : {"weights", "scale", "report", "stats", "all", "separate"})
    state.counters[std::string(f) + ".over.mean"] = time_ratio(*cmp.find(f), mean);
  for (const char* f : {"stats_sq", "all_sq"})
    state.counters[std::string(f) + ".over.mean_sq"] = time_ratio(*cmp.find(f), mean_sq);
  state.counters["separate.over.all"] = time_ratio(*cmp.find("separate"), *cmp.find("all"));
  state.counters["all_nt.over.mean_nt"] = time_ratio(*cmp.find("all_nt"), *cmp.find("mean_nt"));
  state.counters["all_sq_nt.over.mean_sq_nt"] = time_ratio(*cmp.find("all_sq_nt"), *cmp.find("mean_sq_nt"));
}

// ---- 16-bit points: bandwidth against a copy of the same bytes, and oneDNN. -----------------

template <class S>
void fused16_point(benchmark::State& state, std::size_t tower_count, std::size_t elements, int threads) {
  comparison cmp;
  std::string error;
  bool onednn_ran = false;
  try {
    const auto& towers = cmp.hold<std::vector<const S*>>(towers_cache().get<S>(tower_count, elements));
    const std::span<const S* const> tw(towers);
    // The copies move tower 0's bytes as floats: a copy of 16-bit data is a copy of its bytes.
    float* bytes = cmp.hold<aligned_buffer<float>>(elements / 2).data();
    std::memcpy(static_cast<void*>(bytes), static_cast<const void*>(towers[0]), elements * sizeof(S));
    error = add_copies<float>(cmp, bytes, elements / 2, threads);
    const double n = static_cast<double>(elements), t = static_cast<double>(tower_count);
    if (error.empty()) error = add_read<S>(cmp, tw, elements, threads, (t + 1) * n * 2);

    S* mean = cmp.hold<aligned_buffer<S>>(elements).data();
    S* sq = cmp.hold<aligned_buffer<S>>(elements).data();
    float* mean_f32 = cmp.hold<aligned_buffer<float>>(elements).data();
    gradavg::options nt;
    nt.run.stores = gradavg::store_policy::streaming;
    if (error.empty()) error = add_gradavg<S, S>(cmp, "mean", tw, elements, threads, mean, nullptr, {}, (t + 1) * n * 2);
    if (error.empty()) error = add_gradavg<S, S>(cmp, "mean_nt", tw, elements, threads, mean, nullptr, nt, (t + 1) * n * 2);
    if (error.empty()) error = add_gradavg<S, S>(cmp, "mean_sq", tw, elements, threads, mean, sq, {}, (t + 2) * n * 2);
    if (error.empty()) error = add_gradavg<S, S>(cmp, "mean_sq_nt", tw, elements, threads, mean, sq, nt, (t + 2) * n * 2);
    if (error.empty())
      error = add_gradavg<S, float>(cmp, "mean_f32", tw, elements, threads, mean_f32, nullptr, {}, t * n * 2 + n * 4);
#ifdef GRADAVG_BENCH_HAVE_ONEDNN
    if constexpr (std::is_same_v<S, bf16>) {
      const std::string impl = onednn_bf16_sum_implementation(tower_count, elements);
      state.SetLabel("onednn_sum " + (impl.empty() ? std::string("unsupported") : impl));
      if (error.empty() && !impl.empty()) {
        const problem<S> p{tw, elements, mean, nullptr, threads};
        auto r = make_onednn_sum_bf16(p);
        poison(std::span<S>(mean, elements));
        r->run();
        reference_sums sums;
        error = check_outputs<S, S>(tw, elements, mean, nullptr, {}, 1.0, sums);
        if (error.empty())
          cmp.contenders.emplace_back("onednn_sum", std::move(r), (t + 1) * n * 2);
        else
          error = "onednn_sum: " + error;
        onednn_ran = true;
      }
    }
#endif
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (skip_on_error(state, error)) return;
  run_rounds(state, cmp);
  const contender& best_mean = report_best(state, cmp, "mean");
  report_read(state, cmp, best_mean);
  report_best(state, cmp, "mean_sq");
  state.counters["mean_f32.of.copy_nt"] = bandwidth_ratio(*cmp.find("mean_f32"), *cmp.find("copy_nt"));
  if constexpr (std::is_same_v<S, bf16>) {
    state.counters["onednn_bf16_sum"] = onednn_ran ? 1 : 0;
    if (const contender* c = cmp.find("onednn_sum")) {
      state.counters["mean.vs.onednn_sum"] = time_ratio(*c, best_mean);
      state.counters["read.vs.onednn_sum"] = time_ratio(*c, *cmp.find("read"));
    }
  }
}

// ---- Registration. --------------------------------------------------------------------------

void register_point(const std::string& name, std::size_t rounds, void (*point)(benchmark::State&, std::size_t,
                                                                                 std::size_t, int),
                    std::size_t towers, std::size_t elements, int threads) {
  benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& s) { point(s, towers, elements, threads); })
      ->Iterations(static_cast<benchmark::IterationCount>(rounds))
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

std::string point_name(const char* family, const char* type, std::size_t towers, std::size_t elements,
                       int threads) {
  return std::string(family) + "/" + type + "/T:" + std::to_string(towers) + "/P:" + std::to_string(elements) +
         "/threads:" + std::to_string(threads);
}

template <class S>
void register_16bit(std::size_t elements, const std::vector<int>& thread_counts, std::size_t rounds) {
  // (threads, T) within one type: the towers of a type are generated once.
  for (int n : thread_counts)
    for (std::size_t towers : {2, 4, 8, 16})
      register_point(point_name("fused16", element_name<S>(), towers, elements, n), rounds, &fused16_point<S>,
                     towers, elements, n);
}

#define GRADAVG_BENCH_STRINGIZE_(x) #x
#define GRADAVG_BENCH_STRINGIZE(x) GRADAVG_BENCH_STRINGIZE_(x)

}  // namespace
}  // namespace gradavg_bench

int main(int argc, char** argv) {
  using namespace gradavg_bench;
  const std::size_t rounds = take_count_flag(argc, argv, "--fused_rounds=", 11);
  const std::size_t elements = take_count_flag(argc, argv, "--fused_elements=", std::size_t{1} << 24);
  if (elements % chunk_granularity != 0) {
    std::fprintf(stderr, "--fused_elements=%zu: must be a positive multiple of %zu\n", elements, chunk_granularity);
    return 1;
  }
  const std::vector<int> threads = thread_counts();  // 1 and all cores
  for (int n : threads)
    for (std::size_t towers : {8, 16})
      register_point(point_name("fused", "float", towers, elements, n), rounds, &fused_float_point, towers, elements,
                     n);
  register_16bit<bf16>(elements, threads, rounds);
  register_16bit<half>(elements, threads, rounds);

  benchmark::AddCustomContext("fused_rounds", std::to_string(rounds));
  benchmark::AddCustomContext("fused_elements", std::to_string(elements));
  benchmark::AddCustomContext("copy_nt_store", limits::streaming_store_name<float>());
  benchmark::AddCustomContext("gradavg_isa", GRADAVG_BENCH_STRINGIZE(GRADAVG_ISA_NAMESPACE));
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  benchmark::AddCustomContext("OMP_WAIT_POLICY", wait_policy != nullptr ? wait_policy : "unset");
#ifdef GRADAVG_BENCH_HAVE_ONEDNN
  // oneDNN picks its implementation by the number of sources, so each T is named.
  std::string impls;
  for (std::size_t towers : {2, 4, 8, 16}) {
    const std::string impl = onednn_bf16_sum_implementation(towers, elements);
    impls += (impls.empty() ? "T=" : ", T=") + std::to_string(towers) + ": " + (impl.empty() ? "unsupported" : impl);
  }
  benchmark::AddCustomContext("onednn_bf16_sum", impls);
#else
  benchmark::AddCustomContext("onednn_bf16_sum", "oneDNN not found at configure time");
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
