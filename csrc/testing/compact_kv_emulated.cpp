// Test-only ops for compact_kv, never part of the shipped vtoken._C
// (csrc/build_ext.py compiles csrc/*.cpp, not this directory). The tests build
// them into a small CPU extension of their own (tests/test_compact_kv.py,
// torch.utils.cpp_extension.load) and call them as torch.ops.vtoken_testing.*:
//
//   compact_kv_cuda_emulated(Tensor(a!)[] kv_caches, Tensor src_slots, Tensor dst_slots,
//                            <the int layout args of vtoken::compact_kv>) -> ()
//   compact_kv_cuda_config(Tensor[] kv_caches, Tensor src_slots, Tensor dst_slots,
//                          <the int layout args of vtoken::compact_kv>) -> int[]
//
// They run the CUDA kernel's index math (csrc/compact_kv_params.h) on CPU
// tensors, with the argument checks and parameters of the real op
// (csrc/compact_kv_args.h), so CI verifies the CUDA kernel's addressing
// without a GPU.
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "compact_kv_args.h"
#include "compact_kv_params.h"

namespace vtoken {
namespace {

// The CUDA kernel's index math run on the CPU, thread by thread: the grid
// from compact_kv_configure(), the per-thread vector numbering and
// compact_kv_vector_offset(), one memcpy of vec_bytes per vector. Every access
// is also checked for vec_bytes alignment (a misaligned vector access faults
// on the GPU). Test-only: it lets CI verify the CUDA kernel's addressing
// without a GPU.
void compact_kv_cuda_emulated(at::TensorList kv_caches, const at::Tensor& src_slots, const at::Tensor& dst_slots,
                              int64_t num_blocks, int64_t block_size, int64_t num_kv, int64_t num_heads,
                              int64_t head_dim, int64_t stride_block, int64_t stride_offset, int64_t stride_kv,
                              int64_t stride_head) {
  const LayoutArgs a{num_blocks, block_size, num_kv, num_heads, head_dim,
                     stride_block, stride_offset, stride_kv, stride_head};
  check_args(kv_caches, src_slots, dst_slots, a);
  const int64_t num_moves = src_slots.numel();
  if (num_moves == 0) return;
  CompactKVParams p = make_params(kv_caches[0], num_moves, a);
  p.src_slots = src_slots.data_ptr<int32_t>();
  p.dst_slots = dst_slots.data_ptr<int32_t>();
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  for (int64_t first_layer = 0; first_layer < num_layers; first_layer += kCompactKVMaxLayers) {
    p.num_layers = static_cast<int32_t>(std::min<int64_t>(kCompactKVMaxLayers, num_layers - first_layer));
    for (int32_t l = 0; l < p.num_layers; ++l) {
      p.layer_base[l] = static_cast<char*>(kv_caches[first_layer + l].data_ptr());
    }
    CompactKVLaunch launch{};
    TORCH_CHECK(compact_kv_configure(p, launch), "compact_kv: too many vectors for one launch");
    const uint32_t total = static_cast<uint32_t>(p.vecs_per_move);
    const uint32_t threads = static_cast<uint32_t>(launch.threads);
    for (int64_t block = 0; block < launch.blocks; ++block) {  // blockIdx.x
      const uint32_t move = static_cast<uint32_t>(block) / static_cast<uint32_t>(p.chunks);
      const uint32_t chunk = static_cast<uint32_t>(block) - move * static_cast<uint32_t>(p.chunks);
      const int32_t s = p.src_slots[move], d = p.dst_slots[move];
      if (!compact_kv_slot_valid(p, s) || !compact_kv_slot_valid(p, d)) continue;
      const int64_t s_off = compact_kv_slot_offset(p, s), d_off = compact_kv_slot_offset(p, d);
      for (uint32_t tid = 0; tid < threads; ++tid) {  // threadIdx.x
        const uint32_t first = chunk * threads * kCompactKVUnroll + tid;
        for (int u = 0; u < kCompactKVUnroll; ++u) {
          const uint32_t j = first + u * threads;
          if (j >= total) continue;
          uint32_t layer;
          const int64_t off = compact_kv_vector_offset(p, j, layer);
          const char* from = p.layer_base[layer] + s_off + off;
          char* to = p.layer_base[layer] + d_off + off;
          TORCH_CHECK(reinterpret_cast<uintptr_t>(from) % p.vec_bytes == 0 &&
                          reinterpret_cast<uintptr_t>(to) % p.vec_bytes == 0,
                      "compact_kv: misaligned ", p.vec_bytes, "-byte access (emulated CUDA kernel)");
          std::memcpy(to, from, static_cast<size_t>(p.vec_bytes));
        }
      }
    }
  }
}

// Launch shape the CUDA kernel would use (vec_bytes, threads, blocks) for
// these caches; test-only, for checking the access-width choice on CPU.
std::vector<int64_t> compact_kv_cuda_config(at::TensorList kv_caches, const at::Tensor& src_slots,
                                            const at::Tensor& dst_slots, int64_t num_blocks, int64_t block_size,
                                            int64_t num_kv, int64_t num_heads, int64_t head_dim,
                                            int64_t stride_block, int64_t stride_offset, int64_t stride_kv,
                                            int64_t stride_head) {
  const LayoutArgs a{num_blocks, block_size, num_kv, num_heads, head_dim,
                     stride_block, stride_offset, stride_kv, stride_head};
  check_args(kv_caches, src_slots, dst_slots, a);
  CompactKVParams p = make_params(kv_caches[0], src_slots.numel(), a);
  p.num_layers = static_cast<int32_t>(std::min<int64_t>(kCompactKVMaxLayers, kv_caches.size()));
  for (int32_t l = 0; l < p.num_layers; ++l) p.layer_base[l] = static_cast<char*>(kv_caches[l].data_ptr());
  CompactKVLaunch launch{};
  TORCH_CHECK(compact_kv_configure(p, launch), "compact_kv: too many vectors for one launch");
  return {p.vec_bytes, launch.threads, launch.blocks};
}

}  // namespace
}  // namespace vtoken

TORCH_LIBRARY(vtoken_testing, m) {
  m.def(
      "compact_kv_cuda_emulated(Tensor(a!)[] kv_caches, Tensor src_slots, Tensor dst_slots, int num_blocks, "
      "int block_size, int num_kv, int num_heads, int head_dim, int stride_block, int stride_offset, "
      "int stride_kv, int stride_head) -> ()");
  m.def(
      "compact_kv_cuda_config(Tensor[] kv_caches, Tensor src_slots, Tensor dst_slots, int num_blocks, "
      "int block_size, int num_kv, int num_heads, int head_dim, int stride_block, int stride_offset, "
      "int stride_kv, int stride_head) -> int[]");
}

TORCH_LIBRARY_IMPL(vtoken_testing, CPU, m) {
  m.impl("compact_kv_cuda_emulated", &vtoken::compact_kv_cuda_emulated);
  m.impl("compact_kv_cuda_config", &vtoken::compact_kv_cuda_config);
}
