// Test helpers shared by the test files: exceptions and their messages, buffers with guarded
// surroundings for checking that nothing is written out of bounds, and checks of results
// against the reference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference.hpp"

namespace gradavg_test {

/// FNV-1a of n bytes at data, continuing from h (start from fnv_offset): the tests' fingerprint
/// of outputs, compared across ranks and before and after a call.
inline constexpr std::uint64_t fnv_offset = 1469598103934665603ull;
inline std::uint64_t fnv1a(const void* data, std::size_t n, std::uint64_t h = fnv_offset) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

/// fnv1a of every vector's elements in turn.
template <class S>
std::uint64_t hash_of(const std::vector<std::vector<S>>& outputs) {
  std::uint64_t h = fnv_offset;
  for (const auto& v : outputs) h = fnv1a(v.data(), v.size() * sizeof(S), h);
  return h;
}

/// Whether n values at a and b are the same bit for bit (memcmp, which may not take null).
template <class S>
bool same_bits(const S* a, const S* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(S)) == 0;
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

/// Runs f, requires it to throw E, and returns a copy of the exception.
template <class E, class F>
E exception_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e;
  } catch (const std::exception& e) {
    FAIL("threw the wrong exception type: " << e.what());
  }
  FAIL("did not throw");
  throw std::logic_error("unreachable: FAIL throws");
}

/// Runs f, requires it to throw E, and returns the message.
template <class E, class F>
std::string message_of(F&& f) {
  return exception_of<E>(std::forward<F>(f)).what();
}

/// Storage for n elements that start `offset` elements past a 64-byte boundary. Everything
/// around them (before, and 2 * 64 bytes after) holds `fill`, so stray writes show up.
template <class S>
class buffer {
 public:
  static constexpr std::size_t align_elements = 64 / sizeof(S);

  buffer(std::size_t n, std::size_t offset, S fill)
      : n_(n), fill_(fill), storage_(align_elements + offset + n + 2 * align_elements, fill) {
    void* p = storage_.data();
    std::size_t space = storage_.size() * sizeof(S);
    S* base = static_cast<S*>(std::align(64, sizeof(S), p, space));
    REQUIRE(base != nullptr);
    data_ = base + offset;
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  buffer(buffer&&) noexcept = default;  // the heap block, and so data_, stays where it is
  buffer& operator=(buffer&&) noexcept = default;

  [[nodiscard]] S* data() { return data_; }
  [[nodiscard]] const S* data() const { return data_; }
  [[nodiscard]] std::size_t size() const { return n_; }
  [[nodiscard]] std::vector<S> snapshot() const { return storage_; }
  [[nodiscard]] bool same_as(const std::vector<S>& before) const { return storage_ == before; }

  /// Whether every element outside [data(), data() + size()) still holds the fill value.
  [[nodiscard]] bool surroundings_intact() const {
    for (std::size_t j = 0; j < storage_.size(); ++j) {
      const S* p = storage_.data() + j;
      if ((p < data_ || p >= data_ + n_) && storage_[j] != fill_) return false;
    }
    return true;
  }

 private:
  std::size_t n_;
  S fill_;
  std::vector<S> storage_;
  S* data_ = nullptr;
};

/// What one variable's outputs must be: the reference and the magnitudes errors are relative to.
template <class S>
struct expectation {
  gradavg_test::reference<S> ref;
  std::vector<double> mean_scale;
  std::vector<double> square_scale;

  expectation(const std::vector<const S*>& towers, std::size_t n)
      : ref(towers, n),
        mean_scale(gradavg_test::magnitude<S>(towers, n, false)),
        square_scale(gradavg_test::magnitude<S>(towers, n, true)) {}
};

/// Requires got[0..n) to match the reference of a variable (its means, or its mean squares).
template <class S>
void require_matches(const S* got, const expectation<S>& e, std::size_t towers, bool squares, const std::string& what) {
  const std::vector<double>& want = squares ? e.ref.square : e.ref.mean;
  const std::size_t n = want.size();
  const std::size_t bad =
      gradavg_test::first_mismatch<S>(got, want, squares ? e.square_scale : e.mean_scale, towers);
  INFO(what << (squares ? ": mean of squares" : ": mean") << ", first mismatch at element " << bad << " of " << n
            << (bad < n ? ": got " + std::to_string(got[bad]) + ", want " + std::to_string(want[bad]) : std::string()));
  REQUIRE(bad == n);
}

template <class S>
constexpr S sentinel = S(-1234.5);

/// n consecutive values of a fixed pool of random values in [-1, 1] (reference.hpp's
/// random_values), starting at a position drawn from seed: cheaper than seeding a generator for
/// every tower of every variable, and just as good for these tests.
template <class S>
const S* random_slice(std::size_t n, std::uint32_t seed) {
  static const std::vector<S> pool = gradavg_test::random_values<S>(std::size_t{1} << 16, 20240229u);
  REQUIRE(n <= pool.size());
  const std::uint64_t h = (std::uint64_t{seed} + 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
  return pool.data() + (h >> 32) % (pool.size() - n + 1);
}

/// The type gradavg sums gradients of element type S in, by default: double for double, float
/// for the others.
template <class S>
using accumulator_of = std::conditional_t<std::is_same_v<S, double>, double, float>;

/// x * x rounded to A before it is added (the kernel never fuses a multiply with an add; built
/// with -march=native, the compiler may contract x * x + s into one).
template <class A>
A rounded_square(A x) {
  volatile A p = x * x;
  return p;
}

}  // namespace gradavg_test
