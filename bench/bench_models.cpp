// Model-shaped benchmark: mean + mean of squares over the parameter lists of ResNet-50 (161
// tensors) and BERT-base (199 tensors), float, T = 4 and 8, threads 1 and all cores, against the
// same number of values as one flat buffer, so that per-variable overhead shows. The data layout
// is model_data.hpp's: both layouts read the same amount of memory and credit the same bytes,
// (T+2) * total * sizeof(float). bench_paired measures the same pairs by alternation.
//
// Names: model/<model>/float/<impl>/T:<T>/threads:<n>, impl in {gradavg_vars, gradavg_flat,
// gradavg_nt_vars, gradavg_nt_flat, eigen_vars, eigen_flat}, plus the copy limits
// model/<model>/float/{copy,copy_nt}/P:<total>/threads:<n> (2*total*4 bytes).
// Runs that would need more than GRADAVG_BENCH_MAX_GIB (environment, default 8) are skipped.
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.hpp"
#include "harness.hpp"
#include "limits.hpp"
#include "model_data.hpp"
#include "model_shapes.hpp"
#include "parallel.hpp"
#include "peers.hpp"

namespace gradavg_bench {
namespace {

using S = model_value;

/// Builds one model benchmark: over the variables with make_vars or, when it is null, over one
/// flat buffer with make_flat; runs it once and checks every output value.
void build_model(prepared& p, const model_shapes& m, std::size_t towers, int threads, vars_factory<S> make_vars,
                 peer_factory<S> make_flat) {
  model_data& d = get_model(m, towers);
  const auto& ptrs = p.hold<std::vector<const S*>>(d.tower_ptrs(towers));
  checked_runner c = checked_model_runner(m, d, ptrs, threads, make_vars, make_flat);
  p.kernel = std::move(c.kernel);
  p.error = std::move(c.error);
  p.sink = c.sink;
}

void register_model(const model_shapes& m, const std::vector<std::size_t>& tower_counts,
                    const std::vector<int>& thread_counts) {
  std::size_t total = 0;
  for (const param_shape& s : m.params) total += s.size();
  const std::string prefix = "model/" + m.name + "/float/";

  struct impl {
    const char* name;
    vars_factory<S> vars;  ///< null: the flat layout, with flat
    peer_factory<S> flat;
  };
  const std::vector<impl> impls{
#ifndef GRADAVG_BENCH_NO_GRADAVG
      {"gradavg_vars", &make_gradavg_vars<S>, nullptr},
      {"gradavg_flat", nullptr, &make_gradavg<S>},
      {"gradavg_nt_vars", &make_gradavg_nt_vars<S>, nullptr},
      {"gradavg_nt_flat", nullptr, &make_gradavg_nt<S>},
#endif
      {"eigen_vars", &make_eigen_per_tower_vars<S>, nullptr},
      {"eigen_flat", nullptr, &make_eigen_per_tower<S>},
  };

  for (int threads : thread_counts) {
    // The copy limits over the flat total, split into one contiguous chunk per thread.
    const limits::named_copy<S> copies[] = {{"copy", &limits::copy<S>}, {"copy_nt", &limits::copy_nt<S>}};
    const std::string suffix = "/P:" + std::to_string(total) + "/threads:" + std::to_string(threads);
    for (const limits::named_copy<S>& k : copies) {
      register_prepared(prefix + k.name + suffix, 2.0 * static_cast<double>(total) * sizeof(S),
                        [m, total, threads, k](prepared& p) {
                          model_data& d = get_model(m, 1);
                          const S* src = d.towers[0].data();
                          S* dst = d.mean.data();
                          p.sink = dst;
                          p.kernel = make_copy_runner(k, dst, src, total, p.hold<chunk_pool>(threads));
                          p.error = run_and_check_copy(*p.kernel, k.name, dst, src, total);
                        });
    }
    for (std::size_t towers : tower_counts) {
      const double bytes = credited_bytes<S>(op::mean_sq, towers, total);
      for (const impl& i : impls)
        register_prepared(prefix + i.name + "/T:" + std::to_string(towers) + "/threads:" +
                              std::to_string(threads),
                          bytes, [m, towers, threads, i](prepared& p) {
                            build_model(p, m, towers, threads, i.vars, i.flat);
                          });
    }
  }
}

}  // namespace
}  // namespace gradavg_bench

int main(int argc, char** argv) {
  using namespace gradavg_bench;
  const model_shapes models[] = {resnet50_shapes(), bert_base_shapes()};
  const std::vector<int> threads = thread_counts();  // 1 and all cores
  for (const model_shapes& m : models) {
    check_counts(m);
    register_model(m, {4, 8}, threads);
    std::size_t total = 0;
    for (const param_shape& s : m.params) total += s.size();
    benchmark::AddCustomContext(m.name, std::to_string(m.params.size()) + " tensors, " +
                                            std::to_string(total) + " params");
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
