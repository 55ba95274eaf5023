// Helpers the bindings share (torch headers only, no CUDA runtime headers
// unless torch itself is a CUDA build).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#if defined(VTOKEN_WITH_CUDA_TORCH)
#include <c10/cuda/CUDAStream.h>
#else
#include <c10/core/impl/DeviceGuardImplInterface.h>
#endif

namespace vtoken {

// The current CUDA stream of `device` as an opaque cudaStream_t, for the
// extern "C" launchers in csrc/vtoken_kernels.h.
// NOTE: csrc/build_ext.py defines VTOKEN_WITH_CUDA_TORCH when building against
// a CUDA torch (c10_cuda is linked). Against a CPU torch the generic
// c10::Stream::native_handle() path compiles, and is never reached at
// runtime because a CPU torch has no CUDA tensors to dispatch on.
inline void* current_cuda_stream(const c10::Device& device) {
#if defined(VTOKEN_WITH_CUDA_TORCH)
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(device.index()).stream());
#else
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(device).native_handle();
#endif
}

}  // namespace vtoken
