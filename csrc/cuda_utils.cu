// Small CUDA runtime helpers shared by the bindings (no torch headers).
#include <cuda_runtime.h>

#include "vtoken_kernels.h"

extern "C" const char* vtoken_cuda_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

extern "C" const char* vtoken_cuda_error_name(int err) {
  return cudaGetErrorName(static_cast<cudaError_t>(err));
}

namespace {
// Does nothing; it exists to be asked about. Every csrc/*.cu is compiled with
// the same -gencode flags (csrc/build_ext.py), so whether this kernel has code
// for a device is whether every kernel of the library has.
// Grid: never launched.
__global__ void vtoken_probe_kernel() {}
}  // namespace

extern "C" int vtoken_kernel_image_query(int device, int* has_image) {
  *has_image = 0;
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err != cudaSuccess) return static_cast<int>(err);
  err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  // NOTE: cudaFuncGetAttributes loads the kernel for the current device, so it
  // fails when the fatbin has neither SASS for the device's arch nor PTX the
  // driver can JIT for it (cudaErrorNoKernelImageForDevice; older runtimes
  // say cudaErrorInvalidDeviceFunction, "not compiled for the proper device
  // architecture").
  cudaFuncAttributes attrs;
  err = cudaFuncGetAttributes(&attrs, vtoken_probe_kernel);
  cudaSetDevice(previous);
  // A failed query also sets the runtime's last error: clear it, or the next
  // launch check (ours or torch's) reports it as its own.
  cudaGetLastError();
  if (err == cudaSuccess) {
    *has_image = 1;
    return 0;
  }
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) return 0;
  return static_cast<int>(err);
}
