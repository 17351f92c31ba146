// gradavg internals: how one bucket's fusion buffer moves between the ranks of a gradavg::mpi
// call. Every rank owns a contiguous slice of each bucket: the others send it their contributions
// to that slice, it sums them in rank order and sends the sum back to every rank.
#pragma once

#include <algorithm>
#include <cstddef>

#include "mpi_support.hpp"

namespace gradavg {
namespace mpi {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {

/// The first MPI call of a data path that returned an error: thrown after the last collective
/// (throwing at once would leave the other ranks waiting for this rank's messages).
struct first_mpi_failure {
  const char* call = nullptr;
  int code = MPI_SUCCESS;
  void note(int rc, const char* function) noexcept {
    if (rc != MPI_SUCCESS && call == nullptr) call = function, code = rc;
  }
};

/// One bucket in flight: its buffers and its requests.
template <class Buf>
struct slice_buffers {
  Buf* local = nullptr;  // the fusion buffer, then the gathered sums
  Buf* recv = nullptr;   // the other ranks' contributions to this rank's slice, in rank order
  MPI_Request* requests = nullptr;  // 2 (P - 1): a receive and a send per other rank
  int* counts = nullptr;            // 4 P: exchange_method::collectives' counts and displacements
  int pending = 0;                  // requests in use
};

/// The exchange of one bucket of len Buf elements: exchange_method::collectives
/// (MPI_Ialltoallv, then MPI_Iallgatherv; counts and displacements in bytes, in
/// slice_buffers::counts) or point to point (tags exchange_tag and gather_tag on comm). MPI errors
/// are noted in failed, never thrown.
template <class Buf>
struct slice_exchange {
  MPI_Comm comm;
  int rank, ranks;
  bool collectives;
  first_mpi_failure& failed;

  /// Rank r's slice of a bucket of len elements begins here (and ends where r + 1's begins).
  std::size_t slice_begin(std::size_t len, int r) const noexcept {
    return len * static_cast<std::size_t>(r) / static_cast<std::size_t>(ranks);
  }

  static int bytes_of(std::size_t elements) noexcept { return static_cast<int>(elements * sizeof(Buf)); }

  /// Waits for the bucket's requests in flight.
  void wait_all(slice_buffers<Buf>& bs) {
    if (bs.pending != 0) failed.note(MPI_Waitall(bs.pending, bs.requests, MPI_STATUSES_IGNORE), "MPI_Waitall");
    bs.pending = 0;
  }

  /// Sends every other rank its slice of the bucket; receives theirs of this rank's slice.
  void start(std::size_t len, slice_buffers<Buf>& bs) {
    const std::size_t mine = slice_begin(len, rank + 1) - slice_begin(len, rank);
    bs.pending = 0;
    if (collectives) {
      // Nothing to or from this rank itself; the others' contributions in rank order in recv.
      int* send_counts = bs.counts;
      int* send_displs = bs.counts + ranks;
      int* recv_counts = bs.counts + 2 * ranks;
      int* recv_displs = bs.counts + 3 * ranks;
      for (int r = 0; r < ranks; ++r) {
        const std::size_t first = slice_begin(len, r);
        send_counts[r] = r == rank ? 0 : bytes_of(slice_begin(len, r + 1) - first);
        send_displs[r] = bytes_of(first);
        recv_counts[r] = r == rank ? 0 : bytes_of(mine);
        recv_displs[r] = r == rank ? 0 : bytes_of(static_cast<std::size_t>(r < rank ? r : r - 1) * mine);
      }
      failed.note(MPI_Ialltoallv(bs.local, send_counts, send_displs, MPI_BYTE, bs.recv, recv_counts, recv_displs,
                          MPI_BYTE, comm, &bs.requests[bs.pending++]),
           "MPI_Ialltoallv");
      return;
    }
    for (int r = 0, slot = 0; r < ranks; ++r) {
      if (r == rank) continue;
      failed.note(MPI_Irecv(bs.recv + static_cast<std::size_t>(slot++) * mine, bytes_of(mine), MPI_BYTE, r, exchange_tag,
                     comm, &bs.requests[bs.pending++]),
           "MPI_Irecv");
    }
    for (int r = 0; r < ranks; ++r) {
      if (r == rank) continue;
      const std::size_t first = slice_begin(len, r);
      failed.note(MPI_Isend(bs.local + first, bytes_of(slice_begin(len, r + 1) - first), MPI_BYTE, r, exchange_tag,
                     comm, &bs.requests[bs.pending++]),
           "MPI_Isend");
    }
  }

  /// Waits for the contributions, sums them in rank order into this rank's slice of the buffer
  /// (its own contribution is there already), and starts sending the sum to every other rank
  /// and receiving theirs.
  void reduce_and_gather(std::size_t len, slice_buffers<Buf>& bs) {
    wait_all(bs);
    const std::size_t first = slice_begin(len, rank);
    const std::size_t mine = slice_begin(len, rank + 1) - first;
    Buf* out = bs.local + first;
    // The contribution of another rank r, in recv.
    auto from = [&](int r) { return bs.recv + static_cast<std::size_t>(r < rank ? r : r - 1) * mine; };
    constexpr std::size_t block = 512;  // elements summed over every rank at a time (in L1)
    Buf own[block];                      // this rank's contribution, kept aside while out is rewritten
    for (std::size_t j0 = 0; j0 < mine; j0 += block) {
      const std::size_t n = std::min(block, mine - j0);
      Buf* o = out + j0;
      if (rank != 0) {
        std::copy(o, o + n, own);
        const Buf* in = from(0) + j0;
        std::copy(in, in + n, o);
      }
      for (int r = 1; r < ranks; ++r) {
        const Buf* in = r == rank ? own : from(r) + j0;
        for (std::size_t j = 0; j < n; ++j) o[j] += in[j];
      }
    }
    if (collectives) {
      int* counts = bs.counts;
      int* displs = bs.counts + ranks;
      for (int r = 0; r < ranks; ++r) {
        counts[r] = bytes_of(slice_begin(len, r + 1) - slice_begin(len, r));
        displs[r] = bytes_of(slice_begin(len, r));
      }
      failed.note(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, bs.local, counts, displs, MPI_BYTE, comm,
                           &bs.requests[bs.pending++]),
           "MPI_Iallgatherv");
      return;
    }
    for (int r = 0; r < ranks; ++r) {
      if (r == rank) continue;
      const std::size_t at = slice_begin(len, r);
      failed.note(MPI_Irecv(bs.local + at, bytes_of(slice_begin(len, r + 1) - at), MPI_BYTE, r, gather_tag, comm,
                     &bs.requests[bs.pending++]),
           "MPI_Irecv");
    }
    for (int r = 0; r < ranks; ++r)
      if (r != rank)
        failed.note(MPI_Isend(out, bytes_of(mine), MPI_BYTE, r, gather_tag, comm, &bs.requests[bs.pending++]), "MPI_Isend");
  }
};

}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace mpi
}  // namespace gradavg
