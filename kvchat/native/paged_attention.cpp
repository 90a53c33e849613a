// kvchat's CPU attention over paged K/V: one call per layer for a batch of sequences.
//
// Why a kernel of our own: torch's CPU flash attention gives each (batch, head)
// pair to one thread and needs each sequence's K/V as one strided tensor, so a paged
// context is gathered (copied) first and a decode over a long context runs on one
// core per kv head. Here the unit of work is (sequence, kv head, row block, context
// split): K/V are read in place through the page list and a long decode is spread
// over every core. The kernel computes any causal chunk; kvchat sends it prefill
// chunks too where it beats torch's flash attention on the CPU at hand (bf16 without
// AMX tiles: docs/kernels.md has the measurements); on AMX, torch's
// blocked products on the tiles are faster for many query rows than these vector loops.
//
// Rows: a sequence's new tokens times the query heads that share a kv head, token
// major (row = token * group + head in group), so each K/V element loaded serves
// every query head of its group. Each work item keeps an online softmax over its
// token range and writes an unnormalized partial (acc, max, sum); a second pass
// merges the splits of each row in a fixed order. The splits depend only on the
// sequence's own lengths, never on what else is in the batch, so a sequence's
// result is the same whatever it is batched with.
//
// Arithmetic is on 16 floats at a time: AVX-512 intrinsics where the compiler targets
// them (-march=native), two AVX2 vectors where it targets AVX2 + FMA (x86-64-v3), plain
// loops for it to vectorize elsewhere. No infinity is ever
// produced (-ffast-math assumes none): masked scores are excluded by bounds, not -inf.
// A decode step's new K/V can come with the call: they are stored at their slots
// first (a copy, bf16/fp32 stores), which saves the caller four ops a layer.
//
// Many rows over bf16 K/V with AVX512-BF16 take `run_lanes_bf16` (bf16 pair products,
// half the instructions of fp32 ones). It takes two blocks of 16 rows a pass where
// there are more than 16, so each K/V pair is broadcast and each V tile interleaved
// once for 32 rows.
// Decodes over bf16 K/V on a CPU with AVX512-BF16 take `run_few_bf16`: scores by bf16
// pair products (exact) summed in fp32, 16 tokens' sums at once, V widened once a token
// for every row, and the next tile's K/V rows prefetched. A long context is read from
// memory, not cache, in a real step (the weights pass through between layers), so the
// prefetch matters as much as the arithmetic. Measurements: docs/kernels.md.
// Compiled on first use by kvchat/native/build.py. One file on purpose: it is one
// translation unit built on the user's machine, and every path shares the work items
// and the merge pass above.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "element_types.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kSplitTokens = 256;  // context tokens per work item (a power of two)
constexpr int64_t kRowBlock = 64;      // rows per work item
constexpr int64_t kTile = 32;          // context tokens per inner tile
constexpr int64_t kFewRows = 8;        // up to this many rows: dot products per row
constexpr int64_t kParallelWork = 2048;  // row-tokens below which one thread does it all
constexpr float kNoScore = -1e30f;

// 2^f for f in [-0.5, 0.5], highest power first (Horner): the vector paths' e^x is
// 2^(x log2 e) split into a power of two and this polynomial of the rest
constexpr int kExp2Terms = 7;
constexpr float kExp2Poly[kExp2Terms] = {1.54035304e-4f, 1.33335581e-3f, 9.61812911e-3f,
                                         5.55041087e-2f, 2.40226507e-1f, 6.93147181e-1f, 1.f};

// ---- 16 floats at a time: AVX-512 where the compiler targets it, two AVX2 vectors where
// that is the best it has (the plain loops left a decode's exp and horizontal sums
// scalar there: attention took 3x its bf16 time on an AVX2 CPU), plain loops elsewhere.
#if defined(__AVX512F__)
using V16 = __m512;
inline V16 vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V16 x) { _mm512_storeu_ps(p, x); }
inline V16 vset1(float x) { return _mm512_set1_ps(x); }
inline V16 vfma(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
inline V16 vmul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 vsub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 vadd(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 vmax(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline float vsum(V16 x) { return _mm512_reduce_add_ps(x); }
inline float vhmax(V16 x) { return _mm512_reduce_max_ps(x); }
inline V16 vexp(V16 x) {  // e^x for x <= 0, relative error ~2e-7
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const V16 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const V16 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const V16 f = _mm512_sub_ps(t, n);
  V16 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}
// a where x <= y, else b (lane by lane)
inline V16 vselect_le(V16 x, V16 y, V16 a, V16 b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, y, _CMP_LE_OQ), b, a);
}
template <typename T>
inline V16 vconvert(const T* p) { return kvchat::widen16(p); }
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 {
  __m256 lo, hi;
};
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V16 x) { _mm256_storeu_ps(p, x.lo), _mm256_storeu_ps(p + 8, x.hi); }
inline V16 vset1(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
inline V16 vfma(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float vsum(V16 x) {
  const __m256 a = _mm256_add_ps(x.lo, x.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vhmax(V16 x) {
  const __m256 a = _mm256_max_ps(x.lo, x.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// the AVX-512 path's e^x, lane for lane the same: 2^n built in the exponent bits
// (n >= -126 after the clamp, so a normal number) where AVX-512 scales by it
inline __m256 vexp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}
inline V16 vexp(V16 x) { return {vexp8(x.lo), vexp8(x.hi)}; }
// a where x <= y, else b (lane by lane)
inline V16 vselect_le(V16 x, V16 y, V16 a, V16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, y.lo, _CMP_LE_OQ)),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, y.hi, _CMP_LE_OQ))};
}
inline V16 vconvert(const float* p) { return vload(p); }
inline V16 vconvert(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(h));
  const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
