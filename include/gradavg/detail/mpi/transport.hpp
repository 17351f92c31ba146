// gradavg internals: MPI as a transport of a call across processes (processes/exchange.hpp's
// concept): MPI's error checks, the communicator's checks, the agreement's collectives on words
// and a bucket's moves, by collectives or point to point (mpi::exchange_method).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "../isa.hpp"
#include "../processes/exchange.hpp"
#include "../../mpi_options.hpp"
#include "../../options.hpp"

namespace gradavg {
namespace mpi {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

namespace processes = gradavg::detail::processes;

/// Throws mpi_error naming the MPI function and MPI's own words for the code, unless rc is
/// MPI_SUCCESS.
inline void check(int rc, const char* function) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) length = 0;
  throw mpi_error("gradavg::mpi: " + std::string(function) + " returned error " + std::to_string(rc) +
                  (length > 0 ? " (" + std::string(text, static_cast<std::size_t>(length)) + ")" : std::string()));
}

/// What can be checked before a collective call: MPI initialised and not finalised, comm neither
/// MPI_COMM_NULL nor an inter-communicator (mpi_error). Every rank that passes such a comm throws.
inline void check_communicator(MPI_Comm comm) {
  int initialized = 0, finalized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  check(MPI_Finalized(&finalized), "MPI_Finalized");
  if (!initialized)
    throw mpi_error("gradavg::mpi: MPI is not initialised; call MPI_Init (or MPI_Init_thread) first");
  if (finalized) throw mpi_error("gradavg::mpi: MPI is finalised; no MPI call can be made after MPI_Finalize");
  if (comm == MPI_COMM_NULL) throw mpi_error("gradavg::mpi: the communicator is MPI_COMM_NULL");
  int inter = 0;
  check(MPI_Comm_test_inter(comm, &inter), "MPI_Comm_test_inter");
  if (inter)
    throw mpi_error("gradavg::mpi: the communicator is an inter-communicator; pass an intra-communicator "
                    "(MPI_Intercomm_merge makes one)");
}

inline int comm_rank(MPI_Comm comm) {
  int r = 0;
  check(MPI_Comm_rank(comm, &r), "MPI_Comm_rank");
  return r;
}
inline int comm_size(MPI_Comm comm) {
  int n = 0;
  check(MPI_Comm_size(comm, &n), "MPI_Comm_size");
  return n;
}

/// The tags of the point-to-point moves on the caller's communicator.
inline constexpr int exchange_tag = 0x4741;  // contributions to a slice's owner
inline constexpr int gather_tag = 0x4742;    // summed slices back from their owner

/// MPI as a call's transport. Its moves: exchange_method::collectives (MPI_Ialltoallv, then
/// MPI_Iallgatherv, counts and displacements in bytes) or point to point (MPI_Isend / MPI_Irecv,
/// tags exchange_tag and gather_tag on comm); per set, 2 (P - 1) requests and 4 P counts in the
/// workspace (reserve()).
class transport {
 public:
  using options_type = mpi::options;
  static constexpr const char* caller = "gradavg::mpi";

