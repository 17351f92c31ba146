// Test helpers for the c10d tests, started by support/launch_ranks.sh: the process group made
// from the launcher's variables (a FileStore at GRADAVG_TEST_STORE, or MASTER_ADDR and
// MASTER_PORT), and this process's place in it.
#pragma once

#include <gradavg/c10d.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace gradavg_test {

/// A group of RANK and WORLD_SIZE: over the FileStore GRADAVG_TEST_STORE + suffix where the
/// launcher gave one, else the torchrun way (a TCPStore at MASTER_ADDR:MASTER_PORT).
inline c10::intrusive_ptr<::c10d::ProcessGroup> environment_group(const std::string& suffix,
                                                                   std::chrono::milliseconds timeout) {
  if (const char* path = std::getenv("GRADAVG_TEST_STORE"))
    return gradavg::c10d::process_group_over_file(path + suffix, std::atoi(std::getenv("RANK")),
                                                  std::atoi(std::getenv("WORLD_SIZE")), timeout);
  return gradavg::c10d::process_group_from_environment(timeout);
}

/// The group every case of a test program shares, made at its first use.
inline ::c10d::ProcessGroup& world() {
  static const auto shared = environment_group("", std::chrono::seconds(60));
  return *shared;
}

inline int world_rank() { return world().getRank(); }
inline int world_size() { return world().getSize(); }

/// Whether every rank of the group holds the same value (a collective: every rank calls it).
inline bool same_on_every_rank(std::uint64_t value) {
  std::uint64_t words[2] = {value, ~value};  // the largest value, and the complement of the smallest
  gradavg::c10d::detail::reduce_words(world(), words, 2, ::c10d::ReduceOp::MAX);
  return words[0] == ~words[1];
}

}  // namespace gradavg_test
