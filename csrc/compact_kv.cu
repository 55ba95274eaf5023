// compact_kv: batched live-token relocation across every layer, one launch.
//
// For every move m with both slots valid, copies the bytes of slot
// src_slots[m]'s rows to slot dst_slots[m]'s rows in every layer's cache. The
// copy is a byte copy (any dtype, NaN payloads included), done with the widest
// access (16/8/4/2/1 bytes) that the row length, the strides and every layer's
// base address allow: 16-byte vectors for every realistic layout.
//
// Contract (checked by vtoken.ops.compact_kv behind VTOKEN_DEBUG_INVARIANTS=1 /
// validate=True, not here): the destinations are unique and disjoint from the
// sources, so blocks never race. PAD (-1) or out-of-range slots skip the move,
// so the kernel never touches memory outside the caches and a fixed-size,
// PAD-filled move buffer replays in a CUDA graph.
#include <cuda_runtime.h>

#include <cstdint>

#include "compact_kv_params.h"
#include "vtoken_kernels.h"

namespace vtoken {
namespace {

// Vectors each thread keeps in flight (loads issued before the stores).
constexpr int kUnroll = 4;
constexpr int kMaxThreads = 256;

template <int kBytes>
struct VecOf;
template <>
struct VecOf<16> {
  using type = uint4;
};
template <>
struct VecOf<8> {
  using type = uint2;
};
template <>
struct VecOf<4> {
  using type = unsigned int;
};
template <>
struct VecOf<2> {
  using type = unsigned short;
};
template <>
struct VecOf<1> {
  using type = unsigned char;
};

// Grid: (num_moves * num_layers * chunks,) blocks of blockDim.x threads.
//   Block b copies chunk (b % chunks) of layer ((b / chunks) % num_layers) of
//   move (b / chunks / num_layers): the token's vectors
//   [chunk * blockDim.x * kUnroll, (chunk + 1) * blockDim.x * kUnroll) of its
//   rows_per_token * vecs_per_row, thread t taking every blockDim.x-th one.
// NOTE: the whole block skips a PAD / out-of-range move (uniform branch).
template <int kBytes>
__global__ void __launch_bounds__(kMaxThreads)
    compact_kv_kernel(const __grid_constant__ CompactKVParams p) {
  using Vec = typename VecOf<kBytes>::type;
  const int64_t bid = blockIdx.x;
  const int64_t move_layer = bid / p.chunks;
  const int32_t chunk = static_cast<int32_t>(bid - move_layer * p.chunks);
  const int64_t move = move_layer / p.num_layers;
  const int32_t layer = static_cast<int32_t>(move_layer - move * p.num_layers);

  const int32_t s = p.src_slots[move];
  const int32_t d = p.dst_slots[move];
  if (!compact_kv_slot_valid(p, s) || !compact_kv_slot_valid(p, d)) return;

  char* base = p.layer_base[layer];
  const char* src = base + compact_kv_slot_offset(p, s);
  char* dst = base + compact_kv_slot_offset(p, d);

  const uint32_t first = static_cast<uint32_t>(chunk) * blockDim.x * kUnroll + threadIdx.x;
  Vec buf[kUnroll];
  int64_t off[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint32_t j = first + u * blockDim.x;
    if (j < static_cast<uint32_t>(p.vecs_per_token)) {
      uint32_t row, vec;
      p.vec_div.divmod(j, row, vec);
      off[u] = compact_kv_row_offset(p, row) + static_cast<int64_t>(vec) * kBytes;
      // Streaming loads/stores: each byte is touched once, keep L2 for others.
      buf[u] = __ldcs(reinterpret_cast<const Vec*>(src + off[u]));
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint32_t j = first + u * blockDim.x;
    if (j < static_cast<uint32_t>(p.vecs_per_token)) {
      __stcs(reinterpret_cast<Vec*>(dst + off[u]), buf[u]);
    }
  }
}

template <int kBytes>
int launch(CompactKVParams p, cudaStream_t stream) {
  const int32_t vecs_per_row = p.row_bytes / kBytes;
  p.vec_div = FastDivmod(static_cast<uint32_t>(vecs_per_row));
  const int64_t vecs_per_token = static_cast<int64_t>(p.rows_per_token) * vecs_per_row;
  if (vecs_per_token >= (int64_t{1} << 31)) return static_cast<int>(cudaErrorInvalidValue);
  p.vecs_per_token = static_cast<int32_t>(vecs_per_token);
  // Enough threads that each keeps kUnroll vectors in flight, in whole warps.
  int64_t threads = (vecs_per_token + kUnroll - 1) / kUnroll;
  threads = threads < 32 ? 32 : (threads > kMaxThreads ? kMaxThreads : (threads + 31) / 32 * 32);
  const int64_t per_block = threads * kUnroll;
  p.chunks = static_cast<int32_t>((vecs_per_token + per_block - 1) / per_block);
  const int64_t blocks = p.num_moves * p.num_layers * p.chunks;
  if (blocks >= (int64_t{1} << 31)) return static_cast<int>(cudaErrorInvalidConfiguration);
  compact_kv_kernel<kBytes><<<static_cast<unsigned int>(blocks), static_cast<unsigned int>(threads), 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace
}  // namespace vtoken

extern "C" int vtoken_compact_kv_launch(const vtoken::CompactKVParams* params, void* stream) {
  using vtoken::CompactKVParams;
  const CompactKVParams& p = *params;
  if (p.num_moves == 0 || p.num_layers == 0) return 0;
  if (p.num_layers > vtoken::kCompactKVMaxLayers || p.row_bytes <= 0 || p.rows_per_token <= 0 ||
      p.block_size <= 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (vtoken::compact_kv_vector_bytes(p)) {
    case 16:
      return vtoken::launch<16>(p, s);
    case 8:
      return vtoken::launch<8>(p, s);
    case 4:
      return vtoken::launch<4>(p, s);
    case 2:
      return vtoken::launch<2>(p, s);
    default:
      return vtoken::launch<1>(p, s);
  }
}
