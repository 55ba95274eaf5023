// CUDA block_live_counts: live tokens per physical block, plus F, in one
// kernel and without a host sync. No torch header (see
// csrc/block_live_counts_binding.cpp). Semantics:
// python/vtoken/reference/block_live_counts.py.
//
// Two histogram strategies, both exact (integer atomics commute):
//  * global: each warp looks at 32 consecutive tokens; tokens of one request
//    that share a block are usually adjacent, so __match_any_sync groups the
//    lanes with the same block and one lane adds the group's size (up to
//    block_size-fold fewer global atomics than one per token);
//  * shared: when the bins fit in shared memory (num_blocks <= kSmemBins) and
//    each CTA sees at least kSmemMinTokensPerBin tokens per bin, a CTA
//    accumulates a private histogram in shared memory and flushes its nonzero
//    bins. NOTE: a block holds at most block_size live tokens, so with the
//    usual block sizes (16) no global counter is contended and this path is
//    never taken; it pays for few large blocks (e.g. 1K blocks of 1024
//    tokens), where thousands of tokens hit each counter. The threshold is
//    chosen by counting (the flush costs num_blocks per CTA), not yet
//    measured on a GPU.
// F is written by the last CTA to finish (an atomic ticket after a
// __threadfence, as in CUDA's threadFenceReduction sample).
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "block_live_counts.h"

namespace {

constexpr int kThreads = 256;
constexpr int kItems = 16;
constexpr int64_t kTile = int64_t(kThreads) * kItems;  // tokens (and mask entries) per CTA, global path
constexpr int64_t kSmemBins = 8192;                    // 32 KiB of int32 bins
constexpr int64_t kSmemMinTokensPerBin = 4;

__host__ __device__ inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// Block of a live, in-range token, or -1. num_blocks * block_size <= 2^31, so
// the division fits in 32 bits.
__device__ inline int32_t token_block(const int32_t* slots, const uint8_t* alive, int64_t i, int64_t num_tokens,
                                      uint32_t limit, uint32_t block_size) {
  if (i >= num_tokens || alive[i] == 0) return -1;
  const int32_t s = slots[i];
  if (s < 0 || static_cast<uint32_t>(s) >= limit) return -1;
  return static_cast<int32_t>(static_cast<uint32_t>(s) / block_size);
}

// Adds the CTA's sums to the workspace; the last CTA writes F.
__device__ void finish(unsigned long long* acc, float* waste_ratio, unsigned long long live,
                       unsigned long long allocated, int64_t block_size) {
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ bool is_last;
  const unsigned long long l = Reduce(tmp).Sum(live);
  __syncthreads();
  const unsigned long long n = Reduce(tmp).Sum(allocated);
  if (threadIdx.x == 0) {
    atomicAdd(acc + 0, l);
    atomicAdd(acc + 1, n);
    __threadfence();  // the sums are visible before the ticket is taken
    is_last = atomicAdd(acc + 2, 1ull) == gridDim.x - 1;
  }
  __syncthreads();
  if (is_last && threadIdx.x == 0) {
    __threadfence();
    const unsigned long long total_live = atomicAdd(acc + 0, 0ull);
    const unsigned long long num_alloc = atomicAdd(acc + 1, 0ull);
    // Same float64 expression as the reference, rounded once to float32.
    *waste_ratio = num_alloc == 0
                       ? 0.0f
                       : static_cast<float>(1.0 - static_cast<double>(total_live) /
                                                      static_cast<double>(num_alloc * block_size));
  }
}

__global__ void __launch_bounds__(kThreads) live_counts_global_kernel(
    // Inputs
    const int32_t* __restrict__ slots,      // [num_tokens]
    const uint8_t* __restrict__ alive,      // [num_tokens]
    const uint8_t* __restrict__ allocated,  // [num_blocks] or nullptr
    // Outputs
    int32_t* __restrict__ counts,           // [num_blocks], zeroed
    float* __restrict__ waste_ratio,        // []
    unsigned long long* __restrict__ acc,   // [3], zeroed
    // Constants
    int64_t num_tokens, int64_t num_blocks, int64_t block_size) {
  // Grid: (max(cdiv(num_tokens, kTile), cdiv(num_blocks, kTile), 1),)  Block: (kThreads,)
  const uint32_t limit = static_cast<uint32_t>(num_blocks * block_size);
  const unsigned lane = threadIdx.x & 31u;
  const int64_t t0 = int64_t(blockIdx.x) * kTile;
  unsigned long long live = 0, num_alloc = 0;
#pragma unroll 4
  for (int j = 0; j < kItems; ++j) {
    const int64_t i = t0 + j * kThreads + threadIdx.x;  // striped: a warp reads 32 consecutive tokens
    const int32_t blk = token_block(slots, alive, i, num_tokens, limit, static_cast<uint32_t>(block_size));
    const unsigned active = __ballot_sync(0xffffffffu, blk >= 0);
    if (blk >= 0) {
      const unsigned peers = __match_any_sync(active, blk);
      if (lane == static_cast<unsigned>(__ffs(peers) - 1)) atomicAdd(counts + blk, __popc(peers));
      live += allocated == nullptr || allocated[blk] != 0;
    }
  }
  for (int j = 0; j < kItems; ++j) {
    const int64_t b = t0 + j * kThreads + threadIdx.x;
    if (b < num_blocks) num_alloc += allocated == nullptr || allocated[b] != 0;
  }
  finish(acc, waste_ratio, live, num_alloc, block_size);
}

__global__ void __launch_bounds__(kThreads) live_counts_smem_kernel(
    // Inputs
    const int32_t* __restrict__ slots,      // [num_tokens]
    const uint8_t* __restrict__ alive,      // [num_tokens]
    const uint8_t* __restrict__ allocated,  // [num_blocks] or nullptr
    // Outputs
    int32_t* __restrict__ counts,           // [num_blocks], zeroed
    float* __restrict__ waste_ratio,        // []
    unsigned long long* __restrict__ acc,   // [3], zeroed
    // Constants
    int64_t num_tokens, int64_t num_blocks, int64_t block_size) {
  // Grid: (min(cdiv(num_tokens, kTile), 2 * SMs),) grid-stride  Block: (kThreads,)  num_blocks <= kSmemBins
  __shared__ int32_t hist[kSmemBins];
  for (int64_t b = threadIdx.x; b < num_blocks; b += kThreads) hist[b] = 0;
  __syncthreads();
  const uint32_t limit = static_cast<uint32_t>(num_blocks * block_size);
  unsigned long long live = 0, num_alloc = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < num_tokens; i += stride) {
    const int32_t blk = token_block(slots, alive, i, num_tokens, limit, static_cast<uint32_t>(block_size));
    if (blk >= 0) {
      atomicAdd(hist + blk, 1);
      live += allocated == nullptr || allocated[blk] != 0;
    }
  }
  __syncthreads();
  for (int64_t b = threadIdx.x; b < num_blocks; b += kThreads) {
    const int32_t c = hist[b];
    if (c != 0) atomicAdd(counts + b, c);
  }
  for (int64_t b = int64_t(blockIdx.x) * kThreads + threadIdx.x; b < num_blocks; b += stride)
    num_alloc += allocated == nullptr || allocated[b] != 0;
  finish(acc, waste_ratio, live, num_alloc, block_size);
}

}  // namespace

