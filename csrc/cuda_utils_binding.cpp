// torch op binding of the CUDA runtime helpers in csrc/cuda_utils.cu.
//
// Schema:
//   vtoken::has_cuda_kernel_image(int device) -> bool
// True when this library holds code CUDA device `device` can run. vtoken.ops
// asks once per device (only when torch.cuda.is_available()) and falls back to
// Triton when it is false, e.g. a GPU newer than the build's SASS when the
// build left out PTX (VTOKEN_NVCC_GENCODE).
#include <torch/library.h>

#include <cstdint>

#include "vtoken_kernels.h"

namespace {

bool has_cuda_kernel_image(int64_t device) {
  TORCH_CHECK(device >= 0, "has_cuda_kernel_image: device: expected an index >= 0, got ", device);
  int has_image = 0;
  const int err = vtoken_kernel_image_query(static_cast<int>(device), &has_image);
  TORCH_CHECK(err == 0, "has_cuda_kernel_image: CUDA query on device ", device, " failed: ",
              vtoken_cuda_error_string(err));
  return has_image != 0;
}

}  // namespace

// No tensor argument, so one kernel for every dispatch key.
TORCH_LIBRARY_FRAGMENT(vtoken, m) { m.def("has_cuda_kernel_image(int device) -> bool", &has_cuda_kernel_image); }