inline V16 vconvert(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
#else
struct V16 {
  float x[16];
};
inline V16 vload(const float* p) { V16 r; for (int i = 0; i < 16; ++i) r.x[i] = p[i]; return r; }
inline void vstore(float* p, V16 a) { for (int i = 0; i < 16; ++i) p[i] = a.x[i]; }
inline V16 vset1(float v) { V16 r; for (int i = 0; i < 16; ++i) r.x[i] = v; return r; }
inline V16 vfma(V16 a, V16 b, V16 c) { for (int i = 0; i < 16; ++i) c.x[i] += a.x[i] * b.x[i]; return c; }
inline V16 vmul(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.x[i] *= b.x[i]; return a; }
inline V16 vsub(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.x[i] -= b.x[i]; return a; }
inline V16 vadd(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.x[i] += b.x[i]; return a; }
inline V16 vmax(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.x[i] = std::max(a.x[i], b.x[i]); return a; }
inline float vsum(V16 a) { float s = 0.f; for (int i = 0; i < 16; ++i) s += a.x[i]; return s; }
inline float vhmax(V16 a) { float m = a.x[0]; for (int i = 1; i < 16; ++i) m = std::max(m, a.x[i]); return m; }
inline V16 vexp(V16 a) { for (int i = 0; i < 16; ++i) a.x[i] = std::exp(std::max(a.x[i], -87.f)); return a; }
inline V16 vselect_le(V16 x, V16 y, V16 a, V16 b) {
  for (int i = 0; i < 16; ++i) a.x[i] = x.x[i] <= y.x[i] ? a.x[i] : b.x[i];
  return a;
}
template <typename T>
inline V16 vconvert(const T* p) { V16 r; for (int i = 0; i < 16; ++i) r.x[i] = kvchat::widen(p[i]); return r; }
#endif

// a where lo <= t <= hi (lane by lane: a token within a row's window and causal bound), else b
inline V16 seen(V16 t, V16 lo, V16 hi, V16 a, V16 b) {
  return vselect_le(lo, t, vselect_le(t, hi, a, b), b);
}

#if defined(__AVX512BF16__)
// Lane j of the result: the sum of a[j]'s 16 lanes (16 horizontal sums as one transpose).
inline __m512 sum_each16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                  _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                  _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}
#endif

using kvchat::narrow;
using kvchat::widen;

struct WorkItem {
  int64_t seq;
  int64_t head;     // kv head
  int64_t row0;     // first row of the block (within the sequence's rows for this head)
  int64_t rows;
  int64_t t0, t1;   // context token range
  int64_t scratch;  // float offset of this item's partial: acc [rows, D], max [rows], sum [rows]
};

template <typename QT, typename KT, int D>
struct Kernel {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  static constexpr int kVecs = D / 16;

  const QT* q;                  // [T, Hq, D], rows and heads strided (a view of fused qkv)
  int64_t q_row_stride, q_head_stride;
  const KT* k;                  // [slots, Hkv, D]
  const KT* v;
  const QT* k_scale = nullptr;  // int8 only: one scale per slot and kv head [slots, Hkv]
  const QT* v_scale = nullptr;
  const int64_t* pages;         // concatenated page lists
  const int64_t* page_starts;   // [B + 1]
  const int64_t* q_starts;      // [B + 1]
  const int64_t* ctx_lens;      // [B]
  int64_t page_shift, hkv, hq, group;
  float scale;
  int64_t window = 0;  // a sliding window's size (0: none): a row at p sees from p - window + 1

  // The first context position a row whose last is `pos` sees.
  inline int64_t first_seen(int64_t pos) const { return window > 0 ? pos - window + 1 : 0; }

  // The store slot of context token t of a sequence whose page list is `seq_pages`.
  inline int64_t slot(const int64_t* seq_pages, int64_t t) const {
    return (seq_pages[t >> page_shift] << page_shift) + (t & ((int64_t{1} << page_shift) - 1));
  }

  // Row `row` of item w's rows: its query (D values) and the last context position it sees.
  inline const QT* query_row(const WorkItem& w, int64_t row, int64_t& pos) const {
    const int64_t tok = row / group;
    const int64_t head_q = w.head * group + row % group;
    pos = ctx_lens[w.seq] - (q_starts[w.seq + 1] - q_starts[w.seq]) + tok;
    return q + (q_starts[w.seq] + tok) * q_row_stride + head_q * q_head_stride;
  }

  // One context token's K or V row for `head`, as floats.
  inline void load_row(const KT* base, const QT* scales, int64_t s, int64_t head,
                       float* __restrict out) const {
    const KT* src = base + (s * hkv + head) * D;
    if (scales == nullptr) {
      for (int c = 0; c < kVecs; ++c) vstore(out + 16 * c, vconvert(src + 16 * c));
      return;
    }
    const V16 sc = vset1(widen(scales[s * hkv + head]));
    for (int c = 0; c < kVecs; ++c) vstore(out + 16 * c, vmul(vconvert(src + 16 * c), sc));
  }

