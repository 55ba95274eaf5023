// CUDA build_slot_lists. No torch header: the binding
// (csrc/build_slot_lists_binding.cpp) passes raw pointers and the stream.
//
// Semantics: python/vtoken/reference/build_slot_lists.py; contract:
// vtoken_kernels/contracts.py. The launch plan is that of
// vtoken_kernels/build_slot_lists.py (its module docstring explains the
// design and its cost): the kernels work over the virtual concatenation of the
// batch's mirror ranges, in batch order:
//   batch_prefix_kernel  clamped starts, vstart / kstart prefixes (workspace);
//   span_count_kernel    live tokens per span of virtual positions;
//   build_slot_lists_kernel with span / request / PAD roles by block index.
// Nothing here synchronizes with the host, so the op is graph-capturable.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "build_slot_lists.h"

namespace {

constexpr int kThreads = 256;
constexpr int kItems = 16;                             // virtual positions per thread per tile
constexpr int64_t kTile = int64_t(kThreads) * kItems;  // 4096, as BLOCK in Triton
constexpr int64_t kMaxSpans = 1024;
constexpr int64_t kPadBlock = 16384;
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

__host__ inline Plan plan_spans(int64_t mirror_len) {
  const int64_t num_tiles = cdiv(mirror_len, kTile);
  if (num_tiles == 0) return {0, 1};
  const int64_t tiles_per_span = cdiv(num_tiles, kMaxSpans);
  return {cdiv(num_tiles, tiles_per_span), tiles_per_span};
}

// The batch as the prefix kernel leaves it in the workspace.
struct Batch {
  const int64_t* start;   // [num_reqs]: request r's first mirror position (clamped)
  const int64_t* vstart;  // [num_reqs + 1]: request r's first virtual position; vstart[num_reqs] = L
  const int64_t* kstart;  // [num_reqs + 1]: request r's first slot_mapping entry
  int64_t num_reqs;
};

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

// sum(p[0:n]) over the block (n <= kMaxSpans span counts).
__device__ int64_t block_sum_prefix(const int64_t* p, int64_t n) {
  int64_t acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) acc += p[i];
  return block_sum(acc);
}

// The largest r in [0, num_reqs) with vstart[r] <= v (vstart[0] = 0 <= v).
__device__ inline int64_t locate(const Batch& b, int64_t v) {
  int64_t lo = 0, hi = b.num_reqs;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (b.vstart[mid] <= v) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Bit j set when mirror position i0 + j is in [i0, hi) and alive.
__device__ inline uint32_t live_bits16(const uint8_t* alive, int64_t i0, int64_t hi) {
  uint32_t bits = 0;
  if (i0 + kItems <= hi && (reinterpret_cast<uintptr_t>(alive + i0) & 15) == 0) {
    const uint4 v = *reinterpret_cast<const uint4*>(alive + i0);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t nz = __vsetne4(w[q], 0u);  // 0x01 in every nonzero byte
      bits |= ((nz & 1u) | ((nz >> 7) & 2u) | ((nz >> 14) & 4u) | ((nz >> 21) & 8u)) << (4 * q);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kItems; ++j)
      if (i0 + j < hi && alive[i0 + j] != 0) bits |= 1u << j;
  }
  return bits;
}

// One thread's virtual positions [v0, v0 + count), mapped to the mirror.
struct ThreadItems {
  int64_t req;      // request of v0
  int64_t logical;  // position of v0 within that request
  int count;        // positions below v_end (0..kItems)
  bool single;      // all in `req`: contiguous in the mirror from start[req] + logical
  uint32_t bits;    // bit j: position v0 + j is alive
};

// Calls f(j, mirror position, logical position) for j < count, walking
// request boundaries from items.req on (empty requests are skipped).
template <typename F>
__device__ inline void walk(const Batch& b, const ThreadItems& it, int64_t v0, F f) {
  int64_t r = it.req, rv = b.vstart[r], rnext = b.vstart[r + 1], rs = b.start[r];
  for (int j = 0; j < it.count; ++j) {
    const int64_t v = v0 + j;
    while (v >= rnext) {
      ++r;
      rv = rnext;
      rnext = b.vstart[r + 1];
      rs = b.start[r];
    }
    f(j, rs + (v - rv), v - rv);
  }
}