extern "C" int vtoken_block_live_counts_launch(const VtokenBlockLiveCountsArgs* args, void* stream_ptr) {
  const VtokenBlockLiveCountsArgs& a = *args;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaError_t err = cudaSuccess;
  if (a.num_blocks > 0) {
    err = cudaMemsetAsync(a.counts, 0, sizeof(int32_t) * a.num_blocks, stream);
    if (err != cudaSuccess) return err;
  }
  err = cudaMemsetAsync(a.workspace, 0, 3 * sizeof(unsigned long long), stream);
  if (err != cudaSuccess) return err;

  int device = 0, sms = 0;
  err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t smem_grid = imax(1, imin(cdiv(a.num_tokens, kTile), 2 * int64_t(sms)));
  const bool use_smem =
      a.num_blocks <= kSmemBins && a.num_tokens >= kSmemMinTokensPerBin * a.num_blocks * smem_grid;
  if (use_smem) {
    live_counts_smem_kernel<<<static_cast<unsigned>(smem_grid), kThreads, 0, stream>>>(
        a.slots, a.alive, a.allocated, a.counts, a.waste_ratio, a.workspace, a.num_tokens, a.num_blocks,
        a.block_size);
  } else {
    const int64_t grid = imax(imax(cdiv(a.num_tokens, kTile), cdiv(a.num_blocks, kTile)), 1);
    live_counts_global_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
        a.slots, a.alive, a.allocated, a.counts, a.waste_ratio, a.workspace, a.num_tokens, a.num_blocks,
        a.block_size);
  }
  return static_cast<int>(cudaGetLastError());
}
