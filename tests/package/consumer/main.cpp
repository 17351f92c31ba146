// A consumer of the gradavg package: averages two towers and checks the result by hand.
#include <gradavg/gradavg.hpp>
#if defined(GRADAVG_CONSUMER_EXPECT_EXTERN_KERNELS) && !defined(GRADAVG_EXTERN_KERNELS)
#error "GRADAVG_EXTERN_KERNELS is not defined: this unit would compile the kernel itself"
#endif
#if defined(GRADAVG_CONSUMER_MPI)
#include <gradavg/mpi.hpp>  // component mpi: compiles and links against MPI's C library
#endif

#include <Eigen/Core>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

int main() {
  const std::string version = std::to_string(GRADAVG_VERSION_MAJOR) + "." + std::to_string(GRADAVG_VERSION_MINOR) +
                              "." + std::to_string(GRADAVG_VERSION_PATCH);
  if (version != EXPECTED_VERSION) {
    std::printf("version header says %s, CMake package says %s\n", version.c_str(), EXPECTED_VERSION);
    return 1;
  }
  const Eigen::VectorXf g0 = Eigen::VectorXf::LinSpaced(10, 0.0f, 9.0f);
  const Eigen::VectorXf g1 = Eigen::VectorXf::Constant(10, 1.0f);
  const std::vector<std::vector<std::pair<const Eigen::VectorXf*, std::string>>> tower_grads{{{&g0, "w"}},
                                                                                            {{&g1, "w"}}};
  const auto result = gradavg::average_gradients(tower_grads);
  for (Eigen::Index j = 0; j < 10; ++j) {
    const float want = (static_cast<float>(j) + 1.0f) / 2.0f;
    if (result.gradients[0].first[j] != want) {
      std::printf("element %ld: %g, want %g\n", static_cast<long>(j), result.gradients[0].first[j], want);
      return 1;
    }
  }
#if defined(GRADAVG_CONSUMER_MPI)
  int initialized = 1;
  MPI_Initialized(&initialized);  // allowed before MPI_Init: proves the link without starting MPI
  if (initialized) return 1;
  std::printf("component mpi: gradavg::mpi::automatic_fusion_bytes(2) = %zu\n", gradavg::mpi::automatic_fusion_bytes(2));
#endif
  std::printf("gradavg %s consumed: ok\n", version.c_str());
  return 0;
}
