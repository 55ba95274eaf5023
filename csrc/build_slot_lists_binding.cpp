// torch op bindings of build_slot_lists / append_slot_lists: schemas, C++ CPU
// kernels, the CUDA dispatch (csrc/build_slot_lists.cu) and Meta impls.
//
// Semantics and contract: python/vtoken/reference/build_slot_lists.py. The
// CPU kernels check the mirror's contents (offsets, new-token counts: cheap on
// the CPU) and saturate on capacity overflow exactly like the GPU kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "build_slot_lists.h"
#include "torch_utils.h"
#include "vtoken_kernels.h"

namespace {

using at::Tensor;
constexpr int32_t kPad = -1;

// NOTE: shape checks go through sym_* so that the Meta impl also works on
// fake tensors with symbolic sizes (torch.library.opcheck, torch.compile).
void check_1d(const char* name, const Tensor& t, const Tensor& like, std::initializer_list<at::ScalarType> dtypes,
              const char* expected) {
  bool ok = false;
  for (auto d : dtypes) ok = ok || t.scalar_type() == d;
  TORCH_CHECK(ok, name, ": expected dtype ", expected, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, name, ": expected 1 dim, got shape ", t.sym_sizes());
  TORCH_CHECK(t.device() == like.device(), name, ": expected device ", like.device(), ", got ", t.device());
  TORCH_SYM_CHECK(t.sym_is_contiguous(), name, ": expected a contiguous tensor, got strides ", t.sym_strides());
  TORCH_SYM_CHECK(t.sym_numel().sym_lt(int64_t(1) << 31), name, ": expected fewer than 2**31 elements, got ",
                  t.sym_numel());
}

// Shape/dtype/device checks shared by every dispatch key (no content read).
void check_args(const Tensor& slots, const Tensor& alive, const Tensor& offsets, const Tensor& counts,
                const Tensor& kv_indices, const Tensor& kv_indptr, const Tensor& slot_mapping, int64_t num_reqs) {
  check_1d("slots", slots, slots, {at::kInt}, "int32");
  check_1d("alive", alive, slots, {at::kChar, at::kBool}, "int8 or bool");
  TORCH_SYM_CHECK(alive.sym_numel().sym_eq(slots.sym_numel()), "alive: expected ", slots.sym_numel(),
                  " elements like slots, got ", alive.sym_numel());
  check_1d("mirror_offsets", offsets, slots, {at::kInt, at::kLong}, "int32 or int64");
  check_1d("new_token_counts", counts, slots, {at::kInt, at::kLong}, "int32 or int64");
  check_1d("kv_indices", kv_indices, slots, {at::kInt}, "int32");
  check_1d("kv_indptr", kv_indptr, slots, {at::kInt}, "int32");
  check_1d("slot_mapping", slot_mapping, slots, {at::kInt}, "int32");
  TORCH_CHECK(num_reqs >= 0, "num_reqs: expected >= 0, got ", num_reqs);
  TORCH_SYM_CHECK(offsets.sym_numel().sym_ge(num_reqs + 1), "num_reqs: expected num_reqs <= len(mirror_offsets) - 1 (",
                  offsets.sym_numel() - 1, "), got ", num_reqs);
  TORCH_SYM_CHECK(counts.sym_numel().sym_ge(num_reqs), "new_token_counts: expected at least ", num_reqs,
                  " elements, got ", counts.sym_numel());
  TORCH_SYM_CHECK(kv_indptr.sym_numel().sym_ge(num_reqs + 1), "kv_indptr: expected at least ", num_reqs + 1,
                  " elements, got ", kv_indptr.sym_numel());
}

template <typename T>
std::vector<int64_t> to_int64(const Tensor& t, int64_t n) {
  const T* p = t.data_ptr<T>();
  return std::vector<int64_t>(p, p + n);
}

std::vector<int64_t> read_ints(const Tensor& t, int64_t n) {
  return t.scalar_type() == at::kLong ? to_int64<int64_t>(t, n) : to_int64<int32_t>(t, n);
}

// The mirror as host vectors, with its contract checked.
struct Mirror {
  std::vector<int64_t> off;  // [n + 1]
  std::vector<int64_t> k;    // [n]
};

Mirror read_mirror(const Tensor& slots, const Tensor& offsets, const Tensor& counts, int64_t n) {
  Mirror m{read_ints(offsets, n + 1), read_ints(counts, n)};
  TORCH_CHECK(m.off[0] >= 0, "mirror_offsets: expected a first entry >= 0, got ", m.off[0]);
  TORCH_CHECK(m.off[n] <= slots.numel(), "mirror_offsets: expected a last entry <= len(slots) (", slots.numel(),
              "), got ", m.off[n]);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(m.off[r] <= m.off[r + 1], "mirror_offsets: expected a non-decreasing array, got ", m.off[r], " > ",
                m.off[r + 1], " at request ", r);
    TORCH_CHECK(m.k[r] >= 0 && m.k[r] <= m.off[r + 1] - m.off[r], "new_token_counts: expected 0 <= count <= ",
                m.off[r + 1] - m.off[r], " (the request's length), got ", m.k[r], " for request ", r);
  }
  return m;
}

