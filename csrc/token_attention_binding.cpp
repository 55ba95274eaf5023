// torch op binding of token_attention: schema, the C++ CPU kernel and a Meta
// impl. There is no CUDA implementation (GPUs run the Triton kernel,
// vtoken_kernels/token_attention.py); vtoken.device.ops picks this op for CPU tensors.
//
// Semantics, NaN propagation included: python/vtoken/reference/token_attention.py.
// The Python front end checks the contract (vtoken_kernels/contracts.py); this
// op re-checks shapes and dtypes, and never reads or writes out of bounds on a
// violated content contract: a slot outside [0, num_slots) is skipped like PAD,
// indptr entries are clamped, a score destination outside score_out is skipped.
//
// Schema:
//   vtoken::token_attention(Tensor q, Tensor kv_cache, Tensor kv_indices, Tensor kv_indptr,
//       Tensor? q_indptr, Tensor(a!) out, Tensor(b!)? key_scores, Tensor(c!)? score_out,
//       Tensor? mirror_starts, Tensor? kv_pos, float scale, int num_blocks, int block_size,
//       int num_kv, int num_heads, int head_dim, int stride_block, int stride_offset,
//       int stride_kv, int stride_head, int cpu_isa=-1) -> ()
// The layout ints are vtoken.layout.KVLayout's (contracts.layout_op_args). key_scores
// (float32 [nnz_max, num_kv_heads]) is overwritten; score_out needs key_scores.
// cpu_isa: -1 picks the best the CPU has, 0 / 1 / 2 force the baseline x86-64 /
// AVX2 / AVX-512 code (tests run every path).
//
// Work units: (request, kv head[, query tile]). A unit computes the scores of its
// rows (query tile x the kv head's GQA group) against every key it may attend,
// the exact softmax (max, exp, sum over the full row: no online rescaling, so the
// key scores are the final probabilities), then P @ V. With key scores, a unit
// owns all the query tiles of its (request, kv head): the only writer of its
// key_scores column range, so no atomics and a deterministic sum.
//
// Vectorization: GCC generic vectors (16 floats under AVX-512, 8 otherwise) for
// the dot products (16 keys at a time, summed lane-wise by a shuffle tree) and
// P @ V; plain 16-lane loops (no reassociation needed, so -O3 vectorizes them
// without -ffast-math) for conversions and the softmax. Compiled three times via
// target attributes (baseline x86-64, AVX2+FMA+F16C, AVX-512) and picked at run
// time, so the shipped library runs on any x86-64 CPU. K/V rows are prefetched
// two 16-key chunks ahead.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

// The 64-byte vectors below never cross a non-inlined call (every helper is always_inline).
#pragma GCC diagnostic ignored "-Wpsabi"

namespace vtoken {
namespace {

using at::Tensor;

#define VT_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__)
#define VT_X86 1
#define VT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define VT_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#endif

constexpr int kLanes = 16;
// Score rows of a prefill query tile are kept whole (exact softmax): cap the
// tile so rows x keys stays near 1 MiB of fp32 scores.
constexpr int64_t kScoreBudget = int64_t{1} << 18;
constexpr int64_t kMaxTileQueries = 32;
// Keys ahead of the current 16-key chunk whose K/V rows are prefetched.
constexpr int64_t kPrefetchKeys = 32;
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Params {
  const char* q;  // [num_q_tokens, num_q_heads, head_dim], strides q_s0, q_s1 (elements), last dim contiguous
  int64_t q_s0, q_s1;
  char* out;  // like q, strides o_s0, o_s1
  int64_t o_s0, o_s1;
  const char* kv;               // the cache; element offsets from the layout strides
  const int32_t* kv_indices;    // [nnz_max]
  const int32_t* kv_indptr;     // [num_reqs + 1]
  const int32_t* q_indptr;      // [num_reqs + 1] or nullptr (decode)
  float* key_scores;            // [nnz_max, num_kv_heads] or nullptr
  int64_t num_reqs, num_q_tokens, num_q_heads, num_kv_heads, head_dim, group, nnz_max;
  int64_t num_slots, block_size, stride_block, stride_offset, stride_kv, stride_head;
  float scale;
};

struct Unit {
  int64_t req, head, q0, q1;  // the unit's queries [q0, q1) of request req (local indices), kv head
};

struct Scratch {
  std::vector<float> qf, sc, o, row, kacc, kbuf;
  std::vector<int64_t> koff;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// ---------------------------------------------------------------- element conversions

VT_INLINE float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

VT_INLINE uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Exact fp16 -> fp32, branch-free so the loop vectorizes (normals, subnormals, +-0, Inf, NaN).
VT_INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = uint32_t(h & 0x7fffu) << 13;
  const uint32_t exp = em & (0x7c00u << 13);
  const uint32_t normal = em + ((127u - 15u) << 23);
  const uint32_t special = em + ((255u - 31u) << 23);
  const uint32_t sub = to_bits(from_bits(em + (113u << 23)) - from_bits(113u << 23));
  uint32_t o = exp == (0x7c00u << 13) ? special : normal;
  o = exp == 0 ? sub : o;
  return from_bits(o | sign);
}

VT_INLINE void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

VT_INLINE void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < n; ++d) dst[d] = from_bits(uint32_t(s[d]) << 16);
}

