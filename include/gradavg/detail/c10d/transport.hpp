// gradavg internals: a c10d::ProcessGroup as a transport of a call across processes
// (processes/exchange.hpp's concept): the agreement's collectives on words (allreduce, allgather)
// and a bucket's moves (send / recv), each a Work that the process group's engine (gloo's worker
// threads and its pairs' I/O) completes on its own.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <vector>

#include "../isa.hpp"
#include "../processes/exchange.hpp"
#include "../../c10d_options.hpp"

namespace gradavg {
namespace c10d {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

namespace processes = gradavg::detail::processes;

/// The tags of the point-to-point moves on the group: contributions to a slice's owner
/// (send_tag_base + 2 set) and the summed slices back (+ 1).
inline constexpr int send_tag_base = 0x474100;

/// A bucket's bytes as a tensor the process group reads or writes in place (no copy).
inline at::Tensor bytes_tensor(const std::byte* at, std::size_t n) {
  return at::from_blob(const_cast<std::byte*>(at), {static_cast<std::int64_t>(n)}, at::TensorOptions(at::kByte));
}

/// 64-bit words as a tensor the process group reads or writes in place.
inline at::Tensor words_tensor(std::uint64_t* words, std::size_t n) {
  return at::from_blob(words, {static_cast<std::int64_t>(n)}, at::TensorOptions(at::kLong));
}

/// The group's allreduce of n words in place, as unsigned words: MIN, MAX (int64 tensors, the
/// unsigned order kept by flipping the top bit) or BOR.
inline void reduce_words(::c10d::ProcessGroup& group, std::uint64_t* words, std::size_t n, ::c10d::ReduceOp::RedOpType op) {
  const std::uint64_t flip = op == ::c10d::ReduceOp::BOR ? 0 : std::uint64_t{1} << 63;
  for (std::size_t i = 0; i < n; ++i) words[i] ^= flip;
  try {
    shared_detail::guarded(op == ::c10d::ReduceOp::MIN ? "allreduce (MIN)" : op == ::c10d::ReduceOp::MAX ? "allreduce (MAX)" : "allreduce (BOR)", [&] {
      std::vector<at::Tensor> tensors{words_tensor(words, n)};
      ::c10d::AllreduceOptions how;
      how.reduceOp = ::c10d::ReduceOp(op);
      group.allreduce(tensors, how)->wait();
    });
  } catch (...) {
    for (std::size_t i = 0; i < n; ++i) words[i] ^= flip;
    throw;
  }
  for (std::size_t i = 0; i < n; ++i) words[i] ^= flip;
}

/// A process group as a call's transport: the agreement's words as int64 tensors (the unsigned
/// order kept by flipping the top bit), a bucket's moves as send / recv with every other rank.
class transport {
 public:
  using options_type = c10d::options;
  static constexpr const char* caller = "gradavg::c10d";

  transport(::c10d::ProcessGroup& group, shared_detail::buffers& work)
      : group_(group), work_(work), rank_(group.getRank()), ranks_(group.getSize()) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int ranks() const noexcept { return ranks_; }
  [[nodiscard]] std::uint64_t identity() const noexcept { return std::bit_cast<std::uintptr_t>(&group_); }
  [[nodiscard]] std::uint64_t method_code() const noexcept { return 0; }
  void check_options() const noexcept {}
  [[nodiscard]] std::size_t automatic_fusion_bytes() const noexcept { return c10d::automatic_fusion_bytes(ranks_); }

  void min_words(std::uint64_t* words, std::size_t n) { reduce_words(group_, words, n, ::c10d::ReduceOp::MIN); }
  void max_words(const std::uint64_t* in, std::uint64_t* words, std::size_t n) {
    std::copy(in, in + n, words);
    reduce_words(group_, words, n, ::c10d::ReduceOp::MAX);
  }
  void gather_words(const std::uint64_t* in, std::uint64_t* words, std::size_t n) {
    shared_detail::guarded("allgather", [&] {
      std::vector<at::Tensor> mine{words_tensor(const_cast<std::uint64_t*>(in), n)};
      std::vector<std::vector<at::Tensor>> all(1);
      for (int r = 0; r < ranks_; ++r) all[0].push_back(words_tensor(words + static_cast<std::size_t>(r) * n, n));
      group_.allgather(all, mine)->wait();
    });
  }

  void reserve(std::size_t sets) {
    work_.pending.resize(sets);
    for (auto& moves : work_.pending) moves.clear(), moves.reserve(2 * static_cast<std::size_t>(ranks_));
  }

  void scatter(std::size_t set, const std::byte* from, std::byte* into, const processes::slice_layout& l) {
    for (int r = 0; r < ranks_; ++r)
      if (r != rank_) post_recv(set, into + l.received_at(r, rank_), l.bytes(rank_), r, tag(set, 0));
    for (int r = 0; r < ranks_; ++r)
      if (r != rank_) post_send(set, from + l.at(r), l.bytes(r), r, tag(set, 0));
  }
  void gather(std::size_t set, std::byte* bytes, const processes::slice_layout& l) {
    for (int r = 0; r < ranks_; ++r)
      if (r != rank_) post_recv(set, bytes + l.at(r), l.bytes(r), r, tag(set, 1));
    for (int r = 0; r < ranks_; ++r)
      if (r != rank_) post_send(set, bytes + l.at(rank_), l.bytes(rank_), r, tag(set, 1));
  }

  void wait(std::size_t set) {
    for (auto& move : work_.pending[set]) {
      try {
        move->wait();
      } catch (...) {
        note("send / recv", std::current_exception());
      }
    }
    work_.pending[set].clear();
  }
  /// The engine moves the bytes on its own threads: nothing to drive.
  void test(std::size_t) noexcept {}
  /// The first move that failed, as c10d_error.
  void rethrow_noted() const {
    if (failure_) shared_detail::rethrow_as_c10d_error(failed_, failure_);
  }

 private:
  static int tag(std::size_t set, int direction) noexcept {
    return send_tag_base + 2 * static_cast<int>(set) + direction;
  }
  // Both ends of a move compute its size alike: an empty one is neither sent nor received.
  void post_send(std::size_t set, const std::byte* from, std::size_t n, int to, int t) noexcept {
    if (n == 0) return;
    post(set, "send", [&] {
      std::vector<at::Tensor> tensors{bytes_tensor(from, n)};
      return group_.send(tensors, to, t);
    });
  }
  void post_recv(std::size_t set, std::byte* into, std::size_t n, int from, int t) noexcept {
    if (n == 0) return;
    post(set, "recv", [&] {
      std::vector<at::Tensor> tensors{bytes_tensor(into, n)};
      return group_.recv(tensors, from, t);
    });
  }
  template <class F>
  void post(std::size_t set, const char* operation, F&& f) noexcept {
    try {
      work_.pending[set].push_back(f());
    } catch (...) {
      note(operation, std::current_exception());
    }
  }
  void note(const char* operation, std::exception_ptr failure) noexcept {
    if (!failure_) failed_ = operation, failure_ = failure;
  }

  ::c10d::ProcessGroup& group_;
  shared_detail::buffers& work_;
  int rank_, ranks_;
  const char* failed_ = nullptr;
  std::exception_ptr failure_;
};

static_assert(processes::transport<transport>);

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace c10d
}  // namespace gradavg