  // Many rows: 16 of them at a time as the lanes of every vector, so a K or V element
  // is broadcast against 16 rows' queries, the softmax runs across rows lane by lane,
  // and nothing is transposed or reduced horizontally. Rows [r0, r0 + lanes) of `w`.
  void run_lanes(const WorkItem& w, int64_t r0, int64_t lanes, float* scratch) const {
    const int64_t R = w.rows;
    const int64_t* seq_pages = pages + page_starts[w.seq];
    alignas(64) float qt[D][16] = {};  // queries transposed, prescaled; unused lanes zero
    alignas(64) float posf[16], lof[16];
    int64_t last_pos = 0;
    for (int64_t i = 0; i < 16; ++i) {
      if (i >= lanes) {
        posf[i] = -1.f;  // sees nothing
        lof[i] = 0.f;
        continue;
      }
      const QT* src = query_row(w, w.row0 + r0 + i, last_pos);
      for (int d = 0; d < D; ++d) qt[d][i] = widen(src[d]) * scale;
      posf[i] = static_cast<float>(last_pos);
      lof[i] = static_cast<float>(first_seen(last_pos));
    }
    const V16 pos = vload(posf), lo = vload(lof);
    const V16 no_score = vset1(kNoScore), zero = vset1(0.f);
    V16 m = no_score, l = zero;
    alignas(64) float acc[D][16] = {};
    alignas(64) float krow[kTile][D];
    alignas(64) float vrow[kTile][D];
    alignas(64) float p[kTile][16];
    const int64_t t_end = std::min(w.t1, last_pos + 1);
    for (int64_t t0 = w.t0; t0 < t_end; t0 += kTile) {
      const int64_t T = std::min(kTile, t_end - t0);
      for (int64_t j = 0; j < T; ++j) {
        const int64_t t = t0 + j;
        const int64_t s = slot(seq_pages, t);
        load_row(k, k_scale, s, w.head, krow[j]);
        load_row(v, v_scale, s, w.head, vrow[j]);
      }
      for (int64_t j = T; j < kTile; ++j)
        for (int d = 0; d < D; ++d) krow[j][d] = vrow[j][d] = 0.f;
      // scores of 8 tokens at a time: 8 independent FMA chains over the head dimension
      V16 tile_max = no_score;
      for (int64_t j0 = 0; j0 < kTile; j0 += 8) {
        V16 a[8];
        for (int u = 0; u < 8; ++u) a[u] = zero;
        for (int d = 0; d < D; ++d) {
          const V16 qd = vload(qt[d]);
          for (int u = 0; u < 8; ++u) a[u] = vfma(vset1(krow[j0 + u][d]), qd, a[u]);
        }
        for (int u = 0; u < 8; ++u) {
          const V16 t = vset1(static_cast<float>(t0 + j0 + u));
          const V16 sc = j0 + u < T ? seen(t, lo, pos, a[u], no_score) : no_score;
          vstore(p[j0 + u], sc);
          tile_max = vmax(tile_max, sc);
        }
      }
      const V16 m_new = vmax(m, tile_max);
      const V16 correction = vexp(vsub(m, m_new));
      V16 tile_sum = zero;
      for (int64_t j = 0; j < T; ++j) {
        const V16 t = vset1(static_cast<float>(t0 + j));
        const V16 e = seen(t, lo, pos, vexp(vsub(vload(p[j]), m_new)), zero);
        vstore(p[j], e);
        tile_sum = vadd(tile_sum, e);
      }
      l = vfma(l, correction, tile_sum);
      m = m_new;
      // acc[d] = acc[d] * correction + sum_j v[j][d] * p[j]: 8 dims at a time
      for (int d0 = 0; d0 < D; d0 += 8) {
        V16 a[8];
        for (int u = 0; u < 8; ++u) a[u] = vmul(vload(acc[d0 + u]), correction);
        for (int64_t j = 0; j < T; ++j) {
          const V16 pj = vload(p[j]);
          for (int u = 0; u < 8; ++u) a[u] = vfma(vset1(vrow[j][d0 + u]), pj, a[u]);
        }
        for (int u = 0; u < 8; ++u) vstore(acc[d0 + u], a[u]);
      }
    }
    // the item's partial for these rows, in the layout the merge reads
    float* out = scratch + w.scratch;  // acc [R, D], max [R], sum [R]
    alignas(64) float mf[16], lf[16];
    vstore(mf, m);
    vstore(lf, l);
    for (int64_t i = 0; i < lanes; ++i) {
      for (int d = 0; d < D; ++d) out[(r0 + i) * D + d] = acc[d][i];
      out[R * D + r0 + i] = mf[i];
      out[R * D + R + r0 + i] = lf[i];
    }
  }


#if defined(__AVX512BF16__)
  // Few rows over bf16 K/V (a decode's query heads of one kv head), R known at compile
  // time so every row's accumulator stays in registers. Scores of 16 tokens at a time:
  // bf16 pair products summed in fp32 (vdpbf16ps, the products exact), the 16 tokens'
  // sums turned into one vector by a transpose; V widened once a token for all rows.
  // The next tile's K/V rows are prefetched while this one computes.
  template <int R>
  void run_few_bf16(const WorkItem& w, float* scratch) const {
    constexpr int kPairs = D / 32;  // 32 bf16 a vector
    const int64_t* seq_pages = pages + page_starts[w.seq];
    __m512bh qv[R][kPairs];
    int64_t pos[R];
    for (int r = 0; r < R; ++r) {
      const QT* src = query_row(w, w.row0 + r, pos[r]);
      for (int c = 0; c < kPairs; ++c)
        qv[r][c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(src + 32 * c));
    }
    float mx[R], sum[R];
    V16 acc[R][kVecs];
    for (int r = 0; r < R; ++r) {
      mx[r] = kNoScore;
      sum[r] = 0.f;
      for (int c = 0; c < kVecs; ++c) acc[r][c] = vset1(0.f);
    }
    const V16 scale_v = vset1(scale), no_score = vset1(kNoScore);
    const int64_t t_end = std::min(w.t1, pos[R - 1] + 1);  // rows are in position order
    alignas(64) float p[R][16];
    const KT* krow[16];
    const KT* vrow[16];
    for (int64_t t0 = w.t0; t0 < t_end; t0 += 16) {
      const int64_t T = std::min<int64_t>(16, t_end - t0);
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t t = t0 + std::min(j, T - 1);  // past the end: a real row, masked out
        const int64_t s = slot(seq_pages, t) * hkv + w.head;
        krow[j] = k + s * D;
        vrow[j] = v + s * D;
      }
      for (int64_t t = t0 + 16; t < std::min(t0 + 32, t_end); ++t) {
        const int64_t s = slot(seq_pages, t) * hkv + w.head;
        for (int64_t b = 0; b < int64_t(D * sizeof(KT)); b += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(k + s * D) + b);
          __builtin_prefetch(reinterpret_cast<const char*>(v + s * D) + b);
        }
      }
      V16 corr[R];
      for (int r = 0; r < R; ++r) {
        V16 dots[16];
        for (int j = 0; j < 16; ++j) {
          V16 a = _mm512_dpbf16_ps(vset1(0.f), qv[r][0],
                                   (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(krow[j])));
          for (int c = 1; c < kPairs; ++c)
            a = _mm512_dpbf16_ps(
                a, qv[r][c],
                (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(krow[j] + 32 * c)));
          dots[j] = a;
        }
        const int64_t visible = std::max<int64_t>(0, std::min(T, pos[r] - t0 + 1));
        const int64_t before = std::clamp<int64_t>(first_seen(pos[r]) - t0, 0, 16);
        const __mmask16 keep = static_cast<__mmask16>(((uint32_t{1} << visible) - 1) &
                                                      ~((uint32_t{1} << before) - 1));
        const V16 sc = _mm512_mask_blend_ps(keep, no_score, vmul(sum_each16(dots), scale_v));
        const float m_new = std::max(mx[r], vhmax(sc));
        const V16 e = _mm512_maskz_mov_ps(keep, vexp(vsub(sc, vset1(m_new))));
        corr[r] = vexp(vset1(mx[r] - m_new));  // inline: a call would spill every register
        mx[r] = m_new;
        sum[r] = sum[r] * _mm512_cvtss_f32(corr[r]) + vsum(e);
        vstore(p[r], e);
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kVecs; ++c) acc[r][c] = vmul(acc[r][c], corr[r]);
      for (int64_t j = 0; j < T; ++j) {
        V16 vv[kVecs];
        for (int c = 0; c < kVecs; ++c) vv[c] = vconvert(vrow[j] + 16 * c);
        for (int r = 0; r < R; ++r) {
          const V16 pj = vset1(p[r][j]);
          for (int c = 0; c < kVecs; ++c) acc[r][c] = vfma(pj, vv[c], acc[r][c]);
        }
      }
    }
    float* out = scratch + w.scratch;  // acc [R, D], max [R], sum [R]
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < kVecs; ++c) vstore(out + r * D + 16 * c, acc[r][c]);
      out[R * D + r] = mx[r];
      out[R * D + R + r] = sum[r];
    }
  }
