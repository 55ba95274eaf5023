// torch op binding of build_slot_lists: schema, C++ CPU kernel, the CUDA
// dispatch (csrc/build_slot_lists.cu) and a Meta impl.
//
// Semantics: python/vtoken/reference/build_slot_lists.py; contract:
// vtoken_kernels/contracts.py. The CPU kernel checks the batch's ranges
// (starts, counts, overlaps: cheap on the CPU) and saturates on capacity
// overflow exactly like the GPU kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
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
void check_args(const Tensor& slots, const Tensor& alive, const Tensor& starts, const Tensor& lens,
                const Tensor& counts, const Tensor& kv_indices, const Tensor& kv_indptr, const Tensor& slot_mapping,
                const std::optional<Tensor>& kv_pos, int64_t num_reqs) {
  check_1d("slots", slots, slots, {at::kInt}, "int32");
  check_1d("alive", alive, slots, {at::kChar, at::kBool}, "int8 or bool");
  TORCH_SYM_CHECK(alive.sym_numel().sym_eq(slots.sym_numel()), "alive: expected ", slots.sym_numel(),
                  " elements like slots, got ", alive.sym_numel());
  check_1d("mirror_starts", starts, slots, {at::kLong}, "int64");
  check_1d("num_tokens", lens, slots, {at::kInt, at::kLong}, "int32 or int64");
  check_1d("new_token_counts", counts, slots, {at::kInt, at::kLong}, "int32 or int64");
  check_1d("kv_indices", kv_indices, slots, {at::kInt}, "int32");
  check_1d("kv_indptr", kv_indptr, slots, {at::kInt}, "int32");
  check_1d("slot_mapping", slot_mapping, slots, {at::kInt}, "int32");
  if (kv_pos.has_value()) {
    check_1d("kv_pos", *kv_pos, slots, {at::kInt}, "int32");
    TORCH_SYM_CHECK(kv_pos->sym_numel().sym_eq(kv_indices.sym_numel()), "kv_pos: expected ",
                    kv_indices.sym_numel(), " elements like kv_indices, got ", kv_pos->sym_numel());
  }
  TORCH_CHECK(num_reqs >= 0, "num_reqs: expected >= 0, got ", num_reqs);
  TORCH_SYM_CHECK(starts.sym_numel().sym_ge(num_reqs), "num_reqs: expected num_reqs <= len(mirror_starts) (",
                  starts.sym_numel(), "), got ", num_reqs);
  TORCH_SYM_CHECK(lens.sym_numel().sym_ge(num_reqs), "num_tokens: expected at least ", num_reqs, " elements, got ",
                  lens.sym_numel());
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

// The batch's ranges as host vectors, with the range contract checked.
struct Ranges {
  std::vector<int64_t> start;  // [n]
  std::vector<int64_t> len;    // [n]
  std::vector<int64_t> k;      // [n]
};

Ranges read_ranges(int64_t mirror_len, const Tensor& starts, const Tensor& lens, const Tensor& counts, int64_t n) {
  Ranges g{read_ints(starts, n), read_ints(lens, n), read_ints(counts, n)};
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(g.start[r] >= 0, "mirror_starts: expected starts >= 0, got ", g.start[r], " for request ", r);
    TORCH_CHECK(g.len[r] >= 0, "num_tokens: expected counts >= 0, got ", g.len[r], " for request ", r);
    TORCH_CHECK(g.start[r] <= mirror_len - g.len[r], "mirror_starts: expected start + num_tokens <= len(slots) (",
                mirror_len, "), got ", g.start[r], " + ", g.len[r], " for request ", r);
    TORCH_CHECK(g.k[r] >= 0 && g.k[r] <= g.len[r], "new_token_counts: expected 0 <= new_token_counts[r] <= ",
                "num_tokens[r], got ", g.k[r], " for request ", r, " of ", g.len[r], " tokens");
  }
  std::vector<int64_t> order;
  for (int64_t r = 0; r < n; ++r)
    if (g.len[r] > 0) order.push_back(r);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return g.start[a] < g.start[b]; });
  for (size_t i = 1; i < order.size(); ++i) {
    const int64_t a = order[i - 1], b = order[i];
    TORCH_CHECK(g.start[a] + g.len[a] <= g.start[b], "mirror_starts: expected non-overlapping token ranges, got ",
                "request ", a, " at [", g.start[a], ", ", g.start[a] + g.len[a], ") and request ", b, " at [",
                g.start[b], ", ", g.start[b] + g.len[b], ")");
  }
  return g;
}

