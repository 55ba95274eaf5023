// compact_kv: batched live-token relocation across every layer, one launch.
//
// For every move m with both slots valid, copies the bytes of slot
// src_slots[m]'s rows to slot dst_slots[m]'s rows in every layer's cache. The
// copy is a byte copy (any dtype, NaN payloads included), done with the widest
// access (16/8/4/2/1 bytes) that the row length, the strides and every layer's
// base address allow: 16-byte vectors for every realistic layout.
//
// Contract (checked by vtoken.device.ops.compact_kv behind VTOKEN_DEBUG_INVARIANTS=1 /
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

// Grid: (num_moves * chunks,) blocks of `threads` (compact_kv_configure()).
//   Block b copies chunk (b % chunks) of move (b / chunks): the move's vectors
//   j in [chunk * threads * kUnroll, (chunk + 1) * threads * kUnroll), thread t
//   taking j = first + u * threads (u < kUnroll), where j enumerates every
//   (layer, row, vector) of the token (compact_kv_vector_offset()).
// NOTE: a PAD / out-of-range move returns for the whole block (uniform branch).
// csrc/compact_kv_binding.cpp (_compact_kv_cuda_emulated) runs this exact
// index math on the CPU so CI checks it without a GPU.
template <int kBytes>
__global__ void __launch_bounds__(kCompactKVMaxThreads)
    compact_kv_kernel(const __grid_constant__ CompactKVParams p) {
  using Vec = typename VecOf<kBytes>::type;
  const uint32_t move = blockIdx.x / static_cast<uint32_t>(p.chunks);
  const uint32_t chunk = blockIdx.x - move * static_cast<uint32_t>(p.chunks);
  const int32_t s = p.src_slots[move];
  const int32_t d = p.dst_slots[move];
  if (!compact_kv_slot_valid(p, s) || !compact_kv_slot_valid(p, d)) return;
  const int64_t s_off = compact_kv_slot_offset(p, s);
  const int64_t d_off = compact_kv_slot_offset(p, d);

  const uint32_t first = chunk * blockDim.x * kCompactKVUnroll + threadIdx.x;
  const uint32_t total = static_cast<uint32_t>(p.vecs_per_move);
  Vec buf[kCompactKVUnroll];
  char* dst[kCompactKVUnroll];
#pragma unroll
  for (int u = 0; u < kCompactKVUnroll; ++u) {
    const uint32_t j = first + u * blockDim.x;
    if (j < total) {
      uint32_t layer;
      const int64_t off = compact_kv_vector_offset(p, j, layer);
      char* base = p.layer_base[layer];
      // Streaming loads/stores: each byte is touched once, keep L2 for others.
      buf[u] = __ldcs(reinterpret_cast<const Vec*>(base + s_off + off));
      dst[u] = base + d_off + off;
    }
  }
#pragma unroll
  for (int u = 0; u < kCompactKVUnroll; ++u) {
    if (first + u * blockDim.x < total) __stcs(reinterpret_cast<Vec*>(dst[u]), buf[u]);
  }
}

template <int kBytes>
int launch(const CompactKVParams& p, const CompactKVLaunch& config, cudaStream_t stream) {
  compact_kv_kernel<kBytes><<<static_cast<unsigned int>(config.blocks), config.threads, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace
}  // namespace vtoken

extern "C" int vtoken_compact_kv_launch(const vtoken::CompactKVParams* params, void* stream) {
  vtoken::CompactKVParams p = *params;
  if (p.num_moves == 0 || p.num_layers == 0) return 0;
  if (p.num_layers > vtoken::kCompactKVMaxLayers || p.row_bytes <= 0 || p.rows_per_token <= 0 ||
      p.block_size <= 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  vtoken::CompactKVLaunch config;
  if (!vtoken::compact_kv_configure(p, config)) return static_cast<int>(cudaErrorInvalidConfiguration);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.vec_bytes) {
    case 16:
      return vtoken::launch<16>(p, config, s);
    case 8:
      return vtoken::launch<8>(p, config, s);
    case 4:
      return vtoken::launch<4>(p, config, s);
    case 2:
      return vtoken::launch<2>(p, config, s);
    default:
      return vtoken::launch<1>(p, config, s);
  }
}