#endif

#if defined(__AVX512BF16__)
  // Many rows over bf16 K/V, NB blocks of 16 rows from row r0 at a time: run_lanes'
  // layout (16 rows as the lanes of every vector, the softmax lane by lane) with the
  // products as bf16 pairs summed in fp32 (vdpbf16ps), half the instructions of
  // widening every element to fp32. Scores: a row's query as 32 (dim, dim + 1) pairs
  // against a K row's pair broadcast straight from the store (exact products). Values:
  // the probabilities rounded to bf16 (as torch's flash attention does for bf16 before
  // its product with V; the softmax sums stay fp32) as (token, token + 1) pairs against
  // V's two rows interleaved once a tile.
  template <int NB>
  void run_lanes_bf16(const WorkItem& w, int64_t r0, float* scratch) const {
    constexpr int kPairs = D / 2;
    const int64_t R = w.rows;
    const int64_t* seq_pages = pages + page_starts[w.seq];
    // block b, lane i: row r0 + 16 b + i's (q[2p], q[2p+1]); lanes past the rows zero
    alignas(64) uint32_t qp[NB][kPairs][16] = {};
    alignas(64) float posf[NB][16], lof[NB][16];
    int64_t last_pos = 0;
    for (int b = 0; b < NB; ++b) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t row = r0 + 16 * b + i;
        if (row >= R) {
          posf[b][i] = -1.f;  // sees nothing
          lof[b][i] = 0.f;
          continue;
        }
        const QT* src = query_row(w, w.row0 + row, last_pos);
        for (int p = 0; p < kPairs; ++p) std::memcpy(&qp[b][p][i], src + 2 * p, sizeof(uint32_t));
        posf[b][i] = static_cast<float>(last_pos);
        lof[b][i] = static_cast<float>(first_seen(last_pos));
      }
    }
    V16 pos[NB], first[NB], m[NB], l[NB];
    const V16 no_score = vset1(kNoScore), zero = vset1(0.f), scale_v = vset1(scale);
    for (int b = 0; b < NB; ++b) {
      pos[b] = vload(posf[b]), first[b] = vload(lof[b]), m[b] = no_score, l[b] = zero;
    }
    alignas(64) float acc[NB][D][16] = {};
    alignas(64) float p[NB][kTile][16];
    alignas(64) uint32_t pp[NB][kTile / 2][16];  // lane i: row i's (p[2j], p[2j+1]) as bf16
    alignas(64) uint32_t vp[kTile / 2][D];       // (v[2j][d], v[2j+1][d]) as bf16
    // vpermt2w indices interleaving two rows' 16-value halves: (a0, b0, a1, b1, ...),
    // and one row's two halves the same way
    alignas(64) int16_t lo_idx[32], hi_idx[32], halves_idx[32];
    for (int i = 0; i < 16; ++i) {
      lo_idx[2 * i] = static_cast<int16_t>(i), lo_idx[2 * i + 1] = static_cast<int16_t>(32 + i);
      hi_idx[2 * i] = static_cast<int16_t>(16 + i), hi_idx[2 * i + 1] = static_cast<int16_t>(48 + i);
      halves_idx[2 * i] = static_cast<int16_t>(i);
      halves_idx[2 * i + 1] = static_cast<int16_t>(16 + i);
    }
    const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
    const __m512i halves = _mm512_load_si512(halves_idx);
    const __m512i zero_i = _mm512_setzero_si512();
    const KT* krow[kTile];
    const KT* vrow[kTile];
    const int64_t t_end = std::min(w.t1, last_pos + 1);
    for (int64_t t0 = w.t0; t0 < t_end; t0 += kTile) {
      const int64_t T = std::min(kTile, t_end - t0);
      for (int64_t j = 0; j < kTile; ++j) {
        const int64_t t = t0 + std::min(j, T - 1);  // past the end: a real row, masked out
        const int64_t s = slot(seq_pages, t) * hkv + w.head;
        krow[j] = k + s * D;
        vrow[j] = v + s * D;
      }
      // scores of 8 tokens at a time for every block: each K pair broadcast once
      V16 tile_max[NB];
      for (int b = 0; b < NB; ++b) tile_max[b] = no_score;
      for (int64_t j0 = 0; j0 < kTile; j0 += 8) {
        V16 a[NB][8];
        for (int b = 0; b < NB; ++b)
          for (int u = 0; u < 8; ++u) a[b][u] = zero;
        for (int c = 0; c < kPairs; ++c) {
          __m512bh qc[NB];
          for (int b = 0; b < NB; ++b) qc[b] = (__m512bh)_mm512_load_si512(qp[b][c]);
          for (int u = 0; u < 8; ++u) {
            uint32_t kk;
            std::memcpy(&kk, krow[j0 + u] + 2 * c, sizeof(kk));
            const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(kk));
            for (int b = 0; b < NB; ++b) a[b][u] = _mm512_dpbf16_ps(a[b][u], qc[b], kb);
          }
        }
        for (int b = 0; b < NB; ++b)
          for (int u = 0; u < 8; ++u) {
            const V16 t = vset1(static_cast<float>(t0 + j0 + u));
            const V16 sc =
                j0 + u < T ? seen(t, first[b], pos[b], vmul(a[b][u], scale_v), no_score) : no_score;
            vstore(p[b][j0 + u], sc);
            tile_max[b] = vmax(tile_max[b], sc);
          }
      }
      V16 correction[NB];
      const int64_t pairs = (T + 1) / 2;
      for (int b = 0; b < NB; ++b) {
        const V16 m_new = vmax(m[b], tile_max[b]);
        correction[b] = vexp(vsub(m[b], m_new));
        V16 tile_sum = zero;
        for (int64_t jp = 0; jp < pairs; ++jp) {
          V16 e[2];
          for (int h = 0; h < 2; ++h) {
            const int64_t j = 2 * jp + h;
            const V16 t = vset1(static_cast<float>(t0 + j));
            e[h] = j < T ? seen(t, first[b], pos[b], vexp(vsub(vload(p[b][j]), m_new)), zero) : zero;
            tile_sum = vadd(tile_sum, e[h]);
          }
          // (e0[i], e1[i]) as bf16 pairs: e0 in the low 16 values, e1 in the high, interleaved
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]);
          _mm512_store_si512(pp[b][jp], _mm512_permutexvar_epi16(halves, both));
        }
        l[b] = vfma(l[b], correction[b], tile_sum);
        m[b] = m_new;
      }
      // V rows 2jp and 2jp + 1 interleaved value by value (a missing row: zeros), once for
      // every block
      for (int64_t jp = 0; jp < pairs; ++jp) {
        const bool second = 2 * jp + 1 < T;
        for (int c = 0; c < D / 32; ++c) {
          const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(vrow[2 * jp] + 32 * c));
          const __m512i b = second ? _mm512_loadu_si512(reinterpret_cast<const void*>(
                                         vrow[2 * jp + 1] + 32 * c))
                                   : zero_i;
          _mm512_store_si512(vp[jp] + 32 * c, _mm512_permutex2var_epi16(a, lo, b));
          _mm512_store_si512(vp[jp] + 32 * c + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
      }
      // acc[d] = acc[d] * correction + sum over token pairs of (p pair) . (v pair at d)
      for (int d0 = 0; d0 < D; d0 += 8) {
        V16 a[NB][8];
        for (int b = 0; b < NB; ++b)
          for (int u = 0; u < 8; ++u) a[b][u] = vmul(vload(acc[b][d0 + u]), correction[b]);
        for (int64_t jp = 0; jp < pairs; ++jp) {
          __m512bh pj[NB];
          for (int b = 0; b < NB; ++b) pj[b] = (__m512bh)_mm512_load_si512(pp[b][jp]);
          for (int u = 0; u < 8; ++u) {
            const __m512bh vb = (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[jp][d0 + u]));
            for (int b = 0; b < NB; ++b) a[b][u] = _mm512_dpbf16_ps(a[b][u], pj[b], vb);
          }
        }
        for (int b = 0; b < NB; ++b)
          for (int u = 0; u < 8; ++u) vstore(acc[b][d0 + u], a[b][u]);
      }
    }
    float* out = scratch + w.scratch;  // acc [R, D], max [R], sum [R]
    for (int b = 0; b < NB; ++b) {
      alignas(64) float mf[16], lf[16];
      vstore(mf, m[b]);
      vstore(lf, l[b]);
      for (int64_t i = 0; i < 16 && r0 + 16 * b + i < R; ++i) {
        const int64_t row = r0 + 16 * b + i;
        for (int d = 0; d < D; ++d) out[row * D + d] = acc[b][d][i];
        out[R * D + row] = mf[i];
        out[R * D + R + row] = lf[i];
      }
    }
  }