__device__ ThreadItems map_items(const uint8_t* __restrict__ alive, const Batch& b, int64_t v0, int64_t v_end) {
  ThreadItems it{0, 0, 0, true, 0u};
  if (v0 >= v_end) return it;  // also covers num_reqs == 0 (v_end == 0)
  it.req = locate(b, v0);
  it.logical = v0 - b.vstart[it.req];
  it.count = static_cast<int>(imin(kItems, v_end - v0));
  if (v0 + it.count <= b.vstart[it.req + 1]) {
    const int64_t m0 = b.start[it.req] + it.logical;
    it.bits = live_bits16(alive, m0, m0 + it.count);
  } else {
    it.single = false;
    uint32_t bits = 0;
    walk(b, it, v0, [&](int j, int64_t m, int64_t) {
      if (alive[m] != 0) bits |= 1u << j;
    });
    it.bits = bits;
  }
  return it;
}

// Live tokens among virtual positions [t0, t0 + tiles * kTile) ∩ [., v_end), summed over the block.
__device__ int64_t count_live(const uint8_t* __restrict__ alive, const Batch& b, int64_t t0, int64_t tiles,
                              int64_t v_end) {
  int64_t live = 0;
  for (int64_t t = 0; t < tiles; ++t)
    live += __popc(map_items(alive, b, t0 + t * kTile + int64_t(threadIdx.x) * kItems, v_end).bits);
  return block_sum(live);
}

// Packs the live slots (and their logical positions when kv_pos) of virtual
// positions [t0, t0 + kTile) ∩ [., v_end), in order, to kv_indices[base...]
// (entries at >= cap are dropped). Returns the tile's live count on every
// thread. s_buf / s_pos: kTile int32 of shared memory. Block-uniform calls.
__device__ int64_t compact_tile(const int32_t* __restrict__ slots, const uint8_t* __restrict__ alive, const Batch& b,
                                int64_t t0, int64_t v_end, int32_t* __restrict__ kv_indices,
                                int32_t* __restrict__ kv_pos, int64_t base, int64_t cap, int32_t* s_buf,
                                int32_t* s_pos) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int64_t v0 = t0 + int64_t(threadIdx.x) * kItems;  // blocked: 16 consecutive positions per thread
  const ThreadItems it = map_items(alive, b, v0, v_end);
  int before = 0, total = 0;
  Scan(scan_tmp).ExclusiveSum(__popc(it.bits), before, total);
  if (it.bits && it.single) {
    const int64_t m0 = b.start[it.req] + it.logical;
    if (it.bits == 0xffffu && (reinterpret_cast<uintptr_t>(slots + m0) & 15) == 0) {
      const int4* p = reinterpret_cast<const int4*>(slots + m0);
#pragma unroll
      for (int q = 0; q < kItems / 4; ++q) {
        const int4 v = p[q];
        s_buf[before + 4 * q + 0] = v.x;
        s_buf[before + 4 * q + 1] = v.y;
        s_buf[before + 4 * q + 2] = v.z;
        s_buf[before + 4 * q + 3] = v.w;
      }
      if (kv_pos)
        for (int j = 0; j < kItems; ++j) s_pos[before + j] = static_cast<int32_t>(it.logical + j);
    } else {
      int w = before;
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        if ((it.bits >> j) & 1u) {
          s_buf[w] = slots[m0 + j];
          if (kv_pos) s_pos[w] = static_cast<int32_t>(it.logical + j);
          ++w;
        }
      }
    }
  } else if (it.bits) {
    int w = before;
    walk(b, it, v0, [&](int j, int64_t m, int64_t logical) {
      if ((it.bits >> j) & 1u) {
        s_buf[w] = slots[m];
        if (kv_pos) s_pos[w] = static_cast<int32_t>(logical);
        ++w;
      }
    });
  }
  __syncthreads();
  for (int j = threadIdx.x; j < total; j += kThreads) {  // coalesced write-out
    const int64_t d = base + j;
    if (d < cap) {
      kv_indices[d] = s_buf[j];
      if (kv_pos) kv_pos[d] = s_pos[j];
    }
  }
  __syncthreads();  // s_buf, s_pos and scan_tmp are reused by the next tile
  return total;
}

