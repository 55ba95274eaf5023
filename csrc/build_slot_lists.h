// Host-side declarations of the build_slot_lists CUDA launcher
// (csrc/build_slot_lists.cu). Plain C++: no torch, no CUDA headers.
//
// Semantics: python/vtoken/reference/build_slot_lists.py; contract:
// vtoken_kernels/contracts.py. Design and cost: vtoken_kernels/build_slot_lists.py
// (the CUDA kernels follow the same three-launch plan).
#pragma once

#include <cstdint>

extern "C" {

// Raw arguments of the op. Pointers are device pointers.
struct VtokenSlotListsArgs {
  // Inputs
  const int32_t* slots;            // [mirror_len]
  const uint8_t* alive;            // [mirror_len] int8 / bool, nonzero = alive
  const int64_t* mirror_starts;    // [>= num_reqs]
  const void* num_tokens;          // [>= num_reqs] int32 or int64 (num_tokens_int64)
  const void* new_token_counts;    // [>= num_reqs] int32 or int64 (counts_int64)
  // Outputs (in place)
  int32_t* kv_indices;             // [nnz_max]
  int32_t* kv_indptr;              // [max_reqs + 1]
  int32_t* slot_mapping;           // [max_tokens]
  int32_t* kv_pos;                 // [nnz_max], or nullptr when not wanted
  // Workspace: vtoken_build_slot_lists_workspace_size() int64 entries, no initial value needed.
  int64_t* workspace;
  // Constants
  int64_t mirror_len;
  int64_t num_reqs;
  int64_t max_reqs;
  int64_t nnz_max;
  int64_t max_tokens;
  int32_t num_tokens_int64;
  int32_t counts_int64;
};

// int64 entries of workspace the launcher needs.
int64_t vtoken_build_slot_lists_workspace_size(int64_t mirror_len, int64_t num_reqs);

// Rebuild the slot lists on `stream` (a cudaStream_t). No host sync.
// Returns a cudaError_t as int (0 = success).
int vtoken_build_slot_lists_launch(const VtokenSlotListsArgs* args, void* stream);

}  // extern "C"