#endif

  // Few rows (a decode's query heads of one kv head): each row's score for a token is
  // one dot product over the head dimension.
  void run(const WorkItem& w, float* scratch) const {
    if (w.rows > kFewRows) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<QT, c10::BFloat16> && std::is_same_v<KT, c10::BFloat16> &&
                    D % 32 == 0) {
        // two blocks of 16 rows a pass over the K/V tiles where there are more than 16
        int64_t r0 = 0;
        for (; w.rows - r0 > 16; r0 += 32) run_lanes_bf16<2>(w, r0, scratch);
        if (r0 < w.rows) run_lanes_bf16<1>(w, r0, scratch);
        return;
      }
#endif
      for (int64_t r0 = 0; r0 < w.rows; r0 += 16)
        run_lanes(w, r0, std::min<int64_t>(16, w.rows - r0), scratch);
      return;
    }
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<QT, c10::BFloat16> && std::is_same_v<KT, c10::BFloat16> &&
                  D % 32 == 0) {
      switch (w.rows) {
        case 1: return run_few_bf16<1>(w, scratch);
        case 2: return run_few_bf16<2>(w, scratch);
        case 3: return run_few_bf16<3>(w, scratch);
        case 4: return run_few_bf16<4>(w, scratch);
        case 5: return run_few_bf16<5>(w, scratch);
        case 6: return run_few_bf16<6>(w, scratch);
        case 7: return run_few_bf16<7>(w, scratch);
        case 8: return run_few_bf16<8>(w, scratch);
        default: break;
      }
    }
