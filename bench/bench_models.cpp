// Model-shaped benchmark: mean + mean of squares over the parameter lists of ResNet-50 (161
// tensors) and BERT-base (199 tensors), float, T = 4 and 8, threads 1 and all cores, against the
// same number of values as one flat buffer, so that per-variable overhead shows.
//
// Each tower is one 64-byte aligned buffer; variable v is a slice of it starting at a 64-byte
// boundary (padding between slices is never read). The "flat" runs average the first
// total-params values of the same buffers, so both read the same amount of memory and credit
// the same bytes: (T+2) * total * sizeof(float).
//
// Names: model/<model>/float/<impl>/T:<T>/threads:<n>, impl in {gradavg_vars, gradavg_flat,
// gradavg_nt_vars, gradavg_nt_flat, eigen_vars, eigen_flat}, plus the copy limits
// model/<model>/float/{copy,copy_nt}/P:<total>/threads:<n> (2*total*4 bytes).
//
// Memory: a model's towers and outputs take (T+2) * total * 4 bytes (BERT-base at T=8: 4.4 GB).
// Runs that would need more than GRADAVG_BENCH_MAX_GIB (environment, default 8) are skipped.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.hpp"
#include "harness.hpp"
#include "limits.hpp"
#include "model_shapes.hpp"
#include "parallel.hpp"
#include "peers.hpp"