void build_slot_lists_cpu(const Tensor& slots, const Tensor& alive, const Tensor& starts, const Tensor& lens,
                          const Tensor& counts, const Tensor& kv_indices, const Tensor& kv_indptr,
                          const Tensor& slot_mapping, const std::optional<Tensor>& kv_pos, int64_t num_reqs) {
  check_args(slots, alive, starts, lens, counts, kv_indices, kv_indptr, slot_mapping, kv_pos, num_reqs);
  const int64_t n = num_reqs;
  const Ranges g = read_ranges(slots.numel(), starts, lens, counts, n);
  const int32_t* s = slots.data_ptr<int32_t>();
  const auto* a = static_cast<const uint8_t*>(alive.data_ptr());
  int32_t* idx = kv_indices.data_ptr<int32_t>();
  int32_t* pos = kv_pos.has_value() ? kv_pos->data_ptr<int32_t>() : nullptr;
  int32_t* ip = kv_indptr.data_ptr<int32_t>();
  int32_t* sm = slot_mapping.data_ptr<int32_t>();
  const int64_t nnz_max = kv_indices.numel(), max_tokens = slot_mapping.numel();
  int64_t w = 0, q = 0;  // entries written to kv_indices / slot_mapping (past capacity: dropped)
  ip[0] = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t s0 = g.start[r], end = s0 + g.len[r];
    for (int64_t i = s0; i < end; ++i) {
      if (a[i] == 0) continue;
      if (w < nnz_max) {
        idx[w] = s[i];
        if (pos) pos[w] = static_cast<int32_t>(i - s0);
      }
      ++w;
    }
    ip[r + 1] = static_cast<int32_t>(std::min(w, nnz_max));
    for (int64_t i = end - g.k[r]; i < end; ++i, ++q)
      if (q < max_tokens) sm[q] = s[i];
  }
  std::fill(idx + std::min(w, nnz_max), idx + nnz_max, kPad);
  if (pos) std::fill(pos + std::min(w, nnz_max), pos + nnz_max, kPad);
  std::fill(ip + n + 1, ip + kv_indptr.numel(), ip[n]);
  std::fill(sm + std::min(q, max_tokens), sm + max_tokens, kPad);
}

void build_slot_lists_cuda(const Tensor& slots, const Tensor& alive, const Tensor& starts, const Tensor& lens,
                           const Tensor& counts, const Tensor& kv_indices, const Tensor& kv_indptr,
                           const Tensor& slot_mapping, const std::optional<Tensor>& kv_pos, int64_t num_reqs) {
  check_args(slots, alive, starts, lens, counts, kv_indices, kv_indptr, slot_mapping, kv_pos, num_reqs);
  const c10::DeviceGuard guard(slots.device());
  const Tensor ws = at::empty({vtoken_build_slot_lists_workspace_size(slots.numel(), num_reqs)},
                              slots.options().dtype(at::kLong));
  VtokenSlotListsArgs args{};
  args.slots = slots.data_ptr<int32_t>();
  args.alive = static_cast<const uint8_t*>(alive.data_ptr());
  args.mirror_starts = starts.data_ptr<int64_t>();
  args.num_tokens = lens.data_ptr();
  args.new_token_counts = counts.data_ptr();
  args.kv_indices = kv_indices.data_ptr<int32_t>();
  args.kv_indptr = kv_indptr.data_ptr<int32_t>();
  args.slot_mapping = slot_mapping.data_ptr<int32_t>();
  args.kv_pos = kv_pos.has_value() ? kv_pos->data_ptr<int32_t>() : nullptr;
  args.workspace = ws.data_ptr<int64_t>();
  args.mirror_len = slots.numel();
  args.num_reqs = num_reqs;
  args.max_reqs = kv_indptr.numel() - 1;
  args.nnz_max = kv_indices.numel();
  args.max_tokens = slot_mapping.numel();
  args.num_tokens_int64 = lens.scalar_type() == at::kLong;
  args.counts_int64 = counts.scalar_type() == at::kLong;
  const int err = vtoken_build_slot_lists_launch(&args, vtoken::current_cuda_stream(slots.device()));
  TORCH_CHECK(err == 0, "vtoken::build_slot_lists: CUDA launch failed: ", vtoken_cuda_error_string(err));
}

// Meta / fake: the op only mutates its buffers, so checking shapes is all.
void build_slot_lists_meta(const Tensor& slots, const Tensor& alive, const Tensor& starts, const Tensor& lens,
                           const Tensor& counts, const Tensor& kv_indices, const Tensor& kv_indptr,
                           const Tensor& slot_mapping, const std::optional<Tensor>& kv_pos, int64_t num_reqs) {
  check_args(slots, alive, starts, lens, counts, kv_indices, kv_indptr, slot_mapping, kv_pos, num_reqs);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vtoken, m) {
  m.def(
      "build_slot_lists(Tensor slots, Tensor alive, Tensor mirror_starts, Tensor num_tokens, "
      "Tensor new_token_counts, Tensor(a!) kv_indices, Tensor(b!) kv_indptr, Tensor(c!) slot_mapping, "
      "Tensor(d!)? kv_pos, int num_reqs) -> ()");
}

TORCH_LIBRARY_IMPL(vtoken, CPU, m) { m.impl("build_slot_lists", &build_slot_lists_cpu); }

TORCH_LIBRARY_IMPL(vtoken, CUDA, m) { m.impl("build_slot_lists", &build_slot_lists_cuda); }

TORCH_LIBRARY_IMPL(vtoken, Meta, m) { m.impl("build_slot_lists", &build_slot_lists_meta); }
