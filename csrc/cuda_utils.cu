// Small CUDA runtime helpers shared by the bindings (no torch headers).
#include <cuda_runtime.h>

#include "vtoken_kernels.h"

extern "C" const char* vtoken_cuda_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
