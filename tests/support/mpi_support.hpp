// Test helpers for the MPI tests: MPI for the life of a test program, and this process's place
// in MPI_COMM_WORLD.
#pragma once

#include <mpi.h>

#include <cstdint>

namespace gradavg_test {

/// MPI for the life of the program (main() is the suite's shared one): one object per test
/// program; every rank runs every case in the same order, and mpiexec fails when any rank's run
/// fails.
struct mpi_session {
  mpi_session() { MPI_Init(nullptr, nullptr); }
  /// MPI_Init_thread at thread_level (MPI_THREAD_SERIALIZED: threads other than main call MPI).
  explicit mpi_session(int thread_level) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, thread_level, &provided);
  }
  ~mpi_session() { MPI_Finalize(); }
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;
};

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// Whether every rank of MPI_COMM_WORLD holds the same value (a collective: every rank calls it).
inline bool same_on_every_rank(std::uint64_t value) {
  std::uint64_t words[2] = {value, ~value};  // the largest value, and the complement of the smallest
  MPI_Allreduce(MPI_IN_PLACE, words, 2, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return words[0] == ~words[1];
}

}  // namespace gradavg_test