namespace gradavg_bench {
namespace {

using S = float;
constexpr std::size_t pad = aligned_buffer<S>::alignment / sizeof(S);

double memory_limit_bytes() {
  double gib = 8;
  if (const char* env = std::getenv("GRADAVG_BENCH_MAX_GIB")) gib = std::atof(env);
  return gib * 1024 * 1024 * 1024;
}

/// One model's towers and outputs; kept while consecutive benchmarks use the same model.
struct model_data {
  std::string model;
  std::vector<std::size_t> offsets, sizes;
  std::size_t total = 0;   ///< parameters
  std::size_t padded = 0;  ///< elements per tower buffer, slices padded to 64 bytes
  std::vector<aligned_buffer<S>> towers;
  aligned_buffer<S> mean, sq;
};

/// The data of model m with at least `towers` towers. Tower t holds the same values whatever T
/// asks for it; pointers stay valid until a call for another model.
model_data& get_model(const model_shapes& m, std::size_t towers) {
  static std::unique_ptr<model_data> cache;
  if (!cache || cache->model != m.name) {
    cache.reset();  // free the previous model first
    auto d = std::make_unique<model_data>();
    d->model = m.name;
    for (const param_shape& s : m.params) {
      d->offsets.push_back(d->padded);
      d->sizes.push_back(s.size());
      d->total += s.size();
      d->padded += (s.size() + pad - 1) / pad * pad;
    }
    cache = std::move(d);
  }
  model_data& d = *cache;
  const double need = static_cast<double>(towers + 2) * static_cast<double>(d.padded) * sizeof(S);
  if (need > memory_limit_bytes())
    throw std::runtime_error("needs " + std::to_string(need / (1 << 30)) +
                             " GiB > GRADAVG_BENCH_MAX_GIB");
  if (d.mean.size() == 0) {
    d.mean = aligned_buffer<S>(d.padded);
    d.sq = aligned_buffer<S>(d.padded);
  }
  while (d.towers.size() < towers) {
    d.towers.emplace_back(d.padded);
    fill_uniform(d.towers.back().span(), static_cast<std::uint32_t>(2000 + d.towers.size()));
  }
  return d;
}

std::vector<const S*> tower_ptrs(const model_data& d, std::size_t towers) {
  std::vector<const S*> out;
  for (std::size_t t = 0; t < towers; ++t) out.push_back(d.towers[t].data());
  return out;
}

enum class layout { vars, flat };

using var_factory = std::unique_ptr<runner> (*)(const var_problem<S>&);
using flat_factory = std::unique_ptr<runner> (*)(const problem<S>&);

/// Builds one model benchmark: per-variable with make_vars, or flat with make_flat; runs it
/// once and checks every output value against the double reference.
void build_model(prepared& p, const model_shapes& m, std::size_t towers, int threads, layout l,
                 var_factory make_vars, flat_factory make_flat) {
  model_data& d = get_model(m, towers);
  const auto& ptrs = p.hold<std::vector<const S*>>(tower_ptrs(d, towers));
  p.sink = d.mean.data();
  poison(d.mean.span());
  poison(d.sq.span());
  if (l == layout::vars) {
    var_problem<S> vp;
    vp.towers = ptrs;
    vp.offsets = d.offsets;
    vp.sizes = d.sizes;
    vp.mean = d.mean.data();
    vp.sq = d.sq.data();
    vp.threads = threads;
    p.kernel = make_vars(vp);
    p.kernel->run();
    for (std::size_t v = 0; v < d.offsets.size() && p.error.empty(); ++v) {
      const std::size_t off = d.offsets[v];
      p.error = check_against_reference<S>(ptrs, off, d.sizes[v], d.mean.data() + off,
                                           d.sq.data() + off);
      if (!p.error.empty()) p.error = m.params[v].name + ": " + p.error;
    }
  } else {
    problem<S> fp;
    fp.towers = ptrs;
    fp.elements = d.total;
    fp.mean = d.mean.data();
    fp.sq = d.sq.data();
    fp.threads = threads;
    p.kernel = make_flat(fp);
    p.kernel->run();
    p.error = check_against_reference<S>(ptrs, 0, d.total, d.mean.data(), d.sq.data());
  }
}

void register_model(const model_shapes& m, const std::vector<std::size_t>& tower_counts,
                    const std::vector<int>& thread_counts) {
  std::size_t total = 0;
  for (const param_shape& s : m.params) total += s.size();
  const std::string prefix = "model/" + m.name + "/float/";

  struct impl {
    const char* name;
    layout l;
    var_factory vars;
    flat_factory flat;
  };
  const std::vector<impl> impls{
#ifndef GRADAVG_BENCH_NO_GRADAVG
      {"gradavg_vars", layout::vars, &make_gradavg_vars<S>, nullptr},
      {"gradavg_flat", layout::flat, nullptr, &make_gradavg<S>},
      {"gradavg_nt_vars", layout::vars, &make_gradavg_nt_vars<S>, nullptr},
      {"gradavg_nt_flat", layout::flat, nullptr, &make_gradavg_nt<S>},
#endif
      {"eigen_vars", layout::vars, &make_eigen_per_tower_vars<S>, nullptr},
      {"eigen_flat", layout::flat, nullptr, &make_eigen_per_tower<S>},
  };

  for (int threads : thread_counts) {
    // The copy limits over the flat total, split into one contiguous chunk per thread.
    struct copy_kernel {
      const char* name;
      void (*fn)(S*, const S*, std::size_t);
    };
    const copy_kernel copies[] = {{"copy", &limits::copy<S>}, {"copy_nt", &limits::copy_nt<S>}};
    const std::string suffix = "/P:" + std::to_string(total) + "/threads:" + std::to_string(threads);
    for (const copy_kernel& k : copies) {
      register_prepared(prefix + k.name + suffix, 2.0 * static_cast<double>(total) * sizeof(S),
                        [m, total, threads, k](prepared& p) {
                          model_data& d = get_model(m, 1);
                          const S* src = d.towers[0].data();
                          S* dst = d.mean.data();
                          auto& pool = p.hold<chunk_pool>(threads);
                          p.sink = dst;
                          p.kernel = make_fn_runner([src, dst, total, fn = k.fn, &pool] {
                            pool.for_chunks(total, [=](std::size_t, std::size_t b, std::size_t e) {
                              fn(dst + b, src + b, e - b);
                            });
                          });
                          poison(d.mean.span());  // what an earlier run left there must not pass
                          p.kernel->run();
                          if (std::memcmp(src, dst, total * sizeof(S)) != 0)
                            p.error = std::string(k.name) + " mismatch";
                        });
    }
    for (std::size_t towers : tower_counts) {
      const double bytes = credited_bytes<S>(op::mean_sq, towers, total);
      for (const impl& i : impls)
        register_prepared(prefix + i.name + "/T:" + std::to_string(towers) + "/threads:" +
                              std::to_string(threads),
                          bytes, [m, towers, threads, i](prepared& p) {
                            build_model(p, m, towers, threads, i.l, i.vars, i.flat);
                          });
    }
  }
}

/// Aborts on a shape list that does not add up to the published counts.
void check_counts(const model_shapes& m) {
  std::size_t total = 0;
  for (const param_shape& s : m.params) total += s.size();
  if (m.params.size() != m.expected_tensors || total != m.expected_params) {
    std::fprintf(stderr, "%s: %zu tensors, %zu params; expected %zu, %zu\n", m.name.c_str(),
                 m.params.size(), total, m.expected_tensors, m.expected_params);
    std::abort();
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
