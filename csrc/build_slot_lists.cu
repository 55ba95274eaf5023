// CUDA build_slot_lists / append_slot_lists. No torch header: the binding
// (csrc/build_slot_lists_binding.cpp) passes raw pointers and the stream.
//
// Semantics and contract: python/vtoken/reference/build_slot_lists.py.
// The launch plans are those of vtoken_kernels/build_slot_lists.py (the
// module docstring there explains the design and its cost):
//   build:  span_count_kernel, then build_slot_lists_kernel with span /
//           request / PAD roles by block index;
//   append: append_stage_kernel, then append_place_kernel.
// Nothing here synchronizes with the host, so both ops are graph-capturable.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "build_slot_lists.h"

namespace {

constexpr int kThreads = 256;
constexpr int kItems = 16;                         // tokens per thread per tile
constexpr int64_t kTile = int64_t(kThreads) * kItems;  // 4096, as BLOCK in Triton
constexpr int64_t kMaxSpans = 1024;
constexpr int64_t kPadBlock = 16384;
constexpr int kMoveItems = 4;                      // in-place move: entries per thread per tile
constexpr int64_t kMoveTile = int64_t(kThreads) * kMoveItems;
constexpr int32_t kPad = -1;

__host__ __device__ inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ inline int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return imin(imax(v, lo), hi); }

template <typename T>
__device__ inline int64_t load64(const T* p, int64_t i) {
  return static_cast<int64_t>(p[i]);
}

struct Plan {
  int64_t num_spans;
  int64_t tiles_per_span;
};

__host__ inline Plan plan_spans(int64_t num_tokens) {
  const int64_t num_tiles = cdiv(num_tokens, kTile);
  if (num_tiles == 0) return {0, 1};
  const int64_t tiles_per_span = cdiv(num_tiles, kMaxSpans);
  return {cdiv(num_tiles, tiles_per_span), tiles_per_span};
}

// Block-wide sum; every thread gets the result. Block-uniform call sites only.
__device__ int64_t block_sum(int64_t v) {
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ int64_t result;
  const int64_t s = Reduce(tmp).Sum(v);
  if (threadIdx.x == 0) result = s;
  __syncthreads();
  const int64_t out = result;
  __syncthreads();  // tmp and result are reused by the next call
  return out;
}

// sum(max(p[0:n], 0)) over the block (span counts or per-request counts).
template <typename T>
__device__ int64_t block_sum_prefix(const T* p, int64_t n) {
  int64_t acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) acc += imax(load64(p, i), 0);
  return block_sum(acc);
}

struct Range {
  int64_t lo, hi;
};

// [lo, hi): the batch's tokens, clamped to [0, num_tokens].
template <typename OffT>
__device__ inline Range batch_bounds(const OffT* off, int64_t num_reqs, int64_t num_tokens) {
  const int64_t lo = clamp64(load64(off, 0), 0, num_tokens);
  return {lo, clamp64(load64(off, num_reqs), lo, num_tokens)};
}

// Request r ends at *end; its last *k tokens are new (clamped to its length).
template <typename OffT, typename CntT>
__device__ inline void request_range(const OffT* off, const CntT* cnt, int64_t r, Range b, int64_t* end, int64_t* k) {
  const int64_t e = clamp64(load64(off, r + 1), b.lo, b.hi);
  const int64_t s = clamp64(load64(off, r), b.lo, e);
  *end = e;
  *k = clamp64(load64(cnt, r), 0, e - s);
}

// Bit j set when token i0 + j is in [lo, hi) and alive.
__device__ inline uint32_t live_bits16(const uint8_t* alive, int64_t i0, int64_t lo, int64_t hi) {
  uint32_t bits = 0;
  if (i0 >= lo && i0 + kItems <= hi && (reinterpret_cast<uintptr_t>(alive + i0) & 15) == 0) {
    const uint4 v = *reinterpret_cast<const uint4*>(alive + i0);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t nz = __vsetne4(w[q], 0u);  // 0x01 in every nonzero byte
      bits |= ((nz & 1u) | ((nz >> 7) & 2u) | ((nz >> 14) & 4u) | ((nz >> 21) & 8u)) << (4 * q);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = i0 + j;
      if (i >= lo && i < hi && alive[i] != 0) bits |= 1u << j;
    }
  }
  return bits;
}

