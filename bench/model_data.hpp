// Model-shaped data for the benchmark binaries: one model's towers and outputs at a time.
//
// Each tower is one 64-byte aligned buffer; variable v is a slice of it starting at a 64-byte
// boundary (padding between slices is never read). A "flat" run averages the first total
// values of the same buffers: as many values as the variables hold, in one piece.
//
// Memory: a model's towers and outputs take (T+2) * padded * 4 bytes (BERT-base at T=8:
// 4.4 GB). get_model throws for more than GRADAVG_BENCH_MAX_GIB (environment, default 8).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.hpp"
#include "model_shapes.hpp"

namespace gradavg_bench {

/// The element type of the model benchmarks.
using model_value = float;

inline double memory_limit_bytes() {
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
  std::vector<aligned_buffer<model_value>> towers;
  aligned_buffer<model_value> mean, sq;

  /// Pointers to the first `count` towers.
  [[nodiscard]] std::vector<const model_value*> tower_ptrs(std::size_t count) const {
    std::vector<const model_value*> out;
    for (std::size_t t = 0; t < count; ++t) out.push_back(towers[t].data());
    return out;
  }
};

/// The data of model m with at least `towers` towers. Tower t holds the same values whatever T
/// asks for it; pointers stay valid until a call for another model.
inline model_data& get_model(const model_shapes& m, std::size_t towers) {
  static std::unique_ptr<model_data> cache;
  constexpr std::size_t pad = aligned_buffer<model_value>::alignment / sizeof(model_value);
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
  const double need = static_cast<double>(towers + 2) * static_cast<double>(d.padded) * sizeof(model_value);
  if (need > memory_limit_bytes())
    throw std::runtime_error("needs " + std::to_string(need / (1 << 30)) +
                             " GiB > GRADAVG_BENCH_MAX_GIB");
  if (d.mean.size() == 0) {
    d.mean = aligned_buffer<model_value>(d.padded);
    d.sq = aligned_buffer<model_value>(d.padded);
  }
  while (d.towers.size() < towers) {
    d.towers.emplace_back(d.padded);
    fill_uniform(d.towers.back().span(), static_cast<std::uint32_t>(2000 + d.towers.size()));
  }
  return d;
}

/// A var_problem over d's variables of the given towers, writing d.mean and d.sq.
inline var_problem<model_value> vars_problem(model_data& d, std::span<const model_value* const> towers,
                                             int threads) {
  var_problem<model_value> vp;
  vp.towers = towers;
  vp.offsets = d.offsets;
  vp.sizes = d.sizes;
  vp.mean = d.mean.data();
  vp.sq = d.sq.data();
  vp.threads = threads;
  return vp;
}

/// A problem over the first d.total values of the given towers, writing d.mean and d.sq.
inline problem<model_value> flat_problem(model_data& d, std::span<const model_value* const> towers, int threads) {
  problem<model_value> fp;
  fp.towers = towers;
  fp.elements = d.total;
  fp.mean = d.mean.data();
  fp.sq = d.sq.data();
  fp.threads = threads;
  return fp;
}

/// Checks d.mean and d.sq variable by variable against the double reference; empty on success,
/// else the first mismatch, named by its variable.
inline std::string check_vars(const model_shapes& m, const model_data& d, std::span<const model_value* const> towers) {
  for (std::size_t v = 0; v < d.offsets.size(); ++v) {
    const std::size_t off = d.offsets[v];
    std::string error = check_against_reference<model_value>(towers, off, d.sizes[v], d.mean.data() + off,
                                                             d.sq.data() + off);
    if (!error.empty()) return m.params[v].name + ": " + error;
  }
  return {};
}

/// A runner over d's variables (make_vars) or, when make_vars is null, over one flat buffer of
/// the same total (make_flat), writing d.mean and d.sq. One untimed call into poisoned outputs
/// checks every value against the double reference (a mismatch is named by its variable).
inline checked_runner checked_model_runner(const model_shapes& m, model_data& d,
                                           std::span<const model_value* const> towers, int threads,
                                           vars_factory<model_value> make_vars,
                                           peer_factory<model_value> make_flat) {
  poison(d.mean.span());
  poison(d.sq.span());
  checked_runner c{make_vars ? make_vars(vars_problem(d, towers, threads)) : make_flat(flat_problem(d, towers, threads)),
                   {}, d.mean.data()};
  c.kernel->run();
  c.error = make_vars ? check_vars(m, d, towers)
                      : check_against_reference<model_value>(towers, 0, d.total, d.mean.data(), d.sq.data());
  return c;
}

/// Aborts on a shape list that does not add up to the published counts.
inline void check_counts(const model_shapes& m) {
  std::size_t total = 0;
  for (const param_shape& s : m.params) total += s.size();
  if (m.params.size() != m.expected_tensors || total != m.expected_params) {
    std::fprintf(stderr, "%s: %zu tensors, %zu params; expected %zu, %zu\n", m.name.c_str(),
                 m.params.size(), total, m.expected_tensors, m.expected_params);
    std::abort();
  }
}

}  // namespace gradavg_bench
