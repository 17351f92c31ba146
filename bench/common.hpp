// Shared pieces of the gradavg benchmarks: aligned buffers, deterministic data, the double
// reference check, and the interface every implementation ("peer") plugs into.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace gradavg_bench {

/// What one benchmark computes: the mean over towers, or the mean and the mean of squares.
enum class op { mean, mean_sq };

inline const char* op_name(op o) { return o == op::mean ? "mean" : "mean_sq"; }

template <class S>
constexpr const char* type_name() {
  return sizeof(S) == 4 ? "float" : "double";
}

/// STREAM-style bytes per call: every input read once and every output written once.
/// Read-for-ownership traffic and any temporaries an implementation adds are not credited.
template <class S>
constexpr double credited_bytes(op o, std::size_t towers, std::size_t elements) {
  const std::size_t streams = towers + (o == op::mean ? 1 : 2);
  return static_cast<double>(streams) * static_cast<double>(elements) * sizeof(S);
}

/// Owning, 64-byte aligned, uninitialised storage for n elements of trivial type S. Move-only.
template <class S>
class aligned_buffer {
 public:
  static constexpr std::size_t alignment = 64;

  aligned_buffer() = default;
  explicit aligned_buffer(std::size_t n) : n_(n) {
    // aligned_alloc wants a size that is a multiple of the alignment.
    const std::size_t bytes = ((n * sizeof(S) + alignment - 1) / alignment) * alignment;
    void* p = std::aligned_alloc(alignment, bytes == 0 ? alignment : bytes);
    if (p == nullptr) throw std::bad_alloc();
    p_.reset(static_cast<S*>(p));
  }

  [[nodiscard]] S* data() noexcept { return p_.get(); }
  [[nodiscard]] const S* data() const noexcept { return p_.get(); }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] std::span<S> span() noexcept { return {p_.get(), n_}; }
  [[nodiscard]] std::span<const S> span() const noexcept { return {p_.get(), n_}; }

 private:
  struct free_deleter {
    void operator()(S* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<S, free_deleter> p_;
  std::size_t n_ = 0;
};

/// Fills `out` with uniform values in [-1, 1] from std::mt19937 seeded with `seed`: the same
/// seed always gives the same values.
template <class S>
void fill_uniform(std::span<S> out, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<S> dist(S(-1), S(1));
  for (S& x : out) x = dist(gen);
}

/// Fills `out` with quiet NaNs, so that an output an implementation forgot to write fails the
/// check.
template <class S>
void poison(std::span<S> out) {
  for (S& x : out) x = std::numeric_limits<S>::quiet_NaN();
}

/// Relative tolerance of the check: float sums of up to 16 terms stay well inside 1e-5.
template <class S>
constexpr double tolerance() {
  return sizeof(S) == 4 ? 1e-5 : 1e-12;
}

/// Checks mean[i] (and sq[i] unless sq is null) for i in [0, n), against a double-precision
/// reference over towers[t][offset + i]. The mean's error is taken relative to the mean of
/// |g| (so cancellation near zero is not punished), the square's relative to itself.
/// Returns an empty string on success, else a description of the first mismatch.
template <class S>
std::string check_against_reference(std::span<const S* const> towers, std::size_t offset,
                                    std::size_t n, const S* mean, const S* sq) {
  const double inv = 1.0 / static_cast<double>(towers.size());
  const double tol = tolerance<S>();
  for (std::size_t i = 0; i < n; ++i) {
    double sum = 0, abs_sum = 0, sq_sum = 0;
    for (const S* g : towers) {
      const double x = static_cast<double>(g[offset + i]);
      sum += x;
      abs_sum += std::abs(x);
      sq_sum += x * x;
    }
    const double m = sum * inv, scale = abs_sum * inv, q = sq_sum * inv;
    const double tiny = std::numeric_limits<S>::min();
    // Written as !(err <= bound) so that NaN fails.
    if (!(std::abs(static_cast<double>(mean[i]) - m) <= tol * scale + tiny))
      return "mean mismatch at " + std::to_string(i) + ": got " +
             std::to_string(static_cast<double>(mean[i])) + ", want " + std::to_string(m);
    if (sq != nullptr && !(std::abs(static_cast<double>(sq[i]) - q) <= tol * q + tiny))
      return "square mismatch at " + std::to_string(i) + ": got " +
             std::to_string(static_cast<double>(sq[i])) + ", want " + std::to_string(q);
  }
  return {};
}

/// One averaging problem as a peer sees it. All pointers stay valid while the runner built from
/// it lives; `towers` holds one pointer per tower to `elements` contiguous, 64-byte aligned
/// values.
template <class S>
struct problem {
  std::span<const S* const> towers;
  std::size_t elements = 0;
  S* mean = nullptr;  ///< receives the mean over towers
  S* sq = nullptr;    ///< receives the mean of squares; null: mean only
  int threads = 1;    ///< threads the peer uses, the calling thread included (1 or all cores)
};

/// A model-shaped problem: variable v of tower t is the `sizes[v]` values at
/// towers[t] + offsets[v]; its mean (and mean of squares) goes to mean + offsets[v]
/// (sq + offsets[v]). Pointers stay valid while the runner built from it lives.
template <class S>
struct var_problem {
  std::span<const S* const> towers;
  std::span<const std::size_t> offsets;
  std::span<const std::size_t> sizes;
  S* mean = nullptr;
  S* sq = nullptr;  ///< null: mean only
  int threads = 1;  ///< as in problem
};

/// A prepared implementation: everything allocated and built at construction, so that run()
/// does only the timed work.
class runner {
 public:
  virtual ~runner() = default;
  /// One timed call: writes the outputs of the problem the runner was built for.
  virtual void run() = 0;
};

template <class S>
using peer_factory = std::unique_ptr<runner> (*)(const problem<S>&);
template <class S>
using vars_factory = std::unique_ptr<runner> (*)(const var_problem<S>&);

/// A runner that has been run once and checked, and what the check found.
struct checked_runner {
  std::unique_ptr<runner> kernel;
  std::string error;           ///< empty: the first call's outputs matched the reference
  const void* sink = nullptr;  ///< an output, for DoNotOptimize
};

}  // namespace gradavg_bench
