// compact_kv: argument checks and the kernel geometry derived from them, shared
// by the op binding (csrc/compact_kv_binding.cpp) and the test-only emulation
// of the CUDA kernel (csrc/testing/compact_kv_emulated.cpp), so the emulation
// runs on exactly the parameters the real launch gets.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

#include "compact_kv_params.h"

namespace vtoken {

struct LayoutArgs {
  int64_t num_blocks, block_size, num_kv, num_heads, head_dim;
  int64_t stride_block, stride_offset, stride_kv, stride_head;
};

// Dtype / device / rank checks: no sizes, so the Meta kernel can run them on
// tensors with symbolic shapes.
inline void check_types(at::TensorList kv_caches, const at::Tensor& src_slots, const at::Tensor& dst_slots) {
  TORCH_CHECK(!kv_caches.empty(), "compact_kv: kv_caches: expected at least one layer, got 0");
  const at::Tensor& t0 = kv_caches[0];
  for (size_t l = 1; l < kv_caches.size(); ++l) {
    const at::Tensor& t = kv_caches[l];
    TORCH_CHECK(t.device() == t0.device(), "compact_kv: kv_caches[", l, "]: expected device ", t0.device(),
                ", got ", t.device());
    TORCH_CHECK(t.scalar_type() == t0.scalar_type(), "compact_kv: kv_caches[", l, "]: expected dtype ",
                t0.scalar_type(), ", got ", t.scalar_type());
    TORCH_CHECK(t.dim() == t0.dim(), "compact_kv: kv_caches[", l, "]: expected ", t0.dim(), " dims, got ",
                t.dim());
  }
  for (const at::Tensor* s : {&src_slots, &dst_slots}) {
    const char* name = s == &src_slots ? "src_slots" : "dst_slots";
    TORCH_CHECK(s->scalar_type() == at::kInt, "compact_kv: ", name, ": expected dtype int32, got ",
                s->scalar_type());
    TORCH_CHECK(s->dim() == 1, "compact_kv: ", name, ": expected 1 dim, got ", s->dim());
    TORCH_CHECK(s->device() == t0.device(), "compact_kv: ", name, ": expected device ", t0.device(), ", got ",
                s->device());
  }
}

// Everything the kernels rely on (concrete shapes only).
inline void check_args(at::TensorList kv_caches, const at::Tensor& src_slots, const at::Tensor& dst_slots,
                const LayoutArgs& a) {
  check_types(kv_caches, src_slots, dst_slots);
  const at::Tensor& t0 = kv_caches[0];
  for (size_t l = 1; l < kv_caches.size(); ++l) {
    const at::Tensor& t = kv_caches[l];
    TORCH_CHECK(t.sizes() == t0.sizes() && t.strides() == t0.strides(), "compact_kv: kv_caches[", l,
                "]: expected shape ", t0.sizes(), " strides ", t0.strides(), " like layer 0, got shape ",
                t.sizes(), " strides ", t.strides());
  }
  TORCH_CHECK(src_slots.is_contiguous() && dst_slots.is_contiguous(),
              "compact_kv: src_slots, dst_slots: expected contiguous tensors");
  TORCH_CHECK(src_slots.numel() == dst_slots.numel(), "compact_kv: dst_slots: expected ", src_slots.numel(),
              " entries like src_slots, got ", dst_slots.numel());
  TORCH_CHECK(a.num_blocks > 0 && a.block_size > 0 && a.num_kv > 0 && a.num_heads > 0 && a.head_dim > 0,
              "compact_kv: layout: expected positive num_blocks, block_size, num_kv, num_heads, head_dim");
  TORCH_CHECK(a.stride_block >= 0 && a.stride_offset >= 0 && a.stride_kv >= 0 && a.stride_head >= 0,
              "compact_kv: layout: expected non-negative strides");
  TORCH_CHECK(a.num_blocks * a.block_size <= std::numeric_limits<int32_t>::max() + int64_t{1},
              "compact_kv: layout: expected num_blocks * block_size <= 2^31 (int32 slots), got ",
              a.num_blocks * a.block_size);
  TORCH_CHECK(t0.dim() > 0 && t0.stride(-1) == 1, "compact_kv: kv_caches: expected a contiguous last dim");
  // Every element the layout addresses lies inside the tensor's extent.
  const int64_t layout_last = (a.num_blocks - 1) * a.stride_block + (a.block_size - 1) * a.stride_offset +
                              (a.num_kv - 1) * a.stride_kv + (a.num_heads - 1) * a.stride_head + a.head_dim - 1;
  int64_t tensor_last = 0;
  for (int64_t i = 0; i < t0.dim(); ++i) tensor_last += (t0.size(i) - 1) * t0.stride(i);
  TORCH_CHECK(t0.numel() == a.num_blocks * a.block_size * a.num_kv * a.num_heads * a.head_dim &&
                  layout_last <= tensor_last,
              "compact_kv: layout: expected a layout that addresses the cache tensor of shape ", t0.sizes(),
              " strides ", t0.strides(), ", got one addressing up to element ", layout_last);
}

// Geometry common to the CPU and CUDA kernels (no pointers yet).
inline CompactKVParams make_params(const at::Tensor& t0, int64_t num_moves, const LayoutArgs& a) {
  const int64_t esize = t0.element_size();
  const CompactKVRows rows = compact_kv_rows(a.num_kv, a.stride_kv, a.num_heads, a.stride_head, a.head_dim);
  TORCH_CHECK(rows.row_elems * esize <= std::numeric_limits<int32_t>::max(),
              "compact_kv: a token row of ", rows.row_elems * esize, " bytes is over 2^31");
  CompactKVParams p{};
  p.num_moves = num_moves;
  p.num_slots = a.num_blocks * a.block_size;
  p.stride_block = a.stride_block * esize;
  p.stride_offset = a.stride_offset * esize;
  p.stride_outer = rows.stride_outer * esize;
  p.stride_inner = rows.stride_inner * esize;
  p.block_size = static_cast<int32_t>(a.block_size);
  p.rows_per_token = static_cast<int32_t>(rows.rows);
  p.row_bytes = static_cast<int32_t>(rows.row_elems * esize);
  p.inner_div = FastDivmod(static_cast<uint32_t>(rows.n_inner));
  return p;
}

}  // namespace vtoken
