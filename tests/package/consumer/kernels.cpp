// The one unit of the consumer that compiles gradavg's kernel (GRADAVG_CONSUMER_EXTERN_KERNELS).
#include <gradavg/kernels.hpp>
