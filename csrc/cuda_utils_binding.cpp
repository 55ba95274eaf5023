// torch op binding of the CUDA runtime helpers in csrc/cuda_utils.cu.
//
// Schema:
//   vtoken::kernel_image_status(int device) -> (bool, str)
// (true, "") when this library holds code CUDA device `device` can run;
// otherwise (false, cause). The cause is either "no kernel image" (a GPU newer
// than the build's SASS when the build left out PTX, VTOKEN_NVCC_GENCODE) or
// the CUDA runtime's error when the query itself failed (e.g. a CUDA 13
// runtime under an older driver: cudaErrorInsufficientDriver). It does not
// throw for either: vtoken.device.ops asks once per device (only when
// torch.cuda.is_available()), warns with the cause and falls back to Triton.
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "vtoken_kernels.h"

namespace {

std::tuple<bool, std::string> kernel_image_status(int64_t device) {
  TORCH_CHECK(device >= 0, "kernel_image_status: device: expected an index >= 0, got ", device);
  int has_image = 0;
  const int err = vtoken_kernel_image_query(static_cast<int>(device), &has_image);
  if (err != 0) {
    return {false, "CUDA query on device " + std::to_string(device) + " failed: " +
                       vtoken_cuda_error_string(err) + " (" + vtoken_cuda_error_name(err) + ")"};
  }
  if (has_image == 0) {
    return {false, "vtoken._C has no kernel image for device " + std::to_string(device) +
                       " (rebuild with VTOKEN_NVCC_GENCODE for this GPU)"};
  }
  return {true, ""};
}

}  // namespace

// No tensor argument, so one kernel for every dispatch key.
TORCH_LIBRARY_FRAGMENT(vtoken, m) { m.def("kernel_image_status(int device) -> (bool, str)", &kernel_image_status); }