#endif
    const int64_t R = w.rows;
    const int64_t* seq_pages = pages + page_starts[w.seq];
    // Query rows as floats, prescaled; each row's position is the last token it may see.
    alignas(64) float qf[kFewRows][D];
    int64_t pos[kFewRows];
    for (int64_t r = 0; r < R; ++r) {
      const QT* src = query_row(w, w.row0 + r, pos[r]);
      for (int d = 0; d < D; ++d) qf[r][d] = widen(src[d]) * scale;
    }
    float* acc = scratch + w.scratch;  // [R, D]
    float* mx = acc + R * D;           // [R]
    float* sum = mx + R;               // [R]
    for (int64_t r = 0; r < R; ++r) {
      mx[r] = kNoScore;
      sum[r] = 0.f;
      for (int d = 0; d < D; ++d) acc[r * D + d] = 0.f;
    }
    const int64_t t_end = std::min(w.t1, pos[R - 1] + 1);  // rows are in position order
    alignas(64) float krow[kTile][D];
    alignas(64) float vrow[kTile][D];
    alignas(64) float s[kFewRows][kTile];
    for (int64_t t0 = w.t0; t0 < t_end; t0 += kTile) {
      const int64_t T = std::min(kTile, t_end - t0);
      int64_t slots[kTile];
      for (int64_t j = 0; j < T; ++j) {
        const int64_t t = t0 + j;
        slots[j] = slot(seq_pages, t);
      }
      {  // the next tile's K/V rows, fetched while this tile computes
        const int64_t n0 = t0 + kTile;
        const int64_t nT = std::min(kTile, t_end - n0);
        for (int64_t j = 0; j < nT; ++j) {
          const int64_t t = n0 + j;
          const int64_t s = slot(seq_pages, t);
          const char* kp = reinterpret_cast<const char*>(k + (s * hkv + w.head) * D);
          const char* vp = reinterpret_cast<const char*>(v + (s * hkv + w.head) * D);
          for (int64_t b = 0; b < int64_t(D * sizeof(KT)); b += 64) {
            __builtin_prefetch(kp + b);
            __builtin_prefetch(vp + b);
          }
        }
      }
      for (int64_t j = 0; j < T; ++j) load_row(k, k_scale, slots[j], w.head, krow[j]);
      for (int64_t r = 0; r < R; ++r) {
        V16 qv[kVecs];
        for (int c = 0; c < kVecs; ++c) qv[c] = vload(qf[r] + 16 * c);
        for (int64_t j = 0; j < T; ++j) {
          V16 dot = vmul(qv[0], vload(krow[j]));
          for (int c = 1; c < kVecs; ++c) dot = vfma(qv[c], vload(krow[j] + 16 * c), dot);
          s[r][j] = vsum(dot);
        }
      }
      for (int64_t j = 0; j < T; ++j) load_row(v, v_scale, slots[j], w.head, vrow[j]);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t visible = std::min<int64_t>(T, pos[r] - t0 + 1);  // causal bound
        const int64_t before = std::clamp<int64_t>(first_seen(pos[r]) - t0, 0, T);  // window
        if (visible <= before) continue;
        float* __restrict sr = s[r];
        for (int64_t j = 0; j < before; ++j) sr[j] = kNoScore;
        for (int64_t j = visible; j < kTile; ++j) sr[j] = kNoScore;
        const float m_new = std::max(mx[r], vhmax(vmax(vload(sr), vload(sr + 16))));
        const V16 m_vec = vset1(m_new);
        const V16 p0 = vexp(vsub(vload(sr), m_vec));
        const V16 p1 = vexp(vsub(vload(sr + 16), m_vec));
        vstore(sr, p0), vstore(sr + 16, p1);
        for (int64_t j = 0; j < before; ++j) sr[j] = 0.f;  // masked: exactly nothing
        for (int64_t j = visible; j < kTile; ++j) sr[j] = 0.f;
        const float correction = std::exp(mx[r] - m_new);
        mx[r] = m_new;
        sum[r] = sum[r] * correction + vsum(vload(sr)) + vsum(vload(sr + 16));
        float* __restrict a = acc + r * D;
        V16 av[kVecs];
        const V16 corr = vset1(correction);
        for (int c = 0; c < kVecs; ++c) av[c] = vmul(vload(a + 16 * c), corr);
        for (int64_t j = before; j < visible; ++j) {
          const V16 p = vset1(sr[j]);
          for (int c = 0; c < kVecs; ++c) av[c] = vfma(p, vload(vrow[j] + 16 * c), av[c]);
        }
        for (int c = 0; c < kVecs; ++c) vstore(a + 16 * c, av[c]);
      }
    }
  }
};

