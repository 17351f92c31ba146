// The averaging kernel for the tests that define GRADAVG_EXTERN_KERNELS (tests/CMakeLists.txt),
// compiled once per build tree with their flags instead of once in each of them.
#include <gradavg/kernels.hpp>
