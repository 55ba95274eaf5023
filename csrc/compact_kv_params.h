// compact_kv: kernel parameters and the addressing shared by the CUDA kernel
// (csrc/compact_kv.cu) and the C++ CPU kernel (csrc/compact_kv_binding.cpp).
//
// Plain C++ (no torch, no CUDA runtime headers), so that the index math the
// GPU runs is the same code CI exercises through the CPU op.
//
// Addressing (all in bytes). Slot s of layer l starts at
//   layer_base[l] + (s / block_size) * stride_block + (s % block_size) * stride_offset
// and the token is `rows_per_token` contiguous rows of `row_bytes` bytes; row r
// sits at
//   (r / n_inner) * stride_outer + (r % n_inner) * stride_inner
// from the slot start. compact_kv_rows() folds a KVLayout's (kv, head, dim)
// strides into that form, merging dims that are contiguous, e.g. one row of
// 2*H*D elements for vLLM's fused [num_blocks, H, block_size, 2*D] layout and
// two rows (K, V) of H*D elements for FlashInfer NHD.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define VTOKEN_HD __host__ __device__ __forceinline__
#else
#define VTOKEN_HD inline
#endif

namespace vtoken {

// Division by a runtime constant with a multiply and a shift
// (round-up method, Granlund & Montgomery 1994): for 0 <= n < 2^31 and
// 1 <= d < 2^31, q = (n * m) >> (31 + ceil(log2 d)) with m = ceil(2^shift / d).
// NOTE: m < 2^32 because d > 2^(ceil(log2 d) - 1); the error term
// n * (m*d - 2^shift) / (d * 2^shift) < 1/d keeps the floor exact.
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 1u << 31;
  uint32_t shift = 31;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    uint32_t log2_ceil = 0;
    while ((uint64_t{1} << log2_ceil) < d) ++log2_ceil;
    shift = 31 + log2_ceil;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << shift) + d - 1) / d);
  }
  VTOKEN_HD uint32_t div(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(n) * multiplier) >> shift);
  }
  VTOKEN_HD void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * divisor;
  }
};

// Layers per launch: the per-layer base pointers travel by value in the
// kernel's parameter buffer (2 KiB of the 4 KiB limit), so the launch needs no
// device-side pointer array, no H2D copy, and replays in a CUDA graph. Models
// with more layers take ceil(L / 256) launches.
constexpr int kCompactKVMaxLayers = 256;

struct CompactKVParams {
  // Inputs
  const int32_t* src_slots;  // [num_moves]
  const int32_t* dst_slots;  // [num_moves]
  // Constants
  int64_t num_moves;
  int64_t num_slots;      // num_blocks * block_size; slots outside [0, num_slots) are skipped
  int64_t stride_block;   // bytes
  int64_t stride_offset;  // bytes
  int64_t stride_outer;   // bytes
  int64_t stride_inner;   // bytes
  int32_t block_size;
  int32_t rows_per_token;
  int32_t row_bytes;
  int32_t num_layers;     // <= kCompactKVMaxLayers
  FastDivmod inner_div;   // by n_inner (rows of the inner dim)
  // Set by compact_kv_configure() for the CUDA kernel.
  int32_t vec_bytes;      // access width: 16, 8, 4, 2 or 1
  int32_t vecs_per_move;  // num_layers * rows_per_token * vectors per row
  int32_t chunks;         // blocks per move
  FastDivmod layer_div;   // by vectors per (token, layer)
  FastDivmod vec_div;     // by vectors per row
  // Outputs (in place)
  char* layer_base[kCompactKVMaxLayers];  // layer l's cache, element (0, 0, 0, 0, 0)
};

// CUDA launch shape: compact_kv_kernel<vec_bytes><<<blocks, threads>>>.
struct CompactKVLaunch {
  int64_t blocks;
  int32_t threads;
};

// Vectors each thread keeps in flight (all loads issued before the stores).
constexpr int kCompactKVUnroll = 4;
constexpr int kCompactKVMaxThreads = 256;

// Byte offset of row `r` of a token from the token's slot start.
VTOKEN_HD int64_t compact_kv_row_offset(const CompactKVParams& p, uint32_t r) {
  uint32_t outer, inner;
  p.inner_div.divmod(r, outer, inner);
  return static_cast<int64_t>(outer) * p.stride_outer + static_cast<int64_t>(inner) * p.stride_inner;
}

// Byte offset of slot `s` (0 <= s < num_slots) from a layer's base.
VTOKEN_HD int64_t compact_kv_slot_offset(const CompactKVParams& p, int32_t s) {
  const int32_t block = s / p.block_size;
  const int32_t offset = s - block * p.block_size;
  return static_cast<int64_t>(block) * p.stride_block + static_cast<int64_t>(offset) * p.stride_offset;
}