  transport(MPI_Comm comm, const mpi::options& opts, shared_detail::buffers& work)
      : comm_(comm), method_(opts.exchange.method), work_(work), rank_(comm_rank(comm)), ranks_(comm_size(comm)) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int ranks() const noexcept { return ranks_; }
  [[nodiscard]] std::uint64_t identity() const noexcept {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &comm_, std::min(sizeof comm_, sizeof bits));
    return bits;
  }
  [[nodiscard]] std::uint64_t method_code() const noexcept { return static_cast<std::uint64_t>(method_); }
  void check_options() const {
    gradavg::shared_detail::require_named(method_, exchange_method::point_to_point, "options.exchange.method");
  }
  [[nodiscard]] std::size_t automatic_fusion_bytes() const noexcept { return mpi::automatic_fusion_bytes(ranks_); }

  void min_words(std::uint64_t* words, std::size_t n) {
    check(MPI_Allreduce(MPI_IN_PLACE, words, count(n), MPI_UINT64_T, MPI_MIN, comm_), "MPI_Allreduce");
  }
  void max_words(const std::uint64_t* in, std::uint64_t* words, std::size_t n) {
    check(MPI_Allreduce(in, words, count(n), MPI_UINT64_T, MPI_MAX, comm_), "MPI_Allreduce");
  }
  void gather_words(const std::uint64_t* in, std::uint64_t* words, std::size_t n) {
    check(MPI_Allgather(in, count(n), MPI_UINT64_T, words, count(n), MPI_UINT64_T, comm_), "MPI_Allgather");
  }

  void reserve(std::size_t sets) {
    const auto P = static_cast<std::size_t>(ranks_);
    work_.requests.assign(sets * 2 * P, MPI_REQUEST_NULL);
    work_.counts.resize(collectives() ? sets * 4 * P : 0);
    work_.pending.assign(sets, 0);
  }

  void scatter(std::size_t set, const std::byte* from, std::byte* into, const processes::slice_layout& l) {
    if (collectives()) {
      // Nothing to or from this rank itself; the others' contributions in rank order.
      int* send_counts = counts(set);
      int* send_displs = send_counts + ranks_;
      int* recv_counts = send_counts + 2 * ranks_;
      int* recv_displs = send_counts + 3 * ranks_;
      for (int r = 0; r < ranks_; ++r) {
        send_counts[r] = r == rank_ ? 0 : count(l.bytes(r));
        send_displs[r] = count(l.at(r));
        recv_counts[r] = r == rank_ ? 0 : count(l.bytes(rank_));
        recv_displs[r] = r == rank_ ? 0 : count(l.received_at(r, rank_));
      }
      note(MPI_Ialltoallv(from, send_counts, send_displs, MPI_BYTE, into, recv_counts, recv_displs, MPI_BYTE, comm_,
                          next_request(set)),
           "MPI_Ialltoallv");
      return;
    }
    for (int r = 0; r < ranks_; ++r)
      if (r != rank_)
        note(MPI_Irecv(into + l.received_at(r, rank_), count(l.bytes(rank_)), MPI_BYTE, r, exchange_tag, comm_,
                       next_request(set)),
             "MPI_Irecv");
    for (int r = 0; r < ranks_; ++r)
      if (r != rank_)
        note(MPI_Isend(from + l.at(r), count(l.bytes(r)), MPI_BYTE, r, exchange_tag, comm_, next_request(set)),
             "MPI_Isend");
  }

  void gather(std::size_t set, std::byte* bytes, const processes::slice_layout& l) {
    if (collectives()) {
      int* counts_of = counts(set);
      int* displs = counts_of + ranks_;
      for (int r = 0; r < ranks_; ++r) counts_of[r] = count(l.bytes(r)), displs[r] = count(l.at(r));
      note(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, bytes, counts_of, displs, MPI_BYTE, comm_, next_request(set)),
           "MPI_Iallgatherv");
      return;
    }
    for (int r = 0; r < ranks_; ++r)
      if (r != rank_)
        note(MPI_Irecv(bytes + l.at(r), count(l.bytes(r)), MPI_BYTE, r, gather_tag, comm_, next_request(set)),
             "MPI_Irecv");
    for (int r = 0; r < ranks_; ++r)
      if (r != rank_)
        note(MPI_Isend(bytes + l.at(rank_), count(l.bytes(rank_)), MPI_BYTE, r, gather_tag, comm_, next_request(set)),
             "MPI_Isend");
  }

  void wait(std::size_t set) {
    int& pending = work_.pending[set];
    if (pending != 0) note(MPI_Waitall(pending, requests(set), MPI_STATUSES_IGNORE), "MPI_Waitall");
    pending = 0;
  }
  void test(std::size_t set) {
    int done = 0;
    if (work_.pending[set] != 0)
      note(MPI_Testall(work_.pending[set], requests(set), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
  }
  /// The first move that failed, as mpi_error.
  void rethrow_noted() const {
    if (failed_call_ != nullptr) check(failed_code_, failed_call_);
  }

 private:
  [[nodiscard]] bool collectives() const noexcept { return method_ == exchange_method::collectives; }
  /// A count MPI takes: fusion_bytes is at most 1 GiB, so every count of a bucket fits an int.
  static int count(std::size_t n) noexcept { return static_cast<int>(n); }
  MPI_Request* requests(std::size_t set) noexcept {
    return work_.requests.data() + set * 2 * static_cast<std::size_t>(ranks_);
  }
  MPI_Request* next_request(std::size_t set) noexcept { return requests(set) + work_.pending[set]++; }
  int* counts(std::size_t set) noexcept { return work_.counts.data() + set * 4 * static_cast<std::size_t>(ranks_); }
  void note(int rc, const char* function) noexcept {
    if (rc != MPI_SUCCESS && failed_call_ == nullptr) failed_call_ = function, failed_code_ = rc;
  }

  MPI_Comm comm_;
  exchange_method method_;
  shared_detail::buffers& work_;
  int rank_, ranks_;
  const char* failed_call_ = nullptr;
  int failed_code_ = MPI_SUCCESS;
};

static_assert(processes::transport<transport>);

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace mpi
}  // namespace gradavg
