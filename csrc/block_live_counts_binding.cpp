// torch op binding of block_live_counts: schema, C++ CPU kernel, the CUDA
// dispatch (csrc/block_live_counts.cu) and a Meta impl.
//
// Semantics: python/vtoken/reference/block_live_counts.py. PAD and
// out-of-range slots are skipped (the Python front end rejects out-of-range
// live slots when it can check them without a device sync).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include "block_live_counts.h"
#include "torch_utils.h"
#include "vtoken_kernels.h"

namespace {

using at::Tensor;

// NOTE: shape checks go through sym_* so that the Meta impl also works on
// fake tensors with symbolic sizes (torch.library.opcheck, torch.compile).
void check_args(const Tensor& slots, const Tensor& alive, const std::optional<Tensor>& allocated, int64_t num_blocks,
                int64_t block_size) {
  TORCH_CHECK(slots.scalar_type() == at::kInt, "slots: expected dtype int32, got ", slots.scalar_type());
  TORCH_CHECK(slots.dim() == 1, "slots: expected 1 dim, got shape ", slots.sym_sizes());
  TORCH_SYM_CHECK(slots.sym_is_contiguous(), "slots: expected a contiguous tensor");
  TORCH_SYM_CHECK(slots.sym_numel().sym_lt(int64_t(1) << 31), "slots: expected fewer than 2**31 elements, got ",
                  slots.sym_numel());
  TORCH_CHECK(alive.scalar_type() == at::kChar || alive.scalar_type() == at::kBool,
              "alive: expected dtype int8 or bool, got ", alive.scalar_type());
  TORCH_CHECK(alive.dim() == 1, "alive: expected 1 dim, got shape ", alive.sym_sizes());
  TORCH_SYM_CHECK(alive.sym_is_contiguous(), "alive: expected a contiguous tensor");
  TORCH_SYM_CHECK(alive.sym_numel().sym_eq(slots.sym_numel()), "alive: expected ", slots.sym_numel(),
                  " elements like slots, got ", alive.sym_numel());
  TORCH_CHECK(alive.device() == slots.device(), "alive: expected device ", slots.device(), ", got ", alive.device());
  TORCH_CHECK(num_blocks >= 0, "num_blocks: expected >= 0, got ", num_blocks);
  TORCH_CHECK(block_size >= 1, "block_size: expected >= 1, got ", block_size);
  TORCH_CHECK(num_blocks <= (int64_t(1) << 31) / block_size,
              "num_blocks * block_size: expected <= 2**31 (int32 slots), got ", num_blocks, " * ", block_size);
  if (allocated.has_value()) {
    const Tensor& al = *allocated;
    TORCH_CHECK(al.scalar_type() == at::kChar || al.scalar_type() == at::kBool,
                "allocated: expected dtype int8 or bool, got ", al.scalar_type());
    TORCH_CHECK(al.dim() == 1, "allocated: expected 1 dim, got shape ", al.sym_sizes());
    TORCH_SYM_CHECK(al.sym_is_contiguous(), "allocated: expected a contiguous tensor");
    TORCH_SYM_CHECK(al.sym_numel().sym_eq(num_blocks), "allocated: expected num_blocks (", num_blocks,
                    ") elements, got ", al.sym_numel());
    TORCH_CHECK(al.device() == slots.device(), "allocated: expected device ", slots.device(), ", got ", al.device());
  }
}

std::tuple<Tensor, Tensor> empty_outputs(const Tensor& slots, int64_t num_blocks) {
  return {at::empty({num_blocks}, slots.options().dtype(at::kInt)),
          at::empty({}, slots.options().dtype(at::kFloat))};
}

std::tuple<Tensor, Tensor> block_live_counts_cpu(const Tensor& slots, const Tensor& alive,
                                                 const std::optional<Tensor>& allocated, int64_t num_blocks,
                                                 int64_t block_size) {
  check_args(slots, alive, allocated, num_blocks, block_size);
  auto [counts, f] = empty_outputs(slots, num_blocks);
  int32_t* c = counts.data_ptr<int32_t>();
  std::fill(c, c + num_blocks, 0);
  const int32_t* s = slots.data_ptr<int32_t>();
  const auto* a = static_cast<const uint8_t*>(alive.data_ptr());
  const uint8_t* al = allocated.has_value() ? static_cast<const uint8_t*>(allocated->data_ptr()) : nullptr;
  const int64_t limit = num_blocks * block_size;
  uint64_t live = 0, num_alloc = 0;
  for (int64_t i = 0; i < slots.numel(); ++i) {
    if (a[i] == 0 || s[i] < 0 || s[i] >= limit) continue;
    const int64_t b = s[i] / block_size;
    ++c[b];
    live += al == nullptr || al[b] != 0;
  }
  for (int64_t b = 0; b < num_blocks; ++b) num_alloc += al == nullptr || al[b] != 0;
  // Same float64 expression as the reference, rounded once to float32.
  *f.data_ptr<float>() =
      num_alloc == 0 ? 0.0f
                     : static_cast<float>(1.0 - static_cast<double>(live) / static_cast<double>(num_alloc * block_size));
  return {counts, f};
}

std::tuple<Tensor, Tensor> block_live_counts_cuda(const Tensor& slots, const Tensor& alive,
                                                  const std::optional<Tensor>& allocated, int64_t num_blocks,
                                                  int64_t block_size) {
  check_args(slots, alive, allocated, num_blocks, block_size);
  const c10::DeviceGuard guard(slots.device());
  auto [counts, f] = empty_outputs(slots, num_blocks);
  const Tensor ws = at::empty({3}, slots.options().dtype(at::kLong));
  VtokenBlockLiveCountsArgs args{};
  args.slots = slots.data_ptr<int32_t>();
  args.alive = static_cast<const uint8_t*>(alive.data_ptr());
  args.allocated = allocated.has_value() ? static_cast<const uint8_t*>(allocated->data_ptr()) : nullptr;
  args.counts = counts.data_ptr<int32_t>();
  args.waste_ratio = f.data_ptr<float>();
  args.workspace = static_cast<unsigned long long*>(ws.data_ptr());
  args.num_tokens = slots.numel();
  args.num_blocks = num_blocks;
  args.block_size = block_size;
  const int err = vtoken_block_live_counts_launch(&args, vtoken::current_cuda_stream(slots.device()));
  TORCH_CHECK(err == 0, "vtoken::block_live_counts: CUDA launch failed: ", vtoken_cuda_error_string(err));
  return {counts, f};
}

std::tuple<Tensor, Tensor> block_live_counts_meta(const Tensor& slots, const Tensor& alive,
                                                  const std::optional<Tensor>& allocated, int64_t num_blocks,
                                                  int64_t block_size) {
  check_args(slots, alive, allocated, num_blocks, block_size);
  return empty_outputs(slots, num_blocks);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vtoken, m) {
  m.def(
      "block_live_counts(Tensor slots, Tensor alive, Tensor? allocated, int num_blocks, int block_size) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vtoken, CPU, m) { m.impl("block_live_counts", &block_live_counts_cpu); }
TORCH_LIBRARY_IMPL(vtoken, CUDA, m) { m.impl("block_live_counts", &block_live_counts_cuda); }
TORCH_LIBRARY_IMPL(vtoken, Meta, m) { m.impl("block_live_counts", &block_live_counts_meta); }
