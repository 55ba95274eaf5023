// torch binding of compact_kv: schema, C++ CPU kernel, CUDA launcher call and
// Meta (fake) kernel. See vtoken.device.ops.compact_kv for the public API and
// csrc/compact_kv.cu for the CUDA kernel.
//
// Schema:
//   vtoken::compact_kv(Tensor(a!)[] kv_caches, Tensor src_slots, Tensor dst_slots,
//                      int num_blocks, int block_size, int num_kv, int num_heads,
//                      int head_dim, int stride_block, int stride_offset,
//                      int stride_kv, int stride_head) -> ()
// The ints are the fields of vtoken.layout.KVLayout (strides in elements).
// The slot contract (unique destinations, disjoint from the sources) is the
// caller's; PAD (-1) and out-of-range slots skip the move.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "compact_kv_args.h"
#include "compact_kv_params.h"
#include "torch_utils.h"
#include "vtoken_kernels.h"

namespace vtoken {
namespace {

void compact_kv_cpu(at::TensorList kv_caches, const at::Tensor& src_slots, const at::Tensor& dst_slots,
                    int64_t num_blocks, int64_t block_size, int64_t num_kv, int64_t num_heads, int64_t head_dim,
                    int64_t stride_block, int64_t stride_offset, int64_t stride_kv, int64_t stride_head) {
  const LayoutArgs a{num_blocks, block_size, num_kv, num_heads, head_dim,
                     stride_block, stride_offset, stride_kv, stride_head};
  check_args(kv_caches, src_slots, dst_slots, a);
  const int64_t num_moves = src_slots.numel();
  if (num_moves == 0) return;
  const CompactKVParams p = make_params(kv_caches[0], num_moves, a);
  std::vector<char*> bases;
  bases.reserve(kv_caches.size());
  for (const at::Tensor& t : kv_caches) bases.push_back(static_cast<char*>(t.data_ptr()));
  const int32_t* src = src_slots.data_ptr<int32_t>();
  const int32_t* dst = dst_slots.data_ptr<int32_t>();
  const size_t row_bytes = static_cast<size_t>(p.row_bytes);
  // NOTE: moves run in parallel; the contract (destinations unique and
  // disjoint from the sources) makes them independent.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (row_bytes * p.rows_per_token * bases.size() + 1));
  at::parallel_for(0, num_moves, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int32_t s = src[m], d = dst[m];
      if (!compact_kv_slot_valid(p, s) || !compact_kv_slot_valid(p, d)) continue;
      const int64_t s_off = compact_kv_slot_offset(p, s), d_off = compact_kv_slot_offset(p, d);
      for (char* base : bases) {
        for (int32_t r = 0; r < p.rows_per_token; ++r) {
          const int64_t r_off = compact_kv_row_offset(p, static_cast<uint32_t>(r));
          std::memcpy(base + d_off + r_off, base + s_off + r_off, row_bytes);
        }
      }
    }
  });
}

void compact_kv_cuda(at::TensorList kv_caches, const at::Tensor& src_slots, const at::Tensor& dst_slots,
                     int64_t num_blocks, int64_t block_size, int64_t num_kv, int64_t num_heads, int64_t head_dim,
                     int64_t stride_block, int64_t stride_offset, int64_t stride_kv, int64_t stride_head) {
  const LayoutArgs a{num_blocks, block_size, num_kv, num_heads, head_dim,
                     stride_block, stride_offset, stride_kv, stride_head};
  check_args(kv_caches, src_slots, dst_slots, a);
  const int64_t num_moves = src_slots.numel();
  if (num_moves == 0) return;
  const c10::Device device = kv_caches[0].device();
  c10::DeviceGuard guard(device);
  void* stream = current_cuda_stream(device);
  CompactKVParams p = make_params(kv_caches[0], num_moves, a);
  p.src_slots = src_slots.data_ptr<int32_t>();
  p.dst_slots = dst_slots.data_ptr<int32_t>();
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  // One launch per kCompactKVMaxLayers layers (one launch for any model up to
  // 256 layers).
  for (int64_t first = 0; first < num_layers; first += kCompactKVMaxLayers) {
    p.num_layers = static_cast<int32_t>(std::min<int64_t>(kCompactKVMaxLayers, num_layers - first));
    for (int32_t l = 0; l < p.num_layers; ++l) p.layer_base[l] = static_cast<char*>(kv_caches[first + l].data_ptr());
    const int err = vtoken_compact_kv_launch(&p, stream);
    TORCH_CHECK(err == 0, "compact_kv: CUDA launch failed: ", vtoken_cuda_error_string(err));
  }
}

void compact_kv_meta(at::TensorList kv_caches, const at::Tensor& src_slots, const at::Tensor& dst_slots,
                     int64_t num_blocks, int64_t block_size, int64_t num_kv, int64_t num_heads, int64_t head_dim,
                     int64_t stride_block, int64_t stride_offset, int64_t stride_kv, int64_t stride_head) {
  // The op returns nothing and mutates in place, so the fake kernel only checks
  // what symbolic shapes allow.
  check_types(kv_caches, src_slots, dst_slots);
}

}  // namespace
}  // namespace vtoken

TORCH_LIBRARY_FRAGMENT(vtoken, m) {
  m.def(
      "compact_kv(Tensor(a!)[] kv_caches, Tensor src_slots, Tensor dst_slots, int num_blocks, "
      "int block_size, int num_kv, int num_heads, int head_dim, int stride_block, int stride_offset, "
      "int stride_kv, int stride_head) -> ()");
}

TORCH_LIBRARY_IMPL(vtoken, CPU, m) { m.impl("compact_kv", &vtoken::compact_kv_cpu); }

TORCH_LIBRARY_IMPL(vtoken, CUDA, m) { m.impl("compact_kv", &vtoken::compact_kv_cuda); }

TORCH_LIBRARY_IMPL(vtoken, Meta, m) { m.impl("compact_kv", &vtoken::compact_kv_meta); }
