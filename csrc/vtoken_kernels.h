// Host-side declarations of the CUDA launchers in csrc/*.cu.
//
// The .cu files include no torch header; the bindings (csrc/*_binding.cpp)
// call these extern "C" launchers with raw pointers and the current CUDA
// stream as an opaque `void*` (a cudaStream_t). Every launcher returns a
// cudaError_t as int (0 = success); vtoken_cuda_error_string() turns it into
// a message for TORCH_CHECK.
//
// Each op adds its own section below; keep sections independent.
#pragma once

#include <cstdint>

extern "C" {

// ---- shared (csrc/cuda_utils.cu) -------------------------------------------
// Message of a cudaError_t returned by a launcher.
const char* vtoken_cuda_error_string(int err);
// Its enum name, e.g. "cudaErrorInsufficientDriver".
const char* vtoken_cuda_error_name(int err);
// Sets *has_image to 1 when this library holds code CUDA device `device` can
// run (SASS for its arch, or PTX the driver JIT-compiles), else 0. Returns a
// cudaError_t as int: nonzero when the query itself failed.
int vtoken_kernel_image_query(int device, int* has_image);

}  // extern "C"

// ---- compact_kv (csrc/compact_kv.cu) ---------------------------------------
namespace vtoken {
struct CompactKVParams;  // csrc/compact_kv_params.h
}
extern "C" {
// Copies every move's token rows of every layer in `params` (one launch).
// Returns a cudaError_t as int.
int vtoken_compact_kv_launch(const vtoken::CompactKVParams* params, void* stream);
}  // extern "C"
