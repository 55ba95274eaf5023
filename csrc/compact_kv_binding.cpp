// torch binding of compact_kv: schema, C++ CPU kernel, CUDA launcher call and
// Meta (fake) kernel. See vtoken.ops.compact_kv for the public API and
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
#include <limits>
#include <vector>

#include "compact_kv_params.h"
#include "torch_utils.h"
#include "vtoken_kernels.h"

namespace vtoken {
namespace {

struct LayoutArgs {
  int64_t num_blocks, block_size, num_kv, num_heads, head_dim;
  int64_t stride_block, stride_offset, stride_kv, stride_head;
};

// Dtype / device / rank checks: no sizes, so the Meta kernel can run them on
// tensors with symbolic shapes.
void check_types(at::TensorList kv_caches, const at::Tensor& src_slots, const at::Tensor& dst_slots) {
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
void check_args(at::TensorList kv_caches, const at::Tensor& src_slots, const at::Tensor& dst_slots,
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
CompactKVParams make_params(const at::Tensor& t0, int64_t num_moves, const LayoutArgs& a) {
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
  // Test-only: the CUDA kernel's index math on CPU tensors, and its launch shape.
  m.def(
      "_compact_kv_cuda_emulated(Tensor(a!)[] kv_caches, Tensor src_slots, Tensor dst_slots, int num_blocks, "
      "int block_size, int num_kv, int num_heads, int head_dim, int stride_block, int stride_offset, "
      "int stride_kv, int stride_head) -> ()");
  m.def(
      "_compact_kv_cuda_config(Tensor[] kv_caches, Tensor src_slots, Tensor dst_slots, int num_blocks, "
      "int block_size, int num_kv, int num_heads, int head_dim, int stride_block, int stride_offset, "
      "int stride_kv, int stride_head) -> int[]");
}

TORCH_LIBRARY_IMPL(vtoken, CPU, m) {
  m.impl("compact_kv", &vtoken::compact_kv_cpu);
  m.impl("_compact_kv_cuda_emulated", &vtoken::compact_kv_cuda_emulated);
  m.impl("_compact_kv_cuda_config", &vtoken::compact_kv_cuda_config);
}

TORCH_LIBRARY_IMPL(vtoken, CUDA, m) { m.impl("compact_kv", &vtoken::compact_kv_cuda); }

TORCH_LIBRARY_IMPL(vtoken, Meta, m) { m.impl("compact_kv", &vtoken::compact_kv_meta); }
