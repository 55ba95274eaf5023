// Host-side declaration of the block_live_counts CUDA launcher
// (csrc/block_live_counts.cu). Plain C++: no torch, no CUDA headers.
//
// Semantics: python/vtoken/reference/block_live_counts.py.
#pragma once

#include <cstdint>

extern "C" {

struct VtokenBlockLiveCountsArgs {
  // Inputs
  const int32_t* slots;      // [num_tokens]
  const uint8_t* alive;      // [num_tokens] int8 / bool, nonzero = alive
  const uint8_t* allocated;  // [num_blocks] int8 / bool, or nullptr = every block
  // Outputs
  int32_t* counts;           // [num_blocks], zeroed by the launcher
  float* waste_ratio;        // [] F
  // Workspace: 3 uint64 (live in allocated blocks, allocated blocks, ticket), zeroed by the launcher.
  unsigned long long* workspace;
  // Constants
  int64_t num_tokens;
  int64_t num_blocks;
  int64_t block_size;
};

// Histogram + F on `stream` (a cudaStream_t), one kernel after two memsets; no
// host sync. Returns a cudaError_t as int (0 = success).
int vtoken_block_live_counts_launch(const VtokenBlockLiveCountsArgs* args, void* stream);

}  // extern "C"