// slot_mapping: the new tokens' slots, packed, PAD tail (dropped at capacity).
void write_slot_mapping(const int32_t* slots, const Mirror& m, int64_t n, int32_t* sm, int64_t max_tokens) {
  int64_t q = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = m.off[r + 1] - m.k[r]; i < m.off[r + 1]; ++i, ++q)
      if (q < max_tokens) sm[q] = slots[i];
  std::fill(sm + std::min(q, max_tokens), sm + max_tokens, kPad);
}

void fill_indptr_tail(int32_t* ip, int64_t n, int64_t max_reqs) { std::fill(ip + n + 1, ip + max_reqs + 1, ip[n]); }

void build_slot_lists_cpu(const Tensor& slots, const Tensor& alive, const Tensor& offsets, const Tensor& counts,
                          const Tensor& kv_indices, const Tensor& kv_indptr, const Tensor& slot_mapping,
                          int64_t num_reqs) {
  check_args(slots, alive, offsets, counts, kv_indices, kv_indptr, slot_mapping, num_reqs);
  const int64_t n = num_reqs;
  const Mirror m = read_mirror(slots, offsets, counts, n);
  const int32_t* s = slots.data_ptr<int32_t>();
  const auto* a = static_cast<const uint8_t*>(alive.data_ptr());
  int32_t* idx = kv_indices.data_ptr<int32_t>();
  int32_t* ip = kv_indptr.data_ptr<int32_t>();
  const int64_t nnz_max = kv_indices.numel();
  int64_t pos = 0;
  ip[0] = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = m.off[r]; i < m.off[r + 1]; ++i) {
      if (a[i] == 0) continue;
      if (pos < nnz_max) idx[pos] = s[i];
      ++pos;
    }
    ip[r + 1] = static_cast<int32_t>(std::min(pos, nnz_max));
  }
  std::fill(idx + std::min(pos, nnz_max), idx + nnz_max, kPad);
  fill_indptr_tail(ip, n, kv_indptr.numel() - 1);
  write_slot_mapping(s, m, n, slot_mapping.data_ptr<int32_t>(), slot_mapping.numel());
}

void append_slot_lists_cpu(const Tensor& slots, const Tensor& alive, const Tensor& offsets, const Tensor& counts,
                           const Tensor& kv_indices, const Tensor& kv_indptr, const Tensor& slot_mapping,
                           int64_t num_reqs) {
  check_args(slots, alive, offsets, counts, kv_indices, kv_indptr, slot_mapping, num_reqs);
  const int64_t n = num_reqs;
  const Mirror m = read_mirror(slots, offsets, counts, n);
  const int32_t* s = slots.data_ptr<int32_t>();
  const auto* a = static_cast<const uint8_t*>(alive.data_ptr());
  int32_t* idx = kv_indices.data_ptr<int32_t>();
  int32_t* ip = kv_indptr.data_ptr<int32_t>();
  const int64_t nnz_max = kv_indices.numel();
  std::vector<int64_t> o(n + 1), shift(n + 1, 0);
  for (int64_t r = 0; r <= n; ++r) o[r] = std::clamp<int64_t>(ip[r], 0, nnz_max);
  for (int64_t r = 0; r < n; ++r) {
    int64_t live = 0;
    for (int64_t i = m.off[r + 1] - m.k[r]; i < m.off[r + 1]; ++i) live += a[i] != 0;
    shift[r + 1] = shift[r] + live;
  }
  // Last request first: a segment moves right only over segments already moved.
  for (int64_t r = n - 1; r >= 0; --r) {
    const int64_t len = std::max<int64_t>(o[r + 1] - o[r], 0);
    const int64_t dst = o[r] + shift[r];
    const int64_t keep = std::clamp<int64_t>(nnz_max - dst, 0, len);
    if (shift[r] > 0 && keep > 0) std::memmove(idx + dst, idx + o[r], sizeof(int32_t) * keep);
    int64_t d = o[r] + len + shift[r];
    for (int64_t i = m.off[r + 1] - m.k[r]; i < m.off[r + 1]; ++i) {
      if (a[i] == 0) continue;
      if (d < nnz_max) idx[d] = s[i];
      ++d;
    }
  }
  for (int64_t r = 0; r <= n; ++r) ip[r] = static_cast<int32_t>(std::min(o[r] + shift[r], nnz_max));
  fill_indptr_tail(ip, n, kv_indptr.numel() - 1);
  write_slot_mapping(s, m, n, slot_mapping.data_ptr<int32_t>(), slot_mapping.numel());
}