// Packs the live slots of [t0, t0 + kTile) ∩ [lo, hi), in order, to
// out[base...] (entries at >= cap are dropped). Returns the tile's live count
// on every thread. s_buf: kTile int32 of shared memory. Block-uniform calls.
__device__ int64_t compact_tile(const int32_t* __restrict__ slots, const uint8_t* __restrict__ alive, int64_t t0,
                                int64_t lo, int64_t hi, int32_t* out, int64_t base, int64_t cap, int32_t* s_buf) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int64_t i0 = t0 + int64_t(threadIdx.x) * kItems;  // blocked: 16 consecutive tokens per thread
  const uint32_t bits = live_bits16(alive, i0, lo, hi);
  int before = 0, total = 0;
  Scan(scan_tmp).ExclusiveSum(__popc(bits), before, total);
  if (bits == 0xffffu && (reinterpret_cast<uintptr_t>(slots + i0) & 15) == 0) {
    const int4* p = reinterpret_cast<const int4*>(slots + i0);
#pragma unroll
    for (int q = 0; q < kItems / 4; ++q) {
      const int4 v = p[q];
      s_buf[before + 4 * q + 0] = v.x;
      s_buf[before + 4 * q + 1] = v.y;
      s_buf[before + 4 * q + 2] = v.z;
      s_buf[before + 4 * q + 3] = v.w;
    }
  } else if (bits) {
    int w = before;
#pragma unroll
    for (int j = 0; j < kItems; ++j)
      if ((bits >> j) & 1u) s_buf[w++] = slots[i0 + j];
  }
  __syncthreads();
  for (int j = threadIdx.x; j < total; j += kThreads) {  // coalesced write-out
    const int64_t d = base + j;
    if (d < cap) out[d] = s_buf[j];
  }
  __syncthreads();  // s_buf and scan_tmp are reused by the next tile
  return total;
}

// slot_mapping[base + j] = slots[src0 + j] for j < k (dropped at >= max_tokens).
__device__ inline void copy_new_slots(const int32_t* __restrict__ slots, int32_t* slot_mapping, int64_t src0,
                                      int64_t base, int64_t k, int64_t max_tokens) {
  for (int64_t j = threadIdx.x; j < k; j += kThreads) {
    const int64_t d = base + j;
    if (d < max_tokens) slot_mapping[d] = slots[src0 + j];
  }
}

template <typename OffT>
__global__ void __launch_bounds__(kThreads) span_count_kernel(
    // Inputs
    const uint8_t* __restrict__ alive,  // [num_tokens]
    const OffT* __restrict__ offsets,   // [>= num_reqs + 1]
    // Outputs
    int32_t* __restrict__ span_counts,  // [num_spans]
    // Constants
    int64_t num_tokens, int64_t num_reqs, int64_t tiles_per_span) {
  // Grid: (num_spans,)  Block: (kThreads,)
  const Range b = batch_bounds(offsets, num_reqs, num_tokens);
  const int64_t start = int64_t(blockIdx.x) * tiles_per_span * kTile;
  int64_t live = 0;
  for (int64_t t = 0; t < tiles_per_span; ++t)
    live += __popc(live_bits16(alive, start + t * kTile + int64_t(threadIdx.x) * kItems, b.lo, b.hi));
  live = block_sum(live);
  if (threadIdx.x == 0) span_counts[blockIdx.x] = static_cast<int32_t>(live);
}

