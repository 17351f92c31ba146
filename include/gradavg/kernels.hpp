// gradavg: the kernel compiled once for a program, instead of in every translation unit.
//
// gradavg is header-only: each translation unit that calls it compiles the averaging kernel for
// the element types it may meet (about 10 s of GCC -O2 for float gradients, which also compile
// the double-accumulation kernel). To compile it once:
//   - define GRADAVG_EXTERN_KERNELS in every translation unit that includes gradavg (e.g.
//     target_compile_definitions(app PRIVATE GRADAVG_EXTERN_KERNELS));
//   - include this header in exactly one source file of the program, compiled with the same
//     instruction-set flags (-march=...) as those units. It may define GRADAVG_EXTERN_KERNELS too.
// The kernel lives in the instruction-set namespace of the unit that compiles it (detail/isa.hpp):
// a unit built for another level finds no definition, and the link fails naming that namespace,
// rather than running code of another level. Results are the same bits as without the macro.
#pragma once

#include "average.hpp"

namespace gradavg {
GRADAVG_BEGIN_ISA_NAMESPACE
namespace detail {
GRADAVG_KERNEL_INSTANCES_(GRADAVG_REDUCE_RANGE_INSTANCE_)
GRADAVG_KERNEL_INSTANCES_(GRADAVG_PASS_INSTANCE_)
}  // namespace detail
GRADAVG_END_ISA_NAMESPACE
}  // namespace gradavg