template <bool kAppend>
void slot_lists_cuda(const Tensor& slots, const Tensor& alive, const Tensor& offsets, const Tensor& counts,
                     const Tensor& kv_indices, const Tensor& kv_indptr, const Tensor& slot_mapping, int64_t num_reqs) {
  check_args(slots, alive, offsets, counts, kv_indices, kv_indptr, slot_mapping, num_reqs);
  const c10::DeviceGuard guard(slots.device());
  const int64_t ws_size = kAppend ? vtoken_append_slot_lists_workspace_size(num_reqs, kv_indices.numel())
                                  : vtoken_build_slot_lists_workspace_size(slots.numel());
  const Tensor ws = at::empty({ws_size}, slots.options());
  VtokenSlotListsArgs args{};
  args.slots = slots.data_ptr<int32_t>();
  args.alive = static_cast<const uint8_t*>(alive.data_ptr());
  args.mirror_offsets = offsets.data_ptr();
  args.new_token_counts = counts.data_ptr();
  args.kv_indices = kv_indices.data_ptr<int32_t>();
  args.kv_indptr = kv_indptr.data_ptr<int32_t>();
  args.slot_mapping = slot_mapping.data_ptr<int32_t>();
  args.workspace = ws.data_ptr<int32_t>();
  args.num_tokens = slots.numel();
  args.num_reqs = num_reqs;
  args.max_reqs = kv_indptr.numel() - 1;
  args.nnz_max = kv_indices.numel();
  args.max_tokens = slot_mapping.numel();
  args.offsets_int64 = offsets.scalar_type() == at::kLong;
  args.counts_int64 = counts.scalar_type() == at::kLong;
  void* stream = vtoken::current_cuda_stream(slots.device());
  const int err = kAppend ? vtoken_append_slot_lists_launch(&args, stream)
                          : vtoken_build_slot_lists_launch(&args, stream);
  TORCH_CHECK(err == 0, kAppend ? "vtoken::append_slot_lists" : "vtoken::build_slot_lists",
              ": CUDA launch failed: ", vtoken_cuda_error_string(err));
}

// Meta / fake: the ops only mutate their buffers, so checking shapes is all.
void slot_lists_meta(const Tensor& slots, const Tensor& alive, const Tensor& offsets, const Tensor& counts,
                     const Tensor& kv_indices, const Tensor& kv_indptr, const Tensor& slot_mapping, int64_t num_reqs) {
  check_args(slots, alive, offsets, counts, kv_indices, kv_indptr, slot_mapping, num_reqs);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vtoken, m) {
  m.def(
      "build_slot_lists(Tensor slots, Tensor alive, Tensor mirror_offsets, Tensor new_token_counts, "
      "Tensor(a!) kv_indices, Tensor(b!) kv_indptr, Tensor(c!) slot_mapping, int num_reqs) -> ()");
  m.def(
      "append_slot_lists(Tensor slots, Tensor alive, Tensor mirror_offsets, Tensor new_token_counts, "
      "Tensor(a!) kv_indices, Tensor(b!) kv_indptr, Tensor(c!) slot_mapping, int num_reqs) -> ()");
}

TORCH_LIBRARY_IMPL(vtoken, CPU, m) {
  m.impl("build_slot_lists", &build_slot_lists_cpu);
  m.impl("append_slot_lists", &append_slot_lists_cpu);
}

TORCH_LIBRARY_IMPL(vtoken, CUDA, m) {
  m.impl("build_slot_lists", &slot_lists_cuda<false>);
  m.impl("append_slot_lists", &slot_lists_cuda<true>);
}

TORCH_LIBRARY_IMPL(vtoken, Meta, m) {
  m.impl("build_slot_lists", &slot_lists_meta);
  m.impl("append_slot_lists", &slot_lists_meta);
}