template <typename OffT, typename CntT>
__global__ void __launch_bounds__(kThreads) build_slot_lists_kernel(
    // Inputs
    const int32_t* __restrict__ slots,        // [num_tokens]
    const uint8_t* __restrict__ alive,        // [num_tokens]
    const OffT* __restrict__ offsets,         // [>= num_reqs + 1]
    const CntT* __restrict__ new_counts,      // [>= num_reqs]
    const int32_t* __restrict__ span_counts,  // [num_spans] (span_count_kernel)
    // Outputs
    int32_t* __restrict__ kv_indices,    // [nnz_max]
    int32_t* __restrict__ kv_indptr,     // [max_reqs + 1]
    int32_t* __restrict__ slot_mapping,  // [max_tokens]
    // Constants
    int64_t num_tokens, int64_t num_reqs, int64_t max_reqs, int64_t nnz_max, int64_t max_tokens, int64_t num_spans,
    int64_t tiles_per_span) {
  // Grid: (num_spans + max_reqs + 1 + cdiv(max(nnz_max, max_tokens), kPadBlock),)  Block: (kThreads,)
  __shared__ int32_t s_buf[kTile];
  const int64_t pid = blockIdx.x;
  const Range b = batch_bounds(offsets, num_reqs, num_tokens);
  const int64_t span_tokens = tiles_per_span * kTile;
  if (pid < num_spans) {
    // Span block: pack the span's live slots after those of earlier spans.
    int64_t base = block_sum_prefix(span_counts, pid);
    for (int64_t t = 0; t < tiles_per_span; ++t)
      base += compact_tile(slots, alive, pid * span_tokens + t * kTile, b.lo, b.hi, kv_indices, base, nnz_max, s_buf);
  } else if (pid <= num_spans + max_reqs) {
    // Request block: kv_indptr[r] = live tokens before offsets[r]; then r's new slots.
    const int64_t r = pid - num_spans;
    const int64_t p = clamp64(load64(offsets, imin(r, num_reqs)), b.lo, b.hi);
    const int64_t span = p / span_tokens;
    int64_t partial = 0;
    for (int64_t i = imax(span * span_tokens, b.lo) + threadIdx.x; i < p; i += kThreads) partial += alive[i] != 0;
    const int64_t before = block_sum_prefix(span_counts, span) + block_sum(partial);
    if (threadIdx.x == 0) kv_indptr[r] = static_cast<int32_t>(imin(before, nnz_max));
    if (r < num_reqs) {
      int64_t end, k;
      request_range(offsets, new_counts, r, b, &end, &k);
      copy_new_slots(slots, slot_mapping, end - k, block_sum_prefix(new_counts, r), k, max_tokens);
    }
  } else {
    // PAD block: the unused tails.
    const int64_t start = (pid - num_spans - max_reqs - 1) * kPadBlock;
    const int64_t total = imin(block_sum_prefix(span_counts, num_spans), nnz_max);
    const int64_t total_new = imin(block_sum_prefix(new_counts, num_reqs), max_tokens);
    for (int64_t i = start + threadIdx.x; i < start + kPadBlock; i += kThreads) {
      if (i >= total && i < nnz_max) kv_indices[i] = kPad;
      if (i >= total_new && i < max_tokens) slot_mapping[i] = kPad;
    }
  }
}

template <typename OffT, typename CntT>
__global__ void __launch_bounds__(kThreads) append_stage_kernel(
    // Inputs
    const uint8_t* __restrict__ alive,     // [num_tokens]
    const OffT* __restrict__ offsets,      // [>= num_reqs + 1]
    const CntT* __restrict__ new_counts,   // [>= num_reqs]
    const int32_t* __restrict__ kv_indices,  // [nnz_max] (previous build)
    const int32_t* __restrict__ kv_indptr,   // [max_reqs + 1] (previous build)
    // Outputs
    int32_t* __restrict__ ws_counts,  // [num_reqs]: live appended tokens per request
    int32_t* __restrict__ ws_indptr,  // [num_reqs + 1]: snapshot of the old kv_indptr
    int32_t* __restrict__ ws_stage,   // [nnz_max]: staged segment heads, at their old positions
    // Constants
    int64_t num_tokens, int64_t num_reqs, int64_t nnz_max) {
  // Grid: (num_reqs + 1,)  Block: (kThreads,)
  const int64_t r = blockIdx.x;
  const int64_t o_r = clamp64(kv_indptr[r], 0, nnz_max);
  if (threadIdx.x == 0) ws_indptr[r] = static_cast<int32_t>(o_r);
  if (r >= num_reqs) return;  // block-uniform
  const Range b = batch_bounds(offsets, num_reqs, num_tokens);
  int64_t end, k;
  request_range(offsets, new_counts, r, b, &end, &k);
  int64_t live = 0;
  for (int64_t j = threadIdx.x; j < k; j += kThreads) live += alive[end - k + j] != 0;
  live = block_sum(live);
  if (threadIdx.x == 0) ws_counts[r] = static_cast<int32_t>(live);
  // NOTE: sum(new_counts[:r]) >= the real shift (it also counts dead appended
  // tokens), so staging that many head entries covers every entry an earlier
  // request's writes can reach before this request reads it.
  const int64_t upper_shift = block_sum_prefix(new_counts, r);
  const int64_t o_next = clamp64(kv_indptr[r + 1], o_r, nnz_max);
  const int64_t stage = imin(upper_shift, o_next - o_r);
  for (int64_t j = threadIdx.x; j < stage; j += kThreads) ws_stage[o_r + j] = kv_indices[o_r + j];
}