VT_INLINE void load_row(const c10::Half* src, float* dst, int64_t n) {
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < n; ++d) dst[d] = half_to_float(s[d]);
}

// Ask for the cache lines of a row ahead of use. NOTE: a request's keys sit in blocks scattered
// over the cache; the hardware prefetcher retrains at every block and page, and without this
// the K/V loads stalled on DRAM for about two thirds of a decode step.
template <typename T>
VT_INLINE void prefetch_row(const T* row, int64_t n) {
  const char* c = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < n * int64_t(sizeof(T)); b += 64) __builtin_prefetch(c + b, 0, 3);
}

template <typename T>
VT_INLINE void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = T(src[d]);  // round to nearest even, like Tensor.copy_
}

// ---------------------------------------------------------------- vector math (16 independent lanes)
// GCC generic vectors: one 16-float vector is a zmm under AVX-512, two ymm under AVX2, four xmm
// on the baseline; the hot loops are written with them so their shape does not depend on
// what the auto-vectorizer decides (it turned the 16-key score loop into permutes).
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i16 __attribute__((vector_size(64)));


// r[l] = sum of the lanes of a[l], l < 16 (a transpose-and-add tree: 15 adds, 30 two-source shuffles).
VT_INLINE v16 hsum16(const v16* a) {
  const i16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const i16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i16 hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const i16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i16 hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const i16 lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const i16 hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo8) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi8);
  for (int i = 0; i < 4; ++i) c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo4) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi4);
  for (int i = 0; i < 2; ++i) d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], lo2) + __builtin_shuffle(c[2 * i], c[2 * i + 1], hi2);
  return __builtin_shuffle(d[0], d[1], lo1) + __builtin_shuffle(d[0], d[1], hi1);
}

// The same for 8 vectors of 8 lanes, with in-lane (AVX2 vshufps-style) shuffles. NOTE: the AVX2
// and baseline paths compute in 8-lane vectors: GCC lowers a 16-float vector on AVX2 through the
// stack and general registers, which made that path 1.6-1.8x slower than the baseline one.
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

VT_INLINE v8 hadd8(v8 a, v8 b) {
  const i8 ev = {0, 2, 8, 10, 4, 6, 12, 14}, od = {1, 3, 9, 11, 5, 7, 13, 15};
  return __builtin_shuffle(a, b, ev) + __builtin_shuffle(a, b, od);
}

VT_INLINE v8 hsum8(const v8* h) {
  const i8 lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
  const v8 u0 = hadd8(hadd8(h[0], h[1]), hadd8(h[2], h[3]));
  const v8 u1 = hadd8(hadd8(h[4], h[5]), hadd8(h[6], h[7]));
  return __builtin_shuffle(u0, u1, lo) + __builtin_shuffle(u0, u1, hi);
}

typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

template <typename V>
VT_INLINE V vload(const float* p) {
  if constexpr (sizeof(V) == 64) return *reinterpret_cast<const v16u*>(p);
  else return *reinterpret_cast<const v8u*>(p);
}

template <typename V>
VT_INLINE void vstore(float* p, V v) {
  if constexpr (sizeof(V) == 64) *reinterpret_cast<v16u*>(p) = v;
  else *reinterpret_cast<v8u*>(p) = v;
}

// dots[l] = sum of the lanes of part[l], l < 16, for either vector width.
template <typename V>
VT_INLINE void hsum_parts(const V* part, float* dots) {
  if constexpr (sizeof(V) == 64) {
    vstore(dots, hsum16(part));
  } else {
    vstore(dots, hsum8(part));
    vstore(dots + 8, hsum8(part + 8));
  }
}


// max over x[0, n); a NaN is ignored here (it reaches every p through the sum, see softmax_row).
VT_INLINE float row_max(const float* x, int64_t n) {
  float m[kLanes];
  for (int l = 0; l < kLanes; ++l) m[l] = -kInf;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) m[l] = x[j + l] > m[l] ? x[j + l] : m[l];
  float r = -kInf;
  for (; j < n; ++j) r = x[j] > r ? x[j] : r;
  for (int l = 0; l < kLanes; ++l) r = m[l] > r ? m[l] : r;
  return r;
}

