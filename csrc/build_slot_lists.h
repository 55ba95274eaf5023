// Host-side declarations of the build_slot_lists / append_slot_lists CUDA
// launchers (csrc/build_slot_lists.cu). Plain C++: no torch, no CUDA headers.
//
// Semantics and contract: python/vtoken/reference/build_slot_lists.py.
// Design and cost: vtoken_kernels/build_slot_lists.py (the CUDA kernels follow
// the same two-launch plans).
#pragma once

#include <cstdint>

extern "C" {

// Raw arguments of both ops. Pointers are device pointers.
struct VtokenSlotListsArgs {
  // Inputs
  const int32_t* slots;           // [num_tokens]
  const uint8_t* alive;           // [num_tokens] int8 / bool, nonzero = alive
  const void* mirror_offsets;     // [>= num_reqs + 1] int32 or int64 (offsets_int64)
  const void* new_token_counts;   // [>= num_reqs] int32 or int64 (counts_int64)
  // Outputs (in place)
  int32_t* kv_indices;            // [nnz_max]
  int32_t* kv_indptr;             // [max_reqs + 1]
  int32_t* slot_mapping;          // [max_tokens]
  // Workspace: vtoken_*_workspace_size() int32 entries, no initial value needed.
  int32_t* workspace;
  // Constants
  int64_t num_tokens;
  int64_t num_reqs;
  int64_t max_reqs;
  int64_t nnz_max;
  int64_t max_tokens;
  int32_t offsets_int64;
  int32_t counts_int64;
};

// int32 entries of workspace each launcher needs.
int64_t vtoken_build_slot_lists_workspace_size(int64_t num_tokens);
int64_t vtoken_append_slot_lists_workspace_size(int64_t num_reqs, int64_t nnz_max);

// Full rebuild / append-only update on `stream` (a cudaStream_t). No host sync.
// Return a cudaError_t as int (0 = success).
int vtoken_build_slot_lists_launch(const VtokenSlotListsArgs* args, void* stream);
int vtoken_append_slot_lists_launch(const VtokenSlotListsArgs* args, void* stream);

}  // extern "C"