template <typename QT, typename KT, int D>
void attend_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& k_scale, const at::Tensor& v_scale,
                  const at::Tensor& pages, const at::Tensor& page_starts,
                  const at::Tensor& q_starts, const at::Tensor& ctx_lens, int64_t page_size,
                  double scale, int64_t window, at::Tensor& out) {
  const int64_t B = ctx_lens.size(0);
  const int64_t hq = q.size(1);
  const int64_t hkv = k.size(1);
  const int64_t group = hq / hkv;
  Kernel<QT, KT, D> kern;
  kern.q = q.data_ptr<QT>();
  kern.q_row_stride = q.stride(0);
  kern.q_head_stride = q.stride(1);
  kern.k = reinterpret_cast<const KT*>(k.data_ptr());
  kern.v = reinterpret_cast<const KT*>(v.data_ptr());
  if (k_scale.defined()) {
    kern.k_scale = k_scale.data_ptr<QT>();
    kern.v_scale = v_scale.data_ptr<QT>();
  }
  kern.pages = pages.data_ptr<int64_t>();
  kern.page_starts = page_starts.data_ptr<int64_t>();
  kern.q_starts = q_starts.data_ptr<int64_t>();
  kern.ctx_lens = ctx_lens.data_ptr<int64_t>();
  TORCH_CHECK(page_size > 0 && (page_size & (page_size - 1)) == 0, "page_size: a power of two");
  int64_t shift = 0;
  while ((int64_t{1} << shift) < page_size) ++shift;
  kern.page_shift = shift;
  kern.hkv = hkv;
  kern.hq = hq;
  kern.group = group;
  kern.scale = static_cast<float>(scale);
  kern.window = window;

  // Work items: (sequence, kv head, row block, context split). A sequence whose rows fit
  // in one block gets its context split so that even one long decode fills every core.
  std::vector<WorkItem> items;
  std::vector<int64_t> block_first_item;  // per (seq, head, row block): first item index
  int64_t scratch_floats = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = kern.q_starts[b + 1] - kern.q_starts[b];
    const int64_t L = kern.ctx_lens[b];
    const int64_t rows = n * group;
    // A sliding window: the context is read from the first query's window on, and each
    // row masks what lies before its own (`first_seen`).
    const int64_t start = window > 0 ? std::max<int64_t>(0, L - n - window + 1) : 0;
    const int64_t splits =
        std::max<int64_t>(1, (L - start + kSplitTokens - 1) / kSplitTokens);
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const int64_t R = std::min(kRowBlock, rows - r0);
        block_first_item.push_back(static_cast<int64_t>(items.size()));
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t t0 = start + sp * kSplitTokens;
          items.push_back({b, h, r0, R, t0, std::min(L, t0 + kSplitTokens), scratch_floats});
          scratch_floats += R * (D + 2);
        }
      }
    }
  }
  block_first_item.push_back(static_cast<int64_t>(items.size()));
  std::vector<float> scratch(static_cast<size_t>(scratch_floats));
  float* scratch_ptr = scratch.data();
  // Below a few hundred tokens of context, waking the thread pool costs more than the
  // attention itself; above, two cores stream K/V from the last-level cache faster than one.
  int64_t work = 0;
  for (const WorkItem& w : items) work += (w.t1 - w.t0) * w.rows;
  const int64_t n_items = static_cast<int64_t>(items.size());
  // Run order: a context split's kv heads one after another on one thread. A token's K (and
  // V) rows of all heads are adjacent in the store, so the first head's pass streams the
  // split's bytes in order and the others find them in the core's cache; in the items'
  // own order (head by head) each thread read every head's rows with gaps between them.
  std::vector<int64_t> order(static_cast<size_t>(n_items));
  for (int64_t i = 0; i < n_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const WorkItem& x = items[a];
    const WorkItem& y = items[b];
    return x.seq != y.seq ? x.seq < y.seq : x.t0 < y.t0;
  });
  const int64_t grain = work < kParallelWork ? std::max<int64_t>(n_items, 1) : 1;
  at::parallel_for(0, n_items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) kern.run(items[order[i]], scratch_ptr);
  });

  // Merge each row block's splits in split order and write the output rows (on this
  // thread: a few vector operations per split, cheaper than another parallel region).
  QT* o = out.data_ptr<QT>();
  const int64_t blocks = static_cast<int64_t>(block_first_item.size()) - 1;
  for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t first = block_first_item[blk];
      const int64_t last = block_first_item[blk + 1];
      const WorkItem& w0 = items[first];
      const int64_t R = w0.rows;
      for (int64_t r = 0; r < R; ++r) {
        float m = kNoScore;
        for (int64_t i = first; i < last; ++i) {
          const float* part = scratch_ptr + items[i].scratch;
          m = std::max(m, part[R * D + r]);
        }
        alignas(64) float total[D];
        for (int d = 0; d < D; ++d) total[d] = 0.f;
        float denom = 0.f;
        for (int64_t i = first; i < last; ++i) {
          const float* part = scratch_ptr + items[i].scratch;
          const float part_sum = part[R * D + R + r];
          if (part_sum == 0.f) continue;  // every token of this split was masked for the row
          const float w = std::exp(part[R * D + r] - m);
          denom += part_sum * w;
          const float* a = part + r * D;
          for (int d = 0; d < D; ++d) total[d] += a[d] * w;
        }
        const float inv = 1.f / denom;
        const int64_t row = w0.row0 + r;
        const int64_t tok = row / group;
        const int64_t head_q = w0.head * group + row % group;
        QT* dst = o + ((kern.q_starts[w0.seq] + tok) * hq + head_q) * D;
        for (int d = 0; d < D; ++d) dst[d] = narrow<QT>(total[d] * inv);
      }
  }
}