template <typename OffT, typename CntT>
__global__ void __launch_bounds__(kThreads) append_place_kernel(
    // Inputs
    const int32_t* __restrict__ slots,       // [num_tokens]
    const uint8_t* __restrict__ alive,       // [num_tokens]
    const OffT* __restrict__ offsets,        // [>= num_reqs + 1]
    const CntT* __restrict__ new_counts,     // [>= num_reqs]
    const int32_t* __restrict__ ws_counts,   // [num_reqs] (append_stage_kernel)
    const int32_t* __restrict__ ws_indptr,   // [num_reqs + 1] (append_stage_kernel)
    const int32_t* __restrict__ ws_stage,    // [nnz_max] (append_stage_kernel)
    // Outputs
    int32_t* kv_indices,                 // [nnz_max], updated in place (read and written: no __restrict__)
    int32_t* __restrict__ kv_indptr,     // [max_reqs + 1]
    int32_t* __restrict__ slot_mapping,  // [max_tokens]
    // Constants
    int64_t num_tokens, int64_t num_reqs, int64_t max_reqs, int64_t nnz_max, int64_t max_tokens) {
  // Grid: (max_reqs + 1 + cdiv(max_tokens, kPadBlock),)  Block: (kThreads,)
  __shared__ int32_t s_buf[kTile];
  const int64_t pid = blockIdx.x;
  if (pid > max_reqs) {
    const int64_t start = (pid - max_reqs - 1) * kPadBlock;
    const int64_t total_new = imin(block_sum_prefix(new_counts, num_reqs), max_tokens);
    for (int64_t i = imax(start, total_new) + threadIdx.x; i < imin(start + kPadBlock, max_tokens); i += kThreads)
      slot_mapping[i] = kPad;
    return;
  }
  const int64_t r = pid;
  const int64_t rr = imin(r, num_reqs);
  const int64_t shift = block_sum_prefix(ws_counts, rr);
  const int64_t o_r = ws_indptr[rr];
  if (threadIdx.x == 0) kv_indptr[r] = static_cast<int32_t>(imin(o_r + shift, nnz_max));
  if (r >= num_reqs) return;  // block-uniform
  const int64_t o_next = imax(ws_indptr[r + 1], o_r);
  const int64_t upper_shift = block_sum_prefix(new_counts, r);
  const int64_t stage = imin(upper_shift, o_next - o_r);
  if (shift > 0) {
    // Unstaged part [first, o_next): in place, last tile first.
    const int64_t first = o_r + stage;
    for (int64_t top = o_next; top > first; top -= kMoveTile) {
      int32_t v[kMoveItems];
#pragma unroll
      for (int q = 0; q < kMoveItems; ++q) {
        const int64_t i = top - kMoveTile + q * kThreads + threadIdx.x;
        v[q] = i >= first ? kv_indices[i] : kPad;
      }
      // NOTE: a store can land on an element another warp has not loaded yet
      // (shift < kMoveTile); lower tiles are never overwritten (right shift).
      __syncthreads();
#pragma unroll
      for (int q = 0; q < kMoveItems; ++q) {
        const int64_t i = top - kMoveTile + q * kThreads + threadIdx.x;
        if (i >= first && i + shift < nnz_max) kv_indices[i + shift] = v[q];
      }
    }
    // Staged head [o_r, first).
    for (int64_t j = threadIdx.x; j < stage; j += kThreads) {
      const int64_t d = o_r + j + shift;
      if (d < nnz_max) kv_indices[d] = ws_stage[o_r + j];
    }
  }
  const Range b = batch_bounds(offsets, num_reqs, num_tokens);
  int64_t end, k;
  request_range(offsets, new_counts, r, b, &end, &k);
  int64_t base = o_next + shift;
  for (int64_t t0 = end - k; t0 < end; t0 += kTile)
    base += compact_tile(slots, alive, t0, end - k, end, kv_indices, base, nnz_max, s_buf);
  copy_new_slots(slots, slot_mapping, end - k, upper_shift, k, max_tokens);
}