// exp(x) for x <= 0 (softmax shifts), ~1 ulp: 2^n * poly(r). -inf and x < -87 give 0, NaN stays NaN.
VT_INLINE float exp_nonpos(float x) {
  const bool under = x < -87.0f;
  const float xc = under ? -87.0f : (x > 0.0f ? 0.0f : x);  // a NaN fails both tests and is kept
  const float magic = 12582912.0f;                          // 1.5 * 2^23: adding it rounds to an integer
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  const int32_t ni = int32_t(to_bits(t) - to_bits(magic));
  const float r = (xc - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float y = p * from_bits((uint32_t(ni) + 127u) << 23);
  return under ? 0.0f : y;
}

// p[j] = softmax of s[0, n) in place, as the reference: max (-inf -> 0), e = exp(s - max), e / sum.
// A NaN score makes the sum NaN, hence every p of the row (the reference's NaN row).
VT_INLINE void softmax_row(float* s, int64_t n) {
  float m = row_max(s, n);
  if (m == -kInf) m = 0.0f;  // no finite score: every e is 0, p = 0
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float e = exp_nonpos(s[j + l] - m);
      s[j + l] = e;
      acc[l] += e;
    }
  float tail = 0.0f;
  for (; j < n; ++j) {
    s[j] = exp_nonpos(s[j] - m);
    tail += s[j];
  }
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  float denom = acc[0] + tail;
  if (denom == 0.0f) denom = 1.0f;
  const float inv = 1.0f / denom;
  for (j = 0; j < n; ++j) s[j] *= inv;
}

VT_INLINE bool all_finite(const float* x, int64_t n) {
  uint32_t bad = 0;
  for (int64_t d = 0; d < n; ++d) bad |= (to_bits(x[d]) & 0x7f800000u) == 0x7f800000u;
  return bad == 0;
}

// ---------------------------------------------------------------- one work unit