template <typename QT, typename KT>
void dispatch_dim(int64_t D, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& pages,
                  const at::Tensor& page_starts, const at::Tensor& q_starts,
                  const at::Tensor& ctx_lens, int64_t page_size, double scale, int64_t window,
                  at::Tensor& out) {
  switch (D) {
    case 16:  // the tests' tiny models
      return attend_typed<QT, KT, 16>(q, k, v, ks, vs, pages, page_starts, q_starts, ctx_lens,
                                      page_size, scale, window, out);
    case 64:
      return attend_typed<QT, KT, 64>(q, k, v, ks, vs, pages, page_starts, q_starts, ctx_lens,
                                      page_size, scale, window, out);
    case 128:
      return attend_typed<QT, KT, 128>(q, k, v, ks, vs, pages, page_starts, q_starts, ctx_lens,
                                       page_size, scale, window, out);
    case 256:  // Gemma 3
      return attend_typed<QT, KT, 256>(q, k, v, ks, vs, pages, page_starts, q_starts, ctx_lens,
                                       page_size, scale, window, out);
    default:
      TORCH_CHECK(false, "kvchat attention: head_dim ", D, " is not compiled (16, 64, 128, 256)");
  }
}

// New tokens' K/V rows [T, Hkv, D] (each token's Hkv * D values contiguous, tokens
// strided: views of the fused qkv projection) copied to their slots of the store.
void write_new_kv(const at::Tensor& store, const at::Tensor& rows, const at::Tensor& slots) {
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == store.size(1) && rows.size(2) == store.size(2) &&
                  rows.stride(2) == 1 && rows.stride(1) == rows.size(2),
              "new K/V: [T, Hkv, D], each token's values contiguous");
  TORCH_CHECK(rows.scalar_type() == store.scalar_type(), "new K/V in the store's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.size(0) == rows.size(0),
              "slots: int64 [T]");
  const int64_t width = store.size(1) * store.size(2);
  const int64_t bytes = width * store.element_size();
  const int64_t slot_count = store.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  char* dst = static_cast<char*>(store.data_ptr());
  const char* src = static_cast<const char*>(rows.data_ptr());
  const int64_t src_stride = rows.stride(0) * rows.element_size();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < slot_count, "slot out of range");
    std::memcpy(dst + slot[i] * bytes, src + i * src_stride, static_cast<size_t>(bytes));
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& k_scale,
                  const std::optional<at::Tensor>& v_scale, const at::Tensor& pages,
                  const at::Tensor& page_starts, const at::Tensor& q_starts,
                  const at::Tensor& ctx_lens, int64_t page_size, double scale,
                  const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                  const std::optional<at::Tensor>& new_slots, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [T,Hq,D], k/v [slots,Hkv,D]");
  TORCH_CHECK(q.stride(2) == 1 && k.is_contiguous() && v.is_contiguous(),
              "q's head dimension and the K/V store contiguous");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(pages.scalar_type() == at::kLong && page_starts.scalar_type() == at::kLong &&
                  q_starts.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong,
              "index tensors must be int64");
  if (k_new.has_value() || v_new.has_value()) {  // the new tokens' K/V first: they attend to it
    TORCH_CHECK(k_new.has_value() && v_new.has_value() && new_slots.has_value(),
                "new K and V come together, with their slots");
    TORCH_CHECK(k.scalar_type() != at::kChar, "int8 K/V are quantized by the caller");
    write_new_kv(k, *k_new, *new_slots);
    write_new_kv(v, *v_new, *new_slots);
  }
  const int64_t D = q.size(2);
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous whatever q's strides
  const bool int8_kv = k.scalar_type() == at::kChar;
  at::Tensor ks, vs;
  if (int8_kv) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "int8 K/V need their scales");
    ks = *k_scale;
    vs = *v_scale;
    TORCH_CHECK(ks.scalar_type() == q.scalar_type() && vs.scalar_type() == q.scalar_type() &&
                    ks.is_contiguous() && vs.is_contiguous(),
                "int8 scales: contiguous, in the query dtype");
  } else {
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "K/V in the query dtype");
  }
  if (q.scalar_type() == at::kBFloat16) {
    if (int8_kv)
      dispatch_dim<c10::BFloat16, int8_t>(D, q, k, v, ks, vs, pages, page_starts, q_starts,
                                          ctx_lens, page_size, scale, window, out);
    else
      dispatch_dim<c10::BFloat16, c10::BFloat16>(D, q, k, v, ks, vs, pages, page_starts,
                                                 q_starts, ctx_lens, page_size, scale, window, out);
  } else if (q.scalar_type() == at::kFloat) {
    if (int8_kv)
      dispatch_dim<float, int8_t>(D, q, k, v, ks, vs, pages, page_starts, q_starts, ctx_lens,
                                  page_size, scale, window, out);
    else
      dispatch_dim<float, float>(D, q, k, v, ks, vs, pages, page_starts, q_starts, ctx_lens,
                                 page_size, scale, window, out);
  } else {
    TORCH_CHECK(false, "kvchat attention: dtype ", q.scalar_type(), " is not compiled");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvchat, m) {
  m.def(
      "paged_attention(Tensor q, Tensor(a!) k, Tensor(b!) v, Tensor? k_scale, Tensor? v_scale, "
      "Tensor pages, Tensor page_starts, Tensor q_starts, Tensor ctx_lens, int page_size, "
      "float scale, Tensor? k_new=None, Tensor? v_new=None, Tensor? new_slots=None, "
      "int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) { m.impl("paged_attention", attend); }
