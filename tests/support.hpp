// Test helpers shared by the test files: exceptions and their messages, and buffers with
// guarded surroundings for checking that nothing is written out of bounds.
#pragma once

#include <cstddef>
#include <exception>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "catch.hpp"

namespace gradavg_test {

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

/// Runs f, requires it to throw E, and returns the message.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("threw the wrong exception type: " << e.what());
  }
  FAIL("did not throw");
  return {};
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

}  // namespace gradavg_test