template <typename T, typename V>
VT_INLINE void run_unit(const Params& p, const Unit& u, Scratch& ws) {
  const int64_t D = p.head_dim, G = p.group, g = u.head;
  const int64_t k0 = p.kv_indptr[u.req], n_live = p.kv_indptr[u.req + 1] - k0;  // clamped by the caller
  const int64_t q_base = p.q_indptr == nullptr ? u.req : p.q_indptr[u.req];
  const int64_t n_new = p.q_indptr == nullptr ? 1 : p.q_indptr[u.req + 1] - q_base;
  const int64_t shift = n_live - n_new;  // query i attends list entries [0, shift + i]
  const T* kv = reinterpret_cast<const T*>(p.kv);
  const bool scores = p.key_scores != nullptr;
  if (scores) ws.kacc.assign(std::max<int64_t>(n_live, 1), 0.0f);
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;  // rows padded with zeros to whole vectors
  ws.row.assign(Dp, 0.0f);
  ws.kbuf.assign(Dp * kLanes, 0.0f);
  ws.koff.resize(std::max<int64_t>(n_live, 1));
  // Key element offsets (K of head g), -1 for PAD / out-of-range slots.
  for (int64_t j = 0; j < n_live; ++j) {
    const int64_t s = p.kv_indices[k0 + j];
    // NOTE: 32-bit division (slots and block_size are < 2**31): a 64-bit divide per key was a
    // visible share of a decode step.
    const uint32_t blk = uint32_t(s) / uint32_t(p.block_size), off = uint32_t(s) - blk * uint32_t(p.block_size);
    ws.koff[j] = (s < 0 || s >= p.num_slots) ? -1 : blk * p.stride_block + off * p.stride_offset + g * p.stride_head;
  }
  const int64_t tile = p.q_indptr == nullptr
                           ? 1
                           : std::clamp<int64_t>(kScoreBudget / std::max<int64_t>(G * n_live, 1), 1, kMaxTileQueries);
  for (int64_t t0 = u.q0; t0 < u.q1; t0 += tile) {
    const int64_t t1 = std::min(u.q1, t0 + tile), R = (t1 - t0) * G;
    const int64_t nk = std::clamp<int64_t>(shift + t1, 0, n_live);  // keys the tile's last query may attend
    ws.qf.assign(R * Dp, 0.0f);
    ws.o.assign(R * Dp, 0.0f);
    ws.sc.resize(std::max<int64_t>(R * nk, 1));
    for (int64_t i = t0; i < t1; ++i)
      for (int64_t gi = 0; gi < G; ++gi) {
        const T* qrow = reinterpret_cast<const T*>(p.q) + (q_base + i) * p.q_s0 + (g * G + gi) * p.q_s1;
        load_row(qrow, &ws.qf[((i - t0) * G + gi) * Dp], D);
      }
    // Scores, 16 keys at a time: each K row is converted once into kbuf (fp32, zero-padded to
    // Dp), each row's 16 dot products are accumulated as 16 vectors and summed lane-wise by one
    // transpose-add tree. Row r = (i - t0) * G + gi attends keys [0, shift + i]; scores past that
    // are computed with the chunk and never read. A PAD key scores -inf (p = 0).
    for (int64_t jb = 0; jb < nk; jb += kLanes) {
      const int64_t nb = std::min<int64_t>(kLanes, nk - jb);
      float* kbuf = ws.kbuf.data();
      for (int64_t j = jb + kPrefetchKeys; j < std::min(nk, jb + kPrefetchKeys + kLanes); ++j)
        if (ws.koff[j] >= 0) {
          prefetch_row(kv + ws.koff[j], D);
          prefetch_row(kv + ws.koff[j] + p.stride_kv, D);  // V, read by the P @ V pass below
        }
      for (int64_t l = 0; l < nb; ++l)
        if (ws.koff[jb + l] >= 0) load_row(kv + ws.koff[jb + l], kbuf + l * Dp, D);
      for (int64_t r = std::max<int64_t>(0, jb - shift - t0) * G; r < R; ++r) {
        const float* qr = &ws.qf[r * Dp];
        constexpr int64_t W = sizeof(V) / sizeof(float);
        V part[kLanes];
        for (int l = 0; l < kLanes; ++l) {
          V acc = {};
          for (int64_t c = 0; c < Dp; c += W) acc += vload<V>(qr + c) * vload<V>(kbuf + l * Dp + c);
          part[l] = acc;
        }
        float dots[kLanes];
        hsum_parts(part, dots);
        float* out_s = &ws.sc[r * nk + jb];
        for (int64_t l = 0; l < nb; ++l) out_s[l] = ws.koff[jb + l] >= 0 ? dots[l] * p.scale : -kInf;
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = std::clamp<int64_t>(shift + t0 + r / G + 1, 0, nk);
      float* s = &ws.sc[r * nk];
      softmax_row(s, n);
      for (int64_t j = 0; j < n; ++j)
        if (ws.koff[j] < 0) s[j] = 0.0f;  // PAD keeps p = 0 even in a NaN row
      if (scores)
        for (int64_t j = 0; j < n; ++j) ws.kacc[j] += s[j];
    }
    // P @ V, 16 keys at a time: their V rows are converted into kbuf (a PAD key's row is zeroed:
    // its p is 0 and stale data could be NaN), then each output vector takes the chunk's 16
    // multiply-adds in a register. NOTE: no key is skipped for p == 0: 0 * Inf = NaN must reach
    // the row (checked below).
    for (int64_t jb = 0; jb < nk; jb += kLanes) {
      const int64_t nb = std::min<int64_t>(kLanes, nk - jb);
      float* vbuf = ws.kbuf.data();
      for (int64_t j = jb + kLanes; j < std::min(nk, jb + 2 * kLanes); ++j)
        if (ws.koff[j] >= 0) prefetch_row(kv + ws.koff[j] + p.stride_kv, D);
      for (int64_t l = 0; l < nb; ++l) {
        if (ws.koff[jb + l] >= 0)
          load_row(kv + ws.koff[jb + l] + p.stride_kv, vbuf + l * Dp, D);
        else
          std::fill(vbuf + l * Dp, vbuf + l * Dp + D, 0.0f);
      }
      for (int64_t r = std::max<int64_t>(0, jb - shift - t0) * G; r < R; ++r) {
        // Row r attends keys [0, shift + i]: only the chunk's first `cnt` keys.
        const int64_t cnt = std::clamp<int64_t>(shift + t0 + r / G + 1 - jb, 0, nb);
        const float* pr = &ws.sc[r * nk + jb];
        float* o = &ws.o[r * Dp];
        for (int64_t c = 0; c < Dp; c += int64_t(sizeof(V) / sizeof(float))) {
          V acc = vload<V>(o + c);
          for (int64_t l = 0; l < cnt; ++l) acc += pr[l] * vload<V>(vbuf + l * Dp + c);
          vstore(o + c, acc);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = t0 + r / G, h = g * G + r % G;
      const int64_t n = std::clamp<int64_t>(shift + i + 1, 0, nk);
      float* o = &ws.o[r * Dp];
      // A non-finite V in an attended key makes the row NaN (reference). A finite P @ V over
      // finite rows stays finite, so only a non-finite result needs the V rows re-read.
      if (!all_finite(o, D)) {
        bool bad_v = false;
        for (int64_t j = 0; j < n && !bad_v; ++j) {
          if (ws.koff[j] < 0) continue;
          load_row(kv + ws.koff[j] + p.stride_kv, ws.row.data(), D);
          bad_v = !all_finite(ws.row.data(), D);
        }
        if (bad_v) std::fill(o, o + D, std::numeric_limits<float>::quiet_NaN());
      }
      store_row(o, reinterpret_cast<T*>(p.out) + (q_base + i) * p.o_s0 + h * p.o_s1, D);
    }
  }
  if (scores)
    for (int64_t j = 0; j < n_live; ++j) p.key_scores[(k0 + j) * p.num_kv_heads + g] = ws.kacc[j];
}

template <typename T>
void run_units_base(const Params& p, const Unit* units, int64_t n, std::atomic<int64_t>* next) {
  Scratch& ws = scratch();
  for (int64_t i = next->fetch_add(1); i < n; i = next->fetch_add(1)) run_unit<T, v8>(p, units[i], ws);
}

#if defined(VT_X86)
template <typename T>
VT_TARGET_AVX2 void run_units_avx2(const Params& p, const Unit* units, int64_t n, std::atomic<int64_t>* next) {
  Scratch& ws = scratch();
  for (int64_t i = next->fetch_add(1); i < n; i = next->fetch_add(1)) run_unit<T, v8>(p, units[i], ws);
}

template <typename T>
VT_TARGET_AVX512 void run_units_avx512(const Params& p, const Unit* units, int64_t n, std::atomic<int64_t>* next) {
  Scratch& ws = scratch();
  for (int64_t i = next->fetch_add(1); i < n; i = next->fetch_add(1)) run_unit<T, v16>(p, units[i], ws);
}
#endif

int64_t best_isa() {
#if defined(VT_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 1;
#endif
  return 0;
}

template <typename T>
void run_all(const Params& p, const std::vector<Unit>& units, int64_t isa) {
  using Fn = void (*)(const Params&, const Unit*, int64_t, std::atomic<int64_t>*);
  Fn fn = &run_units_base<T>;
#if defined(VT_X86)
  if (isa == 1) fn = &run_units_avx2<T>;
  if (isa == 2) fn = &run_units_avx512<T>;
#endif
  // NOTE: units are taken from a shared counter, not split statically: requests differ in
  // length, and on a shared machine a descheduled thread would otherwise hold back its whole
  // static share. Units come sorted by cost, largest first.
  const int64_t n = static_cast<int64_t>(units.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1,
                   [&](int64_t, int64_t) { fn(p, units.data(), n, &next); });
}

// ---------------------------------------------------------------- checks

void check_index(const char* name, const Tensor& t, at::ScalarType dtype, const Tensor& q) {
  TORCH_CHECK(t.scalar_type() == dtype, "token_attention: ", name, ": expected dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 1, "token_attention: ", name, ": expected 1 dim, got shape ", t.sym_sizes());
  TORCH_CHECK(t.device() == q.device(), "token_attention: ", name, ": expected device ", q.device(), ", got ",
              t.device());
}

// Dtypes, ranks, devices and the sizes that are plain ints: what the Meta kernel can check too.
void check_types(const Tensor& q, const Tensor& kv_cache, const Tensor& kv_indices, const Tensor& kv_indptr,
                 const std::optional<Tensor>& q_indptr, const Tensor& out, const std::optional<Tensor>& key_scores,
                 const std::optional<Tensor>& score_out, const std::optional<Tensor>& mirror_starts,
                 const std::optional<Tensor>& kv_pos, int64_t num_kv, int64_t num_heads, int64_t head_dim) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "token_attention: q: expected dtype float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(q.dim() == 3, "token_attention: q: expected 3 dims, got shape ", q.sym_sizes());
  TORCH_CHECK(kv_cache.scalar_type() == dt, "token_attention: kv_cache: expected dtype ", dt, ", got ",
              kv_cache.scalar_type());
  TORCH_CHECK(kv_cache.device() == q.device(), "token_attention: kv_cache: expected device ", q.device(), ", got ",
              kv_cache.device());
  TORCH_CHECK(out.scalar_type() == dt && out.dim() == 3 && out.device() == q.device(),
              "token_attention: out: expected a 3-dim ", dt, " tensor on ", q.device(), ", got ", out.scalar_type(),
              " shape ", out.sym_sizes(), " on ", out.device());
  check_index("kv_indices", kv_indices, at::kInt, q);
  check_index("kv_indptr", kv_indptr, at::kInt, q);
  if (q_indptr.has_value()) check_index("q_indptr", *q_indptr, at::kInt, q);
  TORCH_CHECK(num_kv == 2, "token_attention: layout: expected num_kv == 2, got ", num_kv);
  TORCH_CHECK(num_heads >= 1 && head_dim >= 1, "token_attention: layout: expected num_heads, head_dim >= 1, got ",
              num_heads, ", ", head_dim);
  if (key_scores.has_value()) {
    TORCH_CHECK(key_scores->scalar_type() == at::kFloat && key_scores->dim() == 2 &&
                    key_scores->device() == q.device(),
                "token_attention: key_scores: expected a 2-dim float32 tensor on ", q.device());
  }
  TORCH_CHECK(!score_out.has_value() || key_scores.has_value(),
              "token_attention: score_out: expected key_scores (its workspace), got None");
  if (score_out.has_value()) {
    check_index("score_out", *score_out, at::kFloat, q);
    TORCH_CHECK(mirror_starts.has_value() && kv_pos.has_value(),
                "token_attention: score_out: expected mirror_starts and kv_pos, got None");
    check_index("mirror_starts", *mirror_starts, at::kLong, q);
    check_index("kv_pos", *kv_pos, at::kInt, q);
  }
}

void check_sizes(const Tensor& q, const Tensor& kv_cache, const Tensor& kv_indices, const Tensor& kv_indptr,
                 const std::optional<Tensor>& q_indptr, const Tensor& out, const std::optional<Tensor>& key_scores,
                 const std::optional<Tensor>& score_out, const std::optional<Tensor>& mirror_starts,
                 const std::optional<Tensor>& kv_pos, int64_t num_blocks, int64_t block_size, int64_t num_heads,
                 int64_t head_dim, int64_t stride_block, int64_t stride_offset, int64_t stride_kv,
                 int64_t stride_head) {
  TORCH_CHECK(q.size(2) == head_dim && q.stride(2) == 1, "token_attention: q: expected head_dim ", head_dim,
              " with a contiguous last dim, got shape ", q.sizes(), " strides ", q.strides());
  TORCH_CHECK(q.size(1) % num_heads == 0, "token_attention: q: expected num_q_heads divisible by num_kv_heads (",
              num_heads, "), got ", q.size(1));
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1, "token_attention: out: expected shape ", q.sizes(),
              " with a contiguous last dim, got shape ", out.sizes(), " strides ", out.strides());
  TORCH_CHECK(kv_cache.numel() > 0 && kv_cache.stride(-1) == 1,
              "token_attention: kv_cache: expected a non-empty tensor with a contiguous last dim");
  TORCH_CHECK(kv_indices.is_contiguous() && kv_indptr.is_contiguous(),
              "token_attention: kv_indices, kv_indptr: expected contiguous tensors");
  TORCH_CHECK(kv_indptr.numel() >= 1, "token_attention: kv_indptr: expected num_reqs + 1 >= 1 entries, got 0");
  const int64_t num_reqs = kv_indptr.numel() - 1;
  if (q_indptr.has_value()) {
    TORCH_CHECK(q_indptr->is_contiguous() && q_indptr->numel() == kv_indptr.numel(),
                "token_attention: q_indptr: expected a contiguous tensor of ", kv_indptr.numel(), " entries, got ",
                q_indptr->sizes());
  } else {
    TORCH_CHECK(q.size(0) == num_reqs, "token_attention: q: expected one query per request in decode mode (",
                num_reqs, "), got ", q.size(0));
  }
  TORCH_CHECK(num_blocks >= 1 && block_size >= 1 && num_blocks <= (int64_t{1} << 31) / block_size,
              "token_attention: layout: expected 1 <= num_blocks * block_size <= 2**31, got ", num_blocks, " * ",
              block_size);
  TORCH_CHECK(stride_block >= 0 && stride_offset >= 0 && stride_kv >= 0 && stride_head >= 0,
              "token_attention: layout: expected non-negative strides");
  // The farthest element the layout addresses must lie inside kv_cache (never read out of bounds).
  int64_t span = 1;
  for (int64_t d = 0; d < kv_cache.dim(); ++d) span += (kv_cache.size(d) - 1) * kv_cache.stride(d);
  const int64_t far = (num_blocks - 1) * stride_block + (block_size - 1) * stride_offset + stride_kv +
                      (num_heads - 1) * stride_head + head_dim - 1;
  TORCH_CHECK(far < span, "token_attention: kv_cache: expected a tensor spanning the layout (", far + 1,
              " elements), got shape ", kv_cache.sizes(), " strides ", kv_cache.strides());
  if (key_scores.has_value()) {
    TORCH_CHECK(key_scores->is_contiguous() && key_scores->size(0) == kv_indices.numel() &&
                    key_scores->size(1) == num_heads,
                "token_attention: key_scores: expected a contiguous (", kv_indices.numel(), ", ", num_heads,
                ") tensor, got shape ", key_scores->sizes());
  }
  if (score_out.has_value()) {
    TORCH_CHECK(score_out->is_contiguous() && mirror_starts->is_contiguous() && kv_pos->is_contiguous(),
                "token_attention: score_out, mirror_starts, kv_pos: expected contiguous tensors");
    TORCH_CHECK(mirror_starts->numel() >= num_reqs, "token_attention: mirror_starts: expected >= ", num_reqs,
                " entries, got ", mirror_starts->numel());
    TORCH_CHECK(kv_pos->numel() == kv_indices.numel(), "token_attention: kv_pos: expected ", kv_indices.numel(),
                " entries like kv_indices, got ", kv_pos->numel());
  }
}

// ---------------------------------------------------------------- ops

void token_attention_cpu(const Tensor& q, const Tensor& kv_cache, const Tensor& kv_indices, const Tensor& kv_indptr,
                         const std::optional<Tensor>& q_indptr, const Tensor& out,
                         const std::optional<Tensor>& key_scores, const std::optional<Tensor>& score_out,
                         const std::optional<Tensor>& mirror_starts, const std::optional<Tensor>& kv_pos,
                         double scale, int64_t num_blocks, int64_t block_size, int64_t num_kv, int64_t num_heads,
                         int64_t head_dim, int64_t stride_block, int64_t stride_offset, int64_t stride_kv,
                         int64_t stride_head, int64_t cpu_isa) {
  check_types(q, kv_cache, kv_indices, kv_indptr, q_indptr, out, key_scores, score_out, mirror_starts, kv_pos,
              num_kv, num_heads, head_dim);
  check_sizes(q, kv_cache, kv_indices, kv_indptr, q_indptr, out, key_scores, score_out, mirror_starts, kv_pos,
              num_blocks, block_size, num_heads, head_dim, stride_block, stride_offset, stride_kv, stride_head);
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "token_attention: scale: expected a finite float > 0, got ", scale);
  const int64_t best = best_isa();
  TORCH_CHECK(cpu_isa >= -1 && cpu_isa <= best, "token_attention: cpu_isa: expected -1 or 0..", best,
              " (what this CPU runs), got ", cpu_isa);
  const int64_t isa = cpu_isa < 0 ? best : cpu_isa;

  Params p{};
  const int64_t nnz = kv_indices.numel(), num_reqs = kv_indptr.numel() - 1, num_q = q.size(0);
  p.q = static_cast<const char*>(q.data_ptr());
  p.q_s0 = q.stride(0);
  p.q_s1 = q.stride(1);
  p.out = static_cast<char*>(out.data_ptr());
  p.o_s0 = out.stride(0);
  p.o_s1 = out.stride(1);
  p.kv = static_cast<const char*>(kv_cache.data_ptr());
  p.kv_indices = kv_indices.data_ptr<int32_t>();
  p.key_scores = key_scores.has_value() ? key_scores->data_ptr<float>() : nullptr;
  p.num_reqs = num_reqs;
  p.num_q_tokens = num_q;
  p.num_q_heads = q.size(1);
  p.num_kv_heads = num_heads;
  p.head_dim = head_dim;
  p.group = q.size(1) / num_heads;
  p.nnz_max = nnz;
  p.num_slots = num_blocks * block_size;
  p.block_size = block_size;
  p.stride_block = stride_block;
  p.stride_offset = stride_offset;
  p.stride_kv = stride_kv;
  p.stride_head = stride_head;
  p.scale = static_cast<float>(scale);

  // NOTE: indptrs are clamped into range (the contract guarantees they already are on the
  // Python path), so a violated contract can never make the kernel read or write out of bounds.
  const int32_t* kp = kv_indptr.data_ptr<int32_t>();
  const int32_t* qp = q_indptr.has_value() ? q_indptr->data_ptr<int32_t>() : nullptr;
  std::vector<int32_t> kptr(num_reqs + 1), qptr(q_indptr.has_value() ? num_reqs + 1 : 0);
  for (int64_t r = 0; r <= num_reqs; ++r)
    kptr[r] = static_cast<int32_t>(std::clamp<int64_t>(kp[r], r ? kptr[r - 1] : 0, nnz));
  for (int64_t r = 0; r < static_cast<int64_t>(qptr.size()); ++r)
    qptr[r] = static_cast<int32_t>(std::clamp<int64_t>(qp[r], r ? qptr[r - 1] : 0, num_q));
  p.kv_indptr = kptr.data();
  p.q_indptr = qp ? qptr.data() : nullptr;

  if (p.key_scores != nullptr) std::fill(p.key_scores, p.key_scores + nnz * num_heads, 0.0f);
  // Query rows of no request (outside q_indptr's range) output zeros, like the reference.
  const int64_t covered0 = qp ? qptr[0] : 0, covered1 = qp ? qptr[num_reqs] : num_q;
  const int64_t D = head_dim, Hq = q.size(1);
  auto zero_rows = [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i)
      for (int64_t h = 0; h < Hq; ++h) {
        char* row = p.out + (i * p.o_s0 + h * p.o_s1) * out.element_size();
        std::memset(row, 0, D * out.element_size());  // +0.0 is all-zero bits in every float dtype
      }
  };
  zero_rows(0, covered0);
  zero_rows(covered1, num_q);

  std::vector<Unit> units;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t n_new = qp ? qptr[r + 1] - qptr[r] : 1, n_live = kptr[r + 1] - kptr[r];
    if (n_new == 0) continue;
    if (n_live == 0) {  // attends nothing: zeros
      const int64_t b = qp ? qptr[r] : r;
      zero_rows(b, b + n_new);
      continue;
    }
    // Without key scores a prefill request's queries split into tiles of their own units.
    const int64_t step = (p.key_scores != nullptr || !qp) ? n_new : kMaxTileQueries;
    for (int64_t g = 0; g < num_heads; ++g)
      for (int64_t i = 0; i < n_new; i += step) units.push_back({r, g, i, std::min(n_new, i + step)});
  }
  std::stable_sort(units.begin(), units.end(), [&](const Unit& a, const Unit& b) {
    return (kptr[a.req + 1] - kptr[a.req]) * (a.q1 - a.q0) > (kptr[b.req + 1] - kptr[b.req]) * (b.q1 - b.q0);
  });
  switch (q.scalar_type()) {
    case at::kFloat: run_all<float>(p, units, isa); break;
    case at::kHalf: run_all<c10::Half>(p, units, isa); break;
    default: run_all<c10::BFloat16>(p, units, isa); break;
  }

  if (score_out.has_value()) {
    // Each scored key's mass (its key scores summed over the kv heads) goes to its unique
    // destination; a destination outside score_out is skipped (the contract rejects it).
    float* so = score_out->data_ptr<float>();
    const int64_t size = score_out->numel();
    const int64_t* ms = mirror_starts->data_ptr<int64_t>();
    const int32_t* pos = kv_pos->data_ptr<int32_t>();
    at::parallel_for(0, num_reqs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if ((qp ? qptr[r + 1] - qptr[r] : 1) == 0) continue;
        for (int64_t j = kptr[r]; j < kptr[r + 1]; ++j) {
          const int64_t s = p.kv_indices[j], dst = ms[r] + pos[j];
          if (s < 0 || s >= p.num_slots || dst < 0 || dst >= size) continue;
          float mass = 0.0f;
          for (int64_t g = 0; g < num_heads; ++g) mass += p.key_scores[j * num_heads + g];
          so[dst] += mass;
        }
      }
    });
  }
}