template <typename OffT, typename CntT>
cudaError_t launch_build(const VtokenSlotListsArgs& a, cudaStream_t stream) {
  const Plan plan = plan_spans(a.num_tokens);
  const auto* off = static_cast<const OffT*>(a.mirror_offsets);
  const auto* cnt = static_cast<const CntT*>(a.new_token_counts);
  if (plan.num_spans > 0) {
    span_count_kernel<OffT><<<static_cast<unsigned>(plan.num_spans), kThreads, 0, stream>>>(
        a.alive, off, a.workspace, a.num_tokens, a.num_reqs, plan.tiles_per_span);
  }
  const int64_t grid = plan.num_spans + a.max_reqs + 1 + cdiv(imax(a.nnz_max, a.max_tokens), kPadBlock);
  build_slot_lists_kernel<OffT, CntT><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      a.slots, a.alive, off, cnt, a.workspace, a.kv_indices, a.kv_indptr, a.slot_mapping, a.num_tokens, a.num_reqs,
      a.max_reqs, a.nnz_max, a.max_tokens, plan.num_spans, plan.tiles_per_span);
  return cudaGetLastError();
}

template <typename OffT, typename CntT>
cudaError_t launch_append(const VtokenSlotListsArgs& a, cudaStream_t stream) {
  const auto* off = static_cast<const OffT*>(a.mirror_offsets);
  const auto* cnt = static_cast<const CntT*>(a.new_token_counts);
  int32_t* ws_counts = a.workspace;
  int32_t* ws_indptr = ws_counts + imax(a.num_reqs, 1);
  int32_t* ws_stage = ws_indptr + a.num_reqs + 1;
  append_stage_kernel<OffT, CntT><<<static_cast<unsigned>(a.num_reqs + 1), kThreads, 0, stream>>>(
      a.alive, off, cnt, a.kv_indices, a.kv_indptr, ws_counts, ws_indptr, ws_stage, a.num_tokens, a.num_reqs,
      a.nnz_max);
  const int64_t grid = a.max_reqs + 1 + cdiv(a.max_tokens, kPadBlock);
  append_place_kernel<OffT, CntT><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      a.slots, a.alive, off, cnt, ws_counts, ws_indptr, ws_stage, a.kv_indices, a.kv_indptr, a.slot_mapping,
      a.num_tokens, a.num_reqs, a.max_reqs, a.nnz_max, a.max_tokens);
  return cudaGetLastError();
}

using LaunchFn = cudaError_t (*)(const VtokenSlotListsArgs&, cudaStream_t);

template <bool kAppend>
LaunchFn pick(const VtokenSlotListsArgs& a) {
  if (a.offsets_int64) {
    if (a.counts_int64) return kAppend ? launch_append<int64_t, int64_t> : launch_build<int64_t, int64_t>;
    return kAppend ? launch_append<int64_t, int32_t> : launch_build<int64_t, int32_t>;
  }
  if (a.counts_int64) return kAppend ? launch_append<int32_t, int64_t> : launch_build<int32_t, int64_t>;
  return kAppend ? launch_append<int32_t, int32_t> : launch_build<int32_t, int32_t>;
}

}  // namespace

extern "C" int64_t vtoken_build_slot_lists_workspace_size(int64_t num_tokens) {
  return imax(plan_spans(num_tokens).num_spans, 1);
}

extern "C" int64_t vtoken_append_slot_lists_workspace_size(int64_t num_reqs, int64_t nnz_max) {
  return imax(num_reqs, 1) + (num_reqs + 1) + imax(nnz_max, 1);
}

extern "C" int vtoken_build_slot_lists_launch(const VtokenSlotListsArgs* args, void* stream) {
  return static_cast<int>(pick<false>(*args)(*args, static_cast<cudaStream_t>(stream)));
}

extern "C" int vtoken_append_slot_lists_launch(const VtokenSlotListsArgs* args, void* stream) {
  return static_cast<int>(pick<true>(*args)(*args, static_cast<cudaStream_t>(stream)));
}