template <typename LenT, typename CntT>
__global__ void __launch_bounds__(kThreads) batch_prefix_kernel(
    // Inputs
    const int64_t* __restrict__ starts,      // [>= num_reqs]
    const LenT* __restrict__ num_tokens,     // [>= num_reqs]
    const CntT* __restrict__ new_counts,     // [>= num_reqs]
    // Outputs
    int64_t* __restrict__ ws_start,   // [num_reqs]: starts clamped into [0, mirror_len]
    int64_t* __restrict__ ws_vstart,  // [num_reqs + 1]: exclusive prefix of the clamped token counts
    int64_t* __restrict__ ws_kstart,  // [num_reqs + 1]: exclusive prefix of the clamped new-token counts
    // Constants
    int64_t mirror_len, int64_t num_reqs) {
  // Grid: (1,)  Block: (kThreads,)
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  if (threadIdx.x == 0) ws_vstart[0] = ws_kstart[0] = 0;
  int64_t carry_v = 0, carry_k = 0;
  for (int64_t c = 0; c < num_reqs; c += kThreads) {
    const int64_t i = c + threadIdx.x;
    int64_t n = 0, k = 0;
    if (i < num_reqs) {
      const int64_t s = clamp64(starts[i], 0, mirror_len);
      n = clamp64(load64(num_tokens, i), 0, mirror_len - s);
      k = clamp64(load64(new_counts, i), 0, n);
      ws_start[i] = s;
    }
    int64_t incl_v = 0, total_v = 0, incl_k = 0, total_k = 0;
    Scan(tmp).InclusiveSum(n, incl_v, total_v);
    __syncthreads();  // tmp is reused
    Scan(tmp).InclusiveSum(k, incl_k, total_k);
    __syncthreads();
    if (i < num_reqs) {
      ws_vstart[i + 1] = carry_v + incl_v;
      ws_kstart[i + 1] = carry_k + incl_k;
    }
    carry_v += total_v;
    carry_k += total_k;
  }
}

__global__ void __launch_bounds__(kThreads) span_count_kernel(
    // Inputs
    const uint8_t* __restrict__ alive,   // [mirror_len]
    const int64_t* __restrict__ start,   // [num_reqs] (batch_prefix_kernel)
    const int64_t* __restrict__ vstart,  // [num_reqs + 1] (batch_prefix_kernel)
    // Outputs
    int64_t* __restrict__ span_counts,   // [num_spans]
    // Constants
    int64_t num_reqs, int64_t tiles_per_span) {
  // Grid: (num_spans,)  Block: (kThreads,)
  const Batch b{start, vstart, nullptr, num_reqs};
  const int64_t live = count_live(alive, b, int64_t(blockIdx.x) * tiles_per_span * kTile, tiles_per_span,
                                  vstart[num_reqs]);
  if (threadIdx.x == 0) span_counts[blockIdx.x] = live;
}

__global__ void __launch_bounds__(kThreads) build_slot_lists_kernel(
    // Inputs
    const int32_t* __restrict__ slots,        // [mirror_len]
    const uint8_t* __restrict__ alive,        // [mirror_len]
    const int64_t* __restrict__ start,        // [num_reqs] (batch_prefix_kernel)
    const int64_t* __restrict__ vstart,       // [num_reqs + 1] (batch_prefix_kernel)
    const int64_t* __restrict__ kstart,       // [num_reqs + 1] (batch_prefix_kernel)
    const int64_t* __restrict__ span_counts,  // [num_spans] (span_count_kernel)
    // Outputs
    int32_t* __restrict__ kv_indices,    // [nnz_max]
    int32_t* __restrict__ kv_indptr,     // [max_reqs + 1]
    int32_t* __restrict__ slot_mapping,  // [max_tokens]
    int32_t* __restrict__ kv_pos,        // [nnz_max] or nullptr
    // Constants
    int64_t num_reqs, int64_t max_reqs, int64_t nnz_max, int64_t max_tokens, int64_t num_spans,
    int64_t tiles_per_span) {
  // Grid: (num_spans + max_reqs + 1 + cdiv(max(nnz_max, max_tokens), kPadBlock),)  Block: (kThreads,)
  __shared__ int32_t s_buf[kTile];
  __shared__ int32_t s_pos[kTile];
  const int64_t pid = blockIdx.x;
  const Batch b{start, vstart, kstart, num_reqs};
  const int64_t span_tokens = tiles_per_span * kTile;
  const int64_t v_end = vstart[num_reqs];
  if (pid < num_spans) {
    // Span block: pack the span's live slots after those of earlier spans.
    int64_t base = block_sum_prefix(span_counts, pid);
    for (int64_t t = 0; t < tiles_per_span; ++t)
      base += compact_tile(slots, alive, b, pid * span_tokens + t * kTile, v_end, kv_indices, kv_pos, base, nnz_max,
                           s_buf, s_pos);
  } else if (pid <= num_spans + max_reqs) {
    // Request block: kv_indptr[r] = live tokens before vstart[r]; then r's new slots.
    // NOTE: clamped to the spans' coverage: only overlapping ranges (a contract
    // violation) make the batch longer than the mirror.
    const int64_t r = pid - num_spans;
    const int64_t v = imin(vstart[imin(r, num_reqs)], num_spans * span_tokens);
    const int64_t span = v / span_tokens;
    const int64_t before = block_sum_prefix(span_counts, span) + count_live(alive, b, span * span_tokens,
                                                                            tiles_per_span, v);
    if (threadIdx.x == 0) kv_indptr[r] = static_cast<int32_t>(imin(before, nnz_max));
    if (r < num_reqs) {
      const int64_t k0 = kstart[r], k = kstart[r + 1] - k0;
      const int64_t src0 = start[r] + (vstart[r + 1] - vstart[r]) - k;
      for (int64_t j = threadIdx.x; j < k; j += kThreads)
        if (k0 + j < max_tokens) slot_mapping[k0 + j] = slots[src0 + j];
    }
  } else {
    // PAD block: the unused tails.
    const int64_t first = (pid - num_spans - max_reqs - 1) * kPadBlock;
    const int64_t total = imin(block_sum_prefix(span_counts, num_spans), nnz_max);
    const int64_t total_new = imin(kstart[num_reqs], max_tokens);
    for (int64_t i = first + threadIdx.x; i < first + kPadBlock; i += kThreads) {
      if (i >= total && i < nnz_max) {
        kv_indices[i] = kPad;
        if (kv_pos) kv_pos[i] = kPad;
      }
      if (i >= total_new && i < max_tokens) slot_mapping[i] = kPad;
    }
  }
}