VTOKEN_HD bool compact_kv_slot_valid(const CompactKVParams& p, int32_t s) {
  return s >= 0 && s < p.num_slots;
}

// A token's rows in canonical form (elements).
struct CompactKVRows {
  int64_t row_elems;
  int64_t rows;
  int64_t n_inner;
  int64_t stride_outer;
  int64_t stride_inner;
};

// Fold the (kv, head) dims of a KVLayout into at most two row dims over
// contiguous rows (see the file comment). Strides are in elements, >= 0.
inline CompactKVRows compact_kv_rows(int64_t num_kv, int64_t stride_kv, int64_t num_heads,
                                     int64_t stride_head, int64_t head_dim) {
  struct Dim {
    int64_t n, s;
  } dims[2];
  int nd = 0;
  if (num_kv > 1) dims[nd++] = {num_kv, stride_kv};
  if (num_heads > 1) dims[nd++] = {num_heads, stride_head};
  if (nd == 2 && dims[0].s < dims[1].s) {
    const Dim t = dims[0];
    dims[0] = dims[1];
    dims[1] = t;
  }
  int64_t row = head_dim;
  while (nd > 0 && dims[nd - 1].s == row) {  // inner dim continues the row
    row *= dims[nd - 1].n;
    --nd;
  }
  if (nd == 2 && dims[0].s == dims[1].n * dims[1].s) {  // two dims of one stride
    dims[1].n *= dims[0].n;
    dims[0] = dims[1];
    nd = 1;
  }
  if (nd == 0) return {row, 1, 1, 0, 0};
  if (nd == 1) return {row, dims[0].n, dims[0].n, 0, dims[0].s};
  return {row, dims[0].n * dims[1].n, dims[1].n, dims[0].s, dims[1].s};
}

// Widest power-of-two access (<= 16 bytes) that every row start and the row
// length are multiples of, for every layer.
inline int compact_kv_vector_bytes(const CompactKVParams& p) {
  uint64_t bits = static_cast<uint64_t>(p.row_bytes) | static_cast<uint64_t>(p.stride_block) |
                  static_cast<uint64_t>(p.stride_offset) | static_cast<uint64_t>(p.stride_outer) |
                  static_cast<uint64_t>(p.stride_inner) | 16u;
  for (int l = 0; l < p.num_layers; ++l) bits |= reinterpret_cast<uintptr_t>(p.layer_base[l]);
  int v = 1;
  while (v < 16 && !(bits & static_cast<uint64_t>(v))) v <<= 1;
  return v;
}

// Pick the access width and the grid for the layers in `p` (host side), and
// fill the derived fields of `p`. Returns false when the sizes overflow the
// kernel's 32-bit vector index or grid.
//
// Grid: one move's vectors (every layer, row and vector of the token) are
// numbered j = (layer * rows_per_token + row) * vecs_per_row + vec and split
// into `chunks` blocks of threads * kUnroll vectors, so small tokens (MLA, few
// heads) still fill whole blocks across layers.
inline bool compact_kv_configure(CompactKVParams& p, CompactKVLaunch& launch) {
  p.vec_bytes = compact_kv_vector_bytes(p);
  const int64_t vecs_per_row = p.row_bytes / p.vec_bytes;
  const int64_t vecs_per_layer = vecs_per_row * p.rows_per_token;
  const int64_t vecs_per_move = vecs_per_layer * p.num_layers;
  if (vecs_per_move >= (int64_t{1} << 31)) return false;
  p.vecs_per_move = static_cast<int32_t>(vecs_per_move);
  p.vec_div = FastDivmod(static_cast<uint32_t>(vecs_per_row));
  p.layer_div = FastDivmod(static_cast<uint32_t>(vecs_per_layer));
  // Enough threads that each keeps kUnroll vectors in flight, in whole warps.
  int64_t threads = (vecs_per_move + kCompactKVUnroll - 1) / kCompactKVUnroll;
  threads = threads > kCompactKVMaxThreads ? kCompactKVMaxThreads : (threads + 31) / 32 * 32;
  const int64_t per_block = threads * kCompactKVUnroll;
  p.chunks = static_cast<int32_t>((vecs_per_move + per_block - 1) / per_block);
  launch.threads = static_cast<int32_t>(threads);
  launch.blocks = p.num_moves * p.chunks;
  return launch.blocks < (int64_t{1} << 31);
}

// Vector j of a move (0 <= j < vecs_per_move): its layer, and its byte offset
// from the slot's start in that layer.
VTOKEN_HD int64_t compact_kv_vector_offset(const CompactKVParams& p, uint32_t j, uint32_t& layer) {
  uint32_t in_layer, row, vec;
  p.layer_div.divmod(j, layer, in_layer);
  p.vec_div.divmod(in_layer, row, vec);
  return compact_kv_row_offset(p, row) + static_cast<int64_t>(vec) * p.vec_bytes;
}

}  // namespace vtoken