void token_attention_meta(const Tensor& q, const Tensor& kv_cache, const Tensor& kv_indices,
                          const Tensor& kv_indptr, const std::optional<Tensor>& q_indptr, const Tensor& out,
                          const std::optional<Tensor>& key_scores, const std::optional<Tensor>& score_out,
                          const std::optional<Tensor>& mirror_starts, const std::optional<Tensor>& kv_pos,
                          double scale, int64_t num_blocks, int64_t block_size, int64_t num_kv, int64_t num_heads,
                          int64_t head_dim, int64_t stride_block, int64_t stride_offset, int64_t stride_kv,
                          int64_t stride_head, int64_t cpu_isa) {
  // Mutates its outputs in place and returns nothing: the fake kernel checks what symbolic shapes allow.
  check_types(q, kv_cache, kv_indices, kv_indptr, q_indptr, out, key_scores, score_out, mirror_starts, kv_pos,
              num_kv, num_heads, head_dim);
}

}  // namespace
}  // namespace vtoken

TORCH_LIBRARY_FRAGMENT(vtoken, m) {
  m.def(
      "token_attention(Tensor q, Tensor kv_cache, Tensor kv_indices, Tensor kv_indptr, Tensor? q_indptr, "
      "Tensor(a!) out, Tensor(b!)? key_scores, Tensor(c!)? score_out, Tensor? mirror_starts, Tensor? kv_pos, "
      "float scale, int num_blocks, int block_size, int num_kv, int num_heads, int head_dim, int stride_block, "
      "int stride_offset, int stride_kv, int stride_head, int cpu_isa=-1) -> ()");
}

TORCH_LIBRARY_IMPL(vtoken, CPU, m) { m.impl("token_attention", &vtoken::token_attention_cpu); }

TORCH_LIBRARY_IMPL(vtoken, Meta, m) { m.impl("token_attention", &vtoken::token_attention_meta); }
