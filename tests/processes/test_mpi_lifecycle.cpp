// gradavg::mpi called when MPI cannot take it: before MPI_Init and after MPI_Finalize, an
// mpi_error on every rank (run under mpiexec with 2 ranks: none may hang or abort).
#include <gradavg/gradavg.hpp>
#include <gradavg/mpi.hpp>

#include <mpi.h>

#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "support.hpp"

TEST_CASE("before MPI_Init and after MPI_Finalize: mpi_error, outputs untouched") {
  std::vector<float> g{1, 2, 3};
  const std::vector<std::vector<std::pair<const std::vector<float>*, std::string>>> tg{{{&g, "v0"}}};
  std::vector<std::vector<float>> out{std::vector<float>(3, -1.0f)};
  auto call = [&] { gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, tg, out); };

  CHECK(gradavg_test::contains(gradavg_test::message_of<gradavg::mpi_error>(call), "MPI is not initialised"));
  REQUIRE(MPI_Init(nullptr, nullptr) == MPI_SUCCESS);
  int ranks = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  gradavg::mpi::average_gradients_into(MPI_COMM_WORLD, tg, out);  // every rank holds the same tower
  CHECK(out[0] == g);
  MPI_Finalize();
  out[0].assign(3, -1.0f);
  CHECK(gradavg_test::contains(gradavg_test::message_of<gradavg::mpi_error>(call), "MPI is finalised"));
  CHECK(out[0] == std::vector<float>(3, -1.0f));
  CHECK(ranks >= 1);
}
