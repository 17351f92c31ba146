// gradavg's kernel, compiled once in each target that links gradavg::kernels (CMakeLists.txt):
// that target's other units define GRADAVG_EXTERN_KERNELS and use this unit's kernel.
#include <gradavg/kernels.hpp>
