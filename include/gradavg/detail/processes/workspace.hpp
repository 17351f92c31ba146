// gradavg internals: what a call across processes keeps between calls, whatever its transport:
// its tables and fusion buffers (a transport adds its own in-flight state beside them). Shared by
// every instruction-set level.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradavg::shared_detail {

/// The tables and buffers of a call across processes, reused from call to call (no allocation
/// once grown to a layout's size).
struct process_buffers {
  std::vector<std::byte> buffers;          // the buckets' fusion buffers
  std::vector<std::uint64_t> words;        // the agreement's words and the variables' table
  std::vector<const void*> towers;         // per variable and tower: the first gradient element
  std::vector<void*> outputs;              // per variable: its means and squares outputs
  std::vector<unsigned char> nonfinite;    // per variable: a non-finite input on some rank
  std::vector<std::uint64_t> outcome;      // the last collective's words (output_mode::sharded)
};

}  // namespace gradavg::shared_detail