template <typename LenT, typename CntT>
void launch_prefix(const VtokenSlotListsArgs& a, int64_t* ws_start, int64_t* ws_vstart, int64_t* ws_kstart,
                   cudaStream_t stream) {
  batch_prefix_kernel<LenT, CntT><<<1, kThreads, 0, stream>>>(
      a.mirror_starts, static_cast<const LenT*>(a.num_tokens), static_cast<const CntT*>(a.new_token_counts), ws_start,
      ws_vstart, ws_kstart, a.mirror_len, a.num_reqs);
}

}  // namespace

extern "C" int64_t vtoken_build_slot_lists_workspace_size(int64_t mirror_len, int64_t num_reqs) {
  return imax(num_reqs, 1) + 2 * (num_reqs + 1) + imax(plan_spans(mirror_len).num_spans, 1);
}

extern "C" int vtoken_build_slot_lists_launch(const VtokenSlotListsArgs* args, void* stream_ptr) {
  const VtokenSlotListsArgs& a = *args;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const Plan plan = plan_spans(a.mirror_len);
  int64_t* ws_start = a.workspace;
  int64_t* ws_vstart = ws_start + imax(a.num_reqs, 1);
  int64_t* ws_kstart = ws_vstart + a.num_reqs + 1;
  int64_t* span_counts = ws_kstart + a.num_reqs + 1;
  if (a.num_tokens_int64) {
    if (a.counts_int64) launch_prefix<int64_t, int64_t>(a, ws_start, ws_vstart, ws_kstart, stream);
    else launch_prefix<int64_t, int32_t>(a, ws_start, ws_vstart, ws_kstart, stream);
  } else {
    if (a.counts_int64) launch_prefix<int32_t, int64_t>(a, ws_start, ws_vstart, ws_kstart, stream);
    else launch_prefix<int32_t, int32_t>(a, ws_start, ws_vstart, ws_kstart, stream);
  }
  if (plan.num_spans > 0) {
    span_count_kernel<<<static_cast<unsigned>(plan.num_spans), kThreads, 0, stream>>>(
        a.alive, ws_start, ws_vstart, span_counts, a.num_reqs, plan.tiles_per_span);
  }
  const int64_t grid = plan.num_spans + a.max_reqs + 1 + cdiv(imax(a.nnz_max, a.max_tokens), kPadBlock);
  build_slot_lists_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      a.slots, a.alive, ws_start, ws_vstart, ws_kstart, span_counts, a.kv_indices, a.kv_indptr, a.slot_mapping,
      a.kv_pos, a.num_reqs, a.max_reqs, a.nnz_max, a.max_tokens, plan.num_spans, plan.tiles_per_span);
  return static_cast<int>(cudaGetLastError());
}
