// 4-bit and 8-bit weight matrices times float activations, dequantized in registers.
//
// Why: torch's int4 CPU kernel is fast only with bf16 activations; with float32 ones
// (every CPU without native bf16: most laptops) it runs a reference loop, 50x slower
// than bf16 for one row, and a decode step crawls. Here a weight's codes are unpacked
// and scaled in registers, group by group, and multiplied into float32 accumulators,
// so a float32 result equals a float32 product with the dequantized weight
// (w = code * scale + offset, one fused multiply-add) up to summation order.
//
// Layout (`kvchat/model/quantized_linear.py` makes it): a row of the weight is K / 32
// groups; a 4-bit group is 16 bytes, byte j holding element j in its low nibble and
// element j + 16 in its high one (GGUF's Q4_0/Q4_1 order); an 8-bit group is 32 signed
// bytes. Each group has a scale (and a 4-bit one an offset) in float32 or float16; the
// half ones are converted a row at a time. An 8-bit group may instead have a scale per
// half (16 weights): Q6_K's sub-blocks, whose scales no one scale per 32 can hold. Scales
// and offsets may also come as a K-quant stores them, 8-bit integers each times a float16
// per 256 columns (`Scales`), expanded a row at a time like the half ones. Decode (one or two rows) streams each weight
// row once through the fused loop; a few more rows dequantize a weight row once into a
// buffer that stays in L1 and take the activation rows four at a time; prefill batches
// dequantize a tile of weight rows and hand it to torch's matrix product.
//
// Vectorized with AVX-512 or AVX2 + FMA intrinsics where the compiler targets them; a
// plain C++ path (loops the compiler vectorizes for whatever it targets) elsewhere.
// Weight rows are split over torch's thread pool. Compiled with the other kernels by
// kvchat/native/build.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "element_types.h"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;            // weights sharing one scale (and offset)
constexpr int64_t kSerialMacs = 1 << 17;  // multiply-adds below which one thread does a call
// Up to this many rows (a decode batch) go through the fused loop, two at a time: a
// second pair reads the weight rows the first just brought into cache.
constexpr int64_t kFusedRows = 4;
constexpr int64_t kRowTile = 4;           // activation rows a buffered pass serves at once
// From this many rows a call dequantizes tiles of about kTileBytes and multiplies them by
// torch's matrix product (measured crossover: docs/kernels.md).
constexpr int64_t kTileBytes = 1 << 21;
constexpr int64_t kTileColumns = 2048;
// The row count from which the tiles are faster: sooner for long rows, whose buffered
// weight row and activation rows no longer stay in L1 (measured: docs/kernels.md).
inline int64_t tile_from_rows(int64_t k) { return k >= 4096 ? 16 : 24; }
// How far ahead of the group being unpacked the code stream is prefetched: the
// hardware prefetcher alone leaves decode at half the memory bandwidth, since a weight
// row is only a few hundred bytes (measured: docs/kernels.md).
constexpr int64_t kPrefetchBytes = 2048;
#if defined(__SSE__)
#define PREFETCH(p) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0)
#else
#define PREFETCH(p) __builtin_prefetch(p)
#endif

// ---- float vectors: the compiler's target decides the width.
#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec x) { return _mm512_reduce_add_ps(x); }

inline void unpack_q4(const uint8_t* p, Vec* q) {
  // Widened to 32-bit lanes first, then split: a lane's low nibble by a mask and its high
  // one by a shift, so one byte shuffle serves both vectors.
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
  q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}
inline void unpack_q8(const uint8_t* p, Vec* q) {
  for (int i = 0; i < 2; ++i) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i));
    q[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIsa = "avx2";
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec x) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

inline Vec widen8(__m128i bytes, bool is_signed) {
  const __m256i ints = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  return _mm256_cvtepi32_ps(ints);
}
inline void unpack_q4(const uint8_t* p, Vec* q) {
  // Widened to 32-bit lanes first, then split: a lane's low nibble by a mask and its high
  // one by a shift, so one byte shuffle serves two vectors (two shuffles a group, not six).
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  for (int half = 0; half < 2; ++half) {
    const __m256i bytes =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half)));
    q[half] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, nibble));
    q[half + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  }
}
inline void unpack_q8(const uint8_t* p, Vec* q) {
  for (int i = 0; i < 4; ++i) {
    q[i] = widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)), true);
  }
}
#else
constexpr const char* kIsa = "portable";
constexpr int kLanes = 8;
struct Vec {
  float v[kLanes];
};
inline Vec vzero() { return Vec{}; }
inline Vec vset1(float x) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = x;
  return r;
}
inline Vec vload(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline void vstore(float* p, Vec x) { std::memcpy(p, x.v, sizeof x.v); }
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline Vec vmul(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
  return a;
}
inline Vec vadd(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline float vsum(Vec x) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += x.v[i];
  return s;
}
inline void unpack_q4(const uint8_t* p, Vec* q) {
  for (int j = 0; j < 16; ++j) {
    q[j / kLanes].v[j % kLanes] = static_cast<float>(p[j] & 0x0F);
    q[(j + 16) / kLanes].v[j % kLanes] = static_cast<float>(p[j] >> 4);
  }
}
inline void unpack_q8(const uint8_t* p, Vec* q) {
  for (int j = 0; j < 32; ++j) {
    q[j / kLanes].v[j % kLanes] = static_cast<float>(static_cast<int8_t>(p[j]));
  }
}
#endif

constexpr int kPerGroup = kGroup / kLanes;  // vectors a group fills
// Weight rows a decode pass streams at once (the float and the bf16 paths), set per kind
// of CPU by kvchat/native/build.py: on Intel's, four rows with AVX-512 and two with AVX2
// (streams in flight, and as many independent multiply-add chains) were fastest; on
// AMD's Zen 4 one row, one sequential stream, reads a large matrix from memory 1.5x
// faster, with either instruction set (measured: docs/kernels.md).
#ifndef KVCHAT_STREAM_ROWS
#define KVCHAT_STREAM_ROWS 4
#endif
constexpr int kStreamRows = KVCHAT_STREAM_ROWS;
static_assert(kStreamRows == 1 || kStreamRows == 2 || kStreamRows == 4, "1, 2 or 4 rows a pass");
// Weight rows a fused pass takes at once for one activation row: no more than leave the
// accumulators, the activations and a dequantized group in registers (32 with
// AVX-512, 16 with AVX2: two rows at most).
constexpr int kFusedWeightRows = kLanes == 16 ? kStreamRows : std::min(kStreamRows, 2);

// What differs between the formats: a group's bytes, how they unpack, whether an
// offset is added, how many scales a group has (each covering kGroup / kScales weights).
struct Q4 {
  static constexpr int64_t kBytes = kGroup / 2;
  static constexpr bool kOffset = true;
  static constexpr int kScales = 1;
  static void unpack(const uint8_t* p, Vec* q) { unpack_q4(p, q); }
};
struct Q8 {
  static constexpr int64_t kBytes = kGroup;
  static constexpr bool kOffset = false;
  static constexpr int kScales = 1;
  static void unpack(const uint8_t* p, Vec* q) { unpack_q8(p, q); }
};
struct Q8Halves : Q8 {
  static constexpr int kScales = 2;
};
static_assert(kPerGroup % Q8Halves::kScales == 0, "a scale covers whole vectors");

// One group's 32 weights as floats: code * scale (+ offset); `scale` holds F::kScales.
template <typename F>
inline void dequantize_group(const uint8_t* codes, const float* scale, float offset, Vec* w) {
  F::unpack(codes, w);
  constexpr int per_scale = kPerGroup / F::kScales;
  if constexpr (F::kOffset) {
    const Vec s = vset1(scale[0]);
    const Vec o = vset1(offset);
    for (int i = 0; i < kPerGroup; ++i) w[i] = vfma(w[i], s, o);
  } else {
    for (int i = 0; i < kPerGroup; ++i) w[i] = vmul(w[i], vset1(scale[i / per_scale]));
  }
}

// Dot products of W weight rows with R activation rows: the decode path, which streams
// each weight byte from memory once. A group's scale and offset are factored out,
// sum_j (q_j s + o) x_j = s sum_j q_j x_j + o sum_j x_j, with the activations' group sums
// (`xsum`, [R, groups]) computed once a call: per group and row the codes meet the
// activations in kPerGroup multiply-adds and the scale in one more, where dequantizing
// first took twice that (decode is bound by these instructions on AVX2, not by memory).
// W rows at once give the multiply-adds W * R independent chains and the memory system
// W streams in flight.
template <typename F, int R, int W>
void fused_rows(const uint8_t* codes, const float* scales, const float* offsets,
                int64_t groups, const float* x, const float* xsum, int64_t k, float* dots) {
  Vec acc[W][R];
  float offset_acc[W][R];
  for (int w = 0; w < W; ++w) {
    for (int r = 0; r < R; ++r) {
      acc[w][r] = vzero();
      offset_acc[w][r] = 0.f;
    }
  }
  const int64_t row_bytes = groups * F::kBytes;
  constexpr int per_scale = kPerGroup / F::kScales;
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * kGroup;
    for (int w = 0; w < W; ++w) {
      Vec q[kPerGroup];
      const int64_t at = w * groups + g;
      PREFETCH(codes + w * row_bytes + g * F::kBytes + kPrefetchBytes);
      F::unpack(codes + w * row_bytes + g * F::kBytes, q);
      // the activations are read from L1 by each multiply-add: kept in registers
      // across the W rows they would spill the accumulators with AVX2's 16
      for (int r = 0; r < R; ++r) {
        for (int part_at = 0; part_at < F::kScales; ++part_at) {
          const int first = part_at * per_scale;
          Vec part = vmul(vload(xg + r * k + first * kLanes), q[first]);
          for (int i = first + 1; i < first + per_scale; ++i) {
            part = vfma(vload(xg + r * k + i * kLanes), q[i], part);
          }
          acc[w][r] = vfma(part, vset1(scales[at * F::kScales + part_at]), acc[w][r]);
        }
        if constexpr (F::kOffset) offset_acc[w][r] += offsets[at] * xsum[r * groups + g];
      }
    }
  }
  for (int w = 0; w < W; ++w) {
    for (int r = 0; r < R; ++r) dots[w * R + r] = vsum(acc[w][r]) + offset_acc[w][r];
  }
}

// Each activation row's sums over its groups of 32, for the factored offsets above.
void group_sums(const float* x, int64_t m, int64_t k, float* out) {
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * k + g * kGroup;
      Vec total = vload(xg);
      for (int i = 1; i < kPerGroup; ++i) total = vadd(total, vload(xg + i * kLanes));
      out[r * groups + g] = vsum(total);
    }
  }
}

// Dot products of one dequantized weight row (in L1) with R activation rows.
template <int R>
void buffered_row(const float* w, const float* x, int64_t k, float* dots) {
  Vec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t j = 0; j < k; j += 2 * kLanes) {
    const Vec w0 = vload(w + j);
    const Vec w1 = vload(w + j + kLanes);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = vfma(vload(x + r * k + j), w0, acc[r][0]);
      acc[r][1] = vfma(vload(x + r * k + j + kLanes), w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) dots[r] = vsum(vadd(acc[r][0], acc[r][1]));
}

template <int R>
void buffered_tile(const float* w, const float* x, int64_t k, int64_t rows, float* dots) {
  if constexpr (R > 1) {
    if (rows < R) return buffered_tile<R - 1>(w, x, k, rows, dots);
  }
  buffered_row<R>(w, x, k, dots);
}

// A matrix's scales (or offsets) as stored: float32 or float16 values, or a K-quant's
// integer sub-scales, each times its 256 columns' float16 super-scale (`supers`, [N,
// K / 256]): Q4_K's and Q6_K's own bytes, a quarter or half of float16 scales' (a
// decode step streams them with the codes). `values` is null where there are none.
template <typename S>
struct Scales {
  using Value = S;
  const S* values = nullptr;
  const c10::Half* supers = nullptr;
  int64_t per_super = 1;  // values a super-scale covers: K / 256 divides a row's count

  // Values [at, at + n) of the flattened [N, per_row] array as float32 (`scratch` holds n).
  const float* floats(int64_t at, int64_t n, float* scratch) const {
    const S* p = values + at;
    if constexpr (std::is_same_v<S, float>) {
      return p;
    } else if constexpr (std::is_same_v<S, c10::Half>) {
      int64_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
        _mm256_storeu_ps(scratch + i, _mm256_cvtph_ps(h));
      }
#endif
      for (; i < n; ++i) scratch[i] = static_cast<float>(p[i]);
      return scratch;
    } else {
      // exact: an 8-bit integer times a float16 fits float32's 24-bit significand
      for (int64_t i = 0; i < n;) {  // a super-scale at a time, so the inner loop vectorizes
        const int64_t super = (at + i) / per_super;
        const int64_t stop = std::min<int64_t>(n, (super + 1) * per_super - at);
        const float factor = static_cast<float>(supers[super]);
        for (; i < stop; ++i) scratch[i] = static_cast<float>(p[i]) * factor;
      }
      return scratch;
    }
  }
};

// A pass of fused_rows over weight rows [row, row + W) for the m (<= 2) activation rows.
template <typename F, int W>
void fused_pass(const uint8_t* codes, const float* s, const float* o, int64_t groups,
                const float* x, const float* xsum, int64_t m, int64_t k, int64_t row, int64_t n,
                float* out) {
  float dots[W * 2];
  if (m == 1) {
    fused_rows<F, 1, W>(codes, s, o, groups, x, xsum, k, dots);
  } else {
    fused_rows<F, 2, (W > 1 ? W / 2 : 1)>(codes, s, o, groups, x, xsum, k, dots);
    if constexpr (W > 1) {  // the second half of the W rows
      fused_rows<F, 2, W / 2>(codes + W / 2 * groups * F::kBytes, s + W / 2 * groups * F::kScales,
                              F::kOffset ? o + W / 2 * groups : nullptr, groups, x, xsum, k,
                              dots + W);
    }
  }
  for (int w = 0; w < W; ++w) {
    for (int64_t r = 0; r < m; ++r) out[r * n + row + w] = dots[w * m + r];
  }
}

// Columns [g0 * 32, g1 * 32) of weight rows [begin, end) as float32, written row after
// row to `dst` (g1 - g0 groups a row); `scratch` holds scratch_floats<F>(g1 - g0) floats
// (the rows' scales and offsets converted from half).
template <typename F>
constexpr int64_t scratch_floats(int64_t groups) { return (F::kScales + 1) * groups; }

template <typename F, typename S>
void dequantize_rows(const uint8_t* codes, const Scales<S>& scales, const Scales<S>& offsets,
                     int64_t k,
                     int64_t begin, int64_t end, int64_t g0, int64_t g1, float* dst,
                     float* scratch) {
  const int64_t groups = k / kGroup, width = (g1 - g0) * kGroup;
  float* scale_row = scratch;
  float* offset_row = scratch + (g1 - g0) * F::kScales;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t first = row * groups + g0;
    const uint8_t* c = codes + first * F::kBytes;
    const float* s = scales.floats(first * F::kScales, (g1 - g0) * F::kScales, scale_row);
    const float* o = F::kOffset ? offsets.floats(first, g1 - g0, offset_row) : nullptr;
    float* w = dst + (row - begin) * width;
    for (int64_t g = 0; g < g1 - g0; ++g) {
      Vec v[kPerGroup];
      PREFETCH(c + g * F::kBytes + kPrefetchBytes);
      dequantize_group<F>(c + g * F::kBytes, s + g * F::kScales, F::kOffset ? o[g] : 0.f, v);
      for (int i = 0; i < kPerGroup; ++i) vstore(w + g * kGroup + i * kLanes, v[i]);
    }
  }
}

// out[m, n] = sum_k x[m, k] * w[n, k] for weight rows [begin, end).
template <typename F, typename S>
void matmul_rows(const float* x, const float* xsum, int64_t m, int64_t k, const uint8_t* codes,
                 const Scales<S>& scales, const Scales<S>& offsets, int64_t begin, int64_t end,
                 int64_t n, float* out) {
  const int64_t groups = k / kGroup;
  constexpr int W = kFusedWeightRows;
  if (m <= kFusedRows) {
    std::vector<float> scale_rows(W * groups * F::kScales), offset_rows(W * groups);
    for (int64_t row = begin; row < end;) {
      const int64_t take = end - row >= W ? W : 1;
      const uint8_t* c = codes + row * groups * F::kBytes;
      const float* s =
          scales.floats(row * groups * F::kScales, take * groups * F::kScales, scale_rows.data());
      const float* o =
          F::kOffset ? offsets.floats(row * groups, take * groups, offset_rows.data()) : nullptr;
      for (int64_t r0 = 0; r0 < m; r0 += 2) {
        const int64_t pair = std::min<int64_t>(2, m - r0);
        if (take == W) {
          fused_pass<F, W>(c, s, o, groups, x + r0 * k, xsum + r0 * groups, pair, k, row, n,
                           out + r0 * n);
        } else {
          fused_pass<F, 1>(c, s, o, groups, x + r0 * k, xsum + r0 * groups, pair, k, row, n,
                           out + r0 * n);
        }
      }
      row += take;
    }
    return;
  }
  std::vector<float> weight_row(k), scratch(scratch_floats<F>(groups));
  float dots[kRowTile];
  for (int64_t row = begin; row < end; ++row) {
    float* w = weight_row.data();
    dequantize_rows<F, S>(codes, scales, offsets, k, row, row + 1, 0, groups, w,
                          scratch.data());
    for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
      const int64_t rows = std::min<int64_t>(kRowTile, m - r0);
      buffered_tile<kRowTile>(w, x + r0 * k, k, rows, dots);
      for (int64_t r = 0; r < rows; ++r) out[(r0 + r) * n + row] = dots[r];
    }
  }
}

// Prefill-sized batches are compute-bound: a tile of the weight (up to kTileColumns
// columns of as many rows as fill kTileBytes) is dequantized into a float32 buffer, in
// parallel, and multiplied by torch's matrix product, whose blocking the row-at-a-time
// loop above cannot match; tiles along K accumulate into the same output columns. Only
// one tile is ever dequantized, so the weights stay 4-bit in memory.
template <typename F, typename S>
void tiled_matmul(const at::Tensor& x, const uint8_t* codes, const Scales<S>& scales,
                  const Scales<S>& offsets, at::Tensor& out) {
  const int64_t k = x.size(1), n = out.size(1);
  const int64_t width = std::min<int64_t>(k, kTileColumns);
  const int64_t fit = kTileBytes / (width * static_cast<int64_t>(sizeof(float)));
  const int64_t tile = std::min<int64_t>(n, std::max<int64_t>(16, fit / 16 * 16));
  at::Tensor buffer = at::empty({tile, width}, x.options());
  float* w = buffer.data_ptr<float>();
  for (int64_t n0 = 0; n0 < n; n0 += tile) {
    const int64_t rows = std::min<int64_t>(tile, n - n0);
    at::Tensor part = out.narrow(1, n0, rows);
    for (int64_t k0 = 0; k0 < k; k0 += width) {
      const int64_t cols = std::min<int64_t>(width, k - k0);
      const int64_t g0 = k0 / kGroup, g1 = g0 + cols / kGroup;
      at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(scratch_floats<F>(g1 - g0));
        dequantize_rows<F, S>(codes, scales, offsets, k, n0 + begin, n0 + end, g0, g1,
                              w + begin * cols, scratch.data());
      });
      const at::Tensor weights = buffer.view(-1).narrow(0, 0, rows * cols).view({rows, cols});
      const at::Tensor inputs = x.narrow(1, k0, cols);
      if (k0 == 0) {
        at::mm_out(part, inputs, weights.t());
      } else {
        part.addmm_(inputs, weights.t());
      }
    }
  }
}

// Checks `scales` (or offsets) against the weight and returns what `Scales` reads: float32
// or float16 values, or 8-bit integer sub-scales with their float16 `supers` [N, K / 256].
template <typename S>
Scales<S> scales_of(const at::Tensor& t, const std::optional<at::Tensor>& supers, int64_t n,
                    int64_t k, int64_t per_row, const char* op, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.size(0) == n && t.size(1) == per_row, op,
              ": ", what, " [N, ", per_row, "], contiguous");
  Scales<S> out;
  out.values = t.data_ptr<S>();
  if constexpr (std::is_integral_v<S>) {
    TORCH_CHECK(supers.has_value() && k % 256 == 0, op, ": integer ", what,
                " need their float16 super-scales (K a multiple of 256)");
    TORCH_CHECK(supers->dim() == 2 && supers->is_contiguous() && supers->size(0) == n &&
                    supers->size(1) == k / 256 && supers->scalar_type() == at::kHalf,
                op, ": ", what, "' super-scales [N, K / 256] float16, contiguous");
    out.supers = supers->data_ptr<c10::Half>();
    out.per_super = per_row / (k / 256);
  } else {
    TORCH_CHECK(!supers.has_value(), op, ": super-scales go with integer ", what);
  }
  return out;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// ---- bf16 activations on CPUs with AVX512-BF16: the decode rows of a bf16 model.
// Why: the float path above spends about ten instructions per group and row widening
// codes to float32, so a core decodes at about 11 GB/s where it can read 17 (measured:
// docs/kernels.md). A bf16 activation times a small integer is exact in float32, so here
// a code becomes a bf16 number in one or two integer instructions and meets the
// activations in `vdpbf16ps`, 32 products an instruction, summed in float32. No
// conversion: with the exponent of 128, a bf16's 7 mantissa bits count in ones, so the
// bits 0x4300 + k are the number 128 + k; that bias times each scale's activation sum
// is subtracted at the end (with the offsets, in one multiply-add per 16 scales).
//
// A unit is 32 code bytes whose dot products land in 16 float lanes, lanes 0-7 under
// one scale and 8-15 under the next (or the same); a block is 16 scales.
constexpr bool kBf16Dots = true;

// Two 4-bit groups a unit; their x, reordered, matches the nibbles (`bf16_activations`).
struct Bf16Q4 {
  static constexpr int kVectors = 2;        // 32-lane bf16 vectors a unit unpacks to
  static constexpr int64_t kGroupBytes = 16;
  static constexpr int kScalesPerGroup = 1;
  static constexpr int kSlotWidth = 32;     // weights under one scale
  static constexpr int kUnitsPerBlock = 8;
  static constexpr bool kOffset = true;
  static constexpr float kBias = 128.f;
  static int64_t units(int64_t groups) { return (groups + 1) / 2; }
  static int units_in(int64_t scales) { return static_cast<int>((scales + 1) / 2); }
  static inline void unpack(const uint8_t* p, bool half, __m512i* t) {
    // an odd row's last unit holds one group: its second half must not be read
    const __m256i bytes = half ? _mm256_maskz_loadu_epi8(0xFFFF, p)
                               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i w = _mm512_cvtepu8_epi16(bytes);
    const __m512i bias = _mm512_set1_epi16(0x4300);
    t[0] = _mm512_ternarylogic_epi32(w, _mm512_set1_epi16(0x000F), bias, 0xEA);  // (w & 15) | bias
    t[1] = _mm512_or_si512(_mm512_srli_epi16(w, 4), bias);
  }
};

// 8-bit codes within [-32, 31] (Q6_K, Q5_0): k + 0x4320 is the bf16 160 + k.
template <int ScalesPerGroup>
struct Bf16Q8 {
  static constexpr int kVectors = 1;
  static constexpr int64_t kGroupBytes = 32;
  static constexpr int kScalesPerGroup = ScalesPerGroup;
  static constexpr int kSlotWidth = 32 / ScalesPerGroup;
  static constexpr int kUnitsPerBlock = 16 / ScalesPerGroup;
  static constexpr bool kOffset = false;
  static constexpr float kBias = 160.f;
  static int64_t units(int64_t groups) { return groups; }
  static int units_in(int64_t scales) { return static_cast<int>(scales / ScalesPerGroup); }
  static inline void unpack(const uint8_t* p, bool, __m512i* t) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    t[0] = _mm512_add_epi16(_mm512_cvtepi8_epi16(bytes), _mm512_set1_epi16(0x4320));
  }
};

// Which scale of the block each lane of unit u's products is under.
template <typename B>
inline __m512i scale_lanes(int u) {
  if constexpr (B::kSlotWidth == 32 && B::kVectors == 1) {  // one scale for the whole unit
    return _mm512_set1_epi32(u);
  } else {
    return _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(2 * u), _mm512_set1_epi32(2 * u + 1));
  }
}

// Scales [at, at + n) (n <= 16) of a matrix as 16 float lanes, zero past n; a K-quant's
// integer sub-scales times their super-scales (one per 8 or 16 of them in a block).
template <typename S>
inline __m512 load_scales(const Scales<S>& sc, int64_t at, int64_t n) {
  const __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const S* p = sc.values + at;
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (std::is_same_v<S, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  } else {
    const __m128i bytes = _mm_maskz_loadu_epi8(mask, p);
    const __m512 values = _mm512_cvtepi32_ps(std::is_signed_v<S> ? _mm512_cvtepi8_epi32(bytes)
                                                                 : _mm512_cvtepu8_epi32(bytes));
    const auto super = [&](int64_t i) { return static_cast<float>(sc.supers[i]); };
    __m512 supers;
    if (sc.per_super % 16 == 0 && at % 16 == 0) {
      supers = _mm512_set1_ps(super(at / sc.per_super));
    } else if (sc.per_super == 8 && at % 8 == 0) {
      supers = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(super(at / 8)),
                                    _mm512_set1_ps(n > 8 ? super(at / 8 + 1) : 0.f));
    } else {
      alignas(64) float lanes[16];
      for (int64_t i = 0; i < 16; ++i) lanes[i] = i < n ? super((at + i) / sc.per_super) : 0.f;
      supers = _mm512_load_ps(lanes);
    }
    return _mm512_mul_ps(values, supers);  // exact: an 8-bit integer times a float16
  }
}

inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// Each activation row in the unit order the codes unpack to (zeros where an odd row's
// last unit has no second group), and its sums per scale, padded to whole blocks.
template <typename B>
void bf16_activations(const uint16_t* x, int64_t m, int64_t k, uint16_t* xs, float* sums) {
  const int64_t groups = k / kGroup, units = B::units(groups);
  const int64_t scales = groups * B::kScalesPerGroup, padded = (scales + 15) / 16 * 16;
  const int64_t unit_x = B::kVectors * 32;
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* xr = x + r * k;
    uint16_t* out = xs + r * units * unit_x;
    if constexpr (B::kVectors == 2) {
      for (int64_t u = 0; u < units; ++u) {
        for (int half = 0; half < 2; ++half) {  // the low nibbles' vector, then the high ones'
          for (int g = 0; g < 2; ++g) {
            uint16_t* dst = out + u * 64 + half * 32 + g * 16;
            if (2 * u + g < groups) {
              std::memcpy(dst, xr + (2 * u + g) * kGroup + half * 16, 16 * sizeof(uint16_t));
            } else {
              std::memset(dst, 0, 16 * sizeof(uint16_t));
            }
          }
        }
      }
    } else {
      std::memcpy(out, xr, k * sizeof(uint16_t));
    }
    float* s = sums + r * padded;
    for (int64_t i = 0; i < padded; ++i) {
      float total = 0.f;
      for (int64_t j = 0; i < scales && j < B::kSlotWidth; ++j) {
        total += bf16_value(xr[i * B::kSlotWidth + j]);
      }
      s[i] = total;
    }
  }
}

// Dot products of W weight rows with R activation rows (see above for the unit layout).
template <typename B, typename S, int R, int W>
void bf16_rows(const uint8_t* codes, const Scales<S>& scales, const Scales<S>& offsets,
               int64_t first_row, int64_t groups, const uint16_t* xs, const float* sums,
               float* dots) {
  const int64_t scales_n = groups * B::kScalesPerGroup, padded = (scales_n + 15) / 16 * 16;
  const int64_t row_bytes = groups * B::kGroupBytes;
  const int64_t x_row = B::units(groups) * B::kVectors * 32;
  const bool odd = B::kVectors == 2 && groups % 2 == 1;
  const __m512 bias = _mm512_set1_ps(B::kBias);
  __m512 acc[W][R];
  for (int w = 0; w < W; ++w) {
    for (int r = 0; r < R; ++r) acc[w][r] = _mm512_setzero_ps();
  }
  for (int64_t s0 = 0, u0 = 0; s0 < scales_n; s0 += 16, u0 += B::kUnitsPerBlock) {
    const int64_t in_block = std::min<int64_t>(16, scales_n - s0);
    const int units = B::units_in(in_block);
    __m512 s[W];
    for (int w = 0; w < W; ++w) {
      const int64_t at = (first_row + w) * scales_n + s0;
      s[w] = load_scales(scales, at, in_block);
      // the offsets, less the bias the codes carry, times each scale's activation sum
      __m512 fix = _mm512_mul_ps(s[w], bias);
      if constexpr (B::kOffset) {
        fix = _mm512_sub_ps(load_scales(offsets, at, in_block), fix);
      } else {
        fix = _mm512_sub_ps(_mm512_setzero_ps(), fix);
      }
      for (int r = 0; r < R; ++r) {
        acc[w][r] = _mm512_fmadd_ps(fix, _mm512_loadu_ps(sums + r * padded + s0), acc[w][r]);
      }
    }
    for (int u = 0; u < units; ++u) {
      const int64_t at = u0 + u;
      const __m512i lanes = scale_lanes<B>(u);
      for (int w = 0; w < W; ++w) {
        const uint8_t* p = codes + w * row_bytes + at * 32;
        PREFETCH(p + W * row_bytes);  // the same place in the next pass's rows
        __m512i t[B::kVectors];
        B::unpack(p, odd && at == B::units(groups) - 1, t);
        const __m512 su = _mm512_permutexvar_ps(lanes, s[w]);
        for (int r = 0; r < R; ++r) {
          const uint16_t* xu = xs + r * x_row + at * B::kVectors * 32;
          __m512 dot = _mm512_setzero_ps();
          for (int v = 0; v < B::kVectors; ++v) {
            dot = _mm512_dpbf16_ps(dot, (__m512bh)t[v],
                                   (__m512bh)_mm512_loadu_si512(xu + v * 32));
          }
          acc[w][r] = _mm512_fmadd_ps(dot, su, acc[w][r]);
        }
      }
    }
  }
  for (int w = 0; w < W; ++w) {
    for (int r = 0; r < R; ++r) dots[w * R + r] = _mm512_reduce_add_ps(acc[w][r]);
  }
}

// out[m, n] (m <= kFusedRows) for bf16 x: weight rows [begin, end), W at a time, the
// activation rows two at a time.
template <typename B, typename S>
void bf16_matmul_rows(const uint8_t* codes, const Scales<S>& scales, const Scales<S>& offsets,
                      int64_t groups, const uint16_t* xs, const float* sums, int64_t m,
                      int64_t begin, int64_t end, int64_t n, float* out) {
  constexpr int W = kStreamRows;
  const int64_t scales_n = groups * B::kScalesPerGroup, padded = (scales_n + 15) / 16 * 16;
  const int64_t x_row = B::units(groups) * B::kVectors * 32;
  for (int64_t row = begin; row < end;) {
    const int take = end - row >= W ? W : 1;
    const uint8_t* c = codes + row * groups * B::kGroupBytes;
    for (int64_t r0 = 0; r0 < m; r0 += 2) {
      float dots[W * 2];
      const int pair = m - r0 >= 2 ? 2 : 1;
      const uint16_t* x = xs + r0 * x_row;
      const float* sum = sums + r0 * padded;
      if (take == W && pair == 2) {
        bf16_rows<B, S, 2, W>(c, scales, offsets, row, groups, x, sum, dots);
      } else if (take == W) {
        bf16_rows<B, S, 1, W>(c, scales, offsets, row, groups, x, sum, dots);
      } else if (pair == 2) {
        bf16_rows<B, S, 2, 1>(c, scales, offsets, row, groups, x, sum, dots);
      } else {
        bf16_rows<B, S, 1, 1>(c, scales, offsets, row, groups, x, sum, dots);
      }
      for (int w = 0; w < take; ++w) {
        for (int r = 0; r < pair; ++r) out[(r0 + r) * n + row + w] = dots[w * pair + r];
      }
    }
    row += take;
  }
}

template <typename B, typename S>
at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& codes, const Scales<S>& scales,
                       const Scales<S>& offsets) {
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0), groups = k / kGroup;
  const int64_t scales_n = groups * B::kScalesPerGroup, padded = (scales_n + 15) / 16 * 16;
  std::vector<uint16_t> xs(m * B::units(groups) * B::kVectors * 32);
  std::vector<float> sums(m * padded);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  bf16_activations<B>(xp, m, k, xs.data(), sums.data());
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int64_t grain = std::max<int64_t>(4, kSerialMacs / std::max<int64_t>(1, m * k)) / 4 * 4;
  auto body = [&](int64_t begin, int64_t end) {
    bf16_matmul_rows<B, S>(cp, scales, offsets, groups, xs.data(), sums.data(), m, begin, end, n,
                           op);
  };
  if (n <= grain) {
    body(0, n);
  } else {
    at::parallel_for(0, n, grain, body);
  }
  return out.to(at::kBFloat16);
}
#else
constexpr bool kBf16Dots = false;
struct Bf16Q4 {};
template <int ScalesPerGroup>
struct Bf16Q8 {};
template <typename B, typename S>
at::Tensor bf16_matmul(const at::Tensor&, const at::Tensor&, const Scales<S>&,
                       const Scales<S>&) {
  TORCH_CHECK(false, "this build has no bf16 dot products");
}
#endif

// B: the bf16 dot-product path for this format (void: none).
template <typename F, typename B = void>
at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales, const at::Tensor* offsets,
                            const std::optional<at::Tensor>& scale_supers,
                            const std::optional<at::Tensor>& offset_supers, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x a contiguous [rows, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x float32 or bfloat16");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(k % kGroup == 0, op, ": K a multiple of ", kGroup);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                  codes.size(1) == k / kGroup * F::kBytes,
              op, ": codes [N, K / 32 * ", F::kBytes, "] uint8, contiguous");
  const auto scale_type = scales.scalar_type();
  TORCH_CHECK(scale_type == at::kFloat || scale_type == at::kHalf || scale_type == at::kChar ||
                  scale_type == at::kByte,
              op, ": scales float32, float16, int8 or uint8");
  if (offsets != nullptr) {
    TORCH_CHECK(offsets->scalar_type() == scale_type, op, ": offsets typed like the scales");
  }
  // fn(scales, offsets) with both read as the scales' dtype says (see `Scales`)
  auto with_scales = [&](auto fn) {
    auto read = [&](auto scale_tag) {
      using S = decltype(scale_tag);
      const int64_t groups = k / kGroup;
      const Scales<S> sc = scales_of<S>(scales, scale_supers, n, k, groups * F::kScales, op, "scales");
      const Scales<S> off = offsets != nullptr
                                ? scales_of<S>(*offsets, offset_supers, n, k, groups, op, "offsets")
                                : Scales<S>{};
      return fn(sc, off);
    };
    if (scale_type == at::kFloat) return read(float{});
    if (scale_type == at::kHalf) return read(c10::Half{});
    if (scale_type == at::kChar) return read(int8_t{});
    return read(uint8_t{});
  };
  const bool bf16_dots =
      kBf16Dots && !std::is_void_v<B> && x.scalar_type() == at::kBFloat16 && m <= kFusedRows;
  if (bf16_dots) {
    return with_scales([&](const auto& sc, const auto& off) {
      using S = typename std::decay_t<decltype(sc)>::Value;
      if constexpr (!std::is_void_v<B>) return bf16_matmul<B, S>(x, codes, sc, off);
      return at::Tensor();
    });
  }
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  at::Tensor out = at::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* op_out = out.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int64_t grain = std::max<int64_t>(1, kSerialMacs / std::max<int64_t>(1, m * k));
  std::vector<float> xsum;  // the fused loop's group sums (read only where there are offsets)
  if (m <= kFusedRows) {
    xsum.resize(m * (k / kGroup));
    if (F::kOffset) group_sums(xp, m, k, xsum.data());
  }
  with_scales([&](const auto& sc, const auto& off) {
    using S = typename std::decay_t<decltype(sc)>::Value;
    auto body = [&](int64_t begin, int64_t end) {
      matmul_rows<F, S>(xp, xsum.data(), m, k, cp, sc, off, begin, end, n, op_out);
    };
    if (m >= tile_from_rows(k)) {
      tiled_matmul<F, S>(xf, cp, sc, off, out);
    } else if (n <= grain) {
      body(0, n);
    } else {
      at::parallel_for(0, n, grain, body);
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// Scales (and offsets) [N, K / 32]; integer ones with their super-scales (Q4_K's bytes).
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& offsets, const std::optional<at::Tensor>& scale_supers,
                     const std::optional<at::Tensor>& offset_supers) {
  return quantized_matmul<Q4, Bf16Q4>(x, codes, scales, &offsets, scale_supers, offset_supers,
                                      "q4_matmul");
}

// Scales [N, K / 32] (Q8_0) or [N, K / 16] (a scale per half group: Q6_K's sub-blocks,
// float or int8 with their super-scales). `small_codes`: every code is within [-32, 31]
// (Q6_K, Q5_0), which bf16 rows may then take through the dot-product path.
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& scale_supers, bool small_codes) {
  const char* op = "q8_matmul";
  const auto none = std::nullopt;
  if (x.dim() == 2 && scales.dim() == 2 && scales.size(1) == x.size(1) / (kGroup / 2) &&
      x.size(1) % kGroup == 0) {
    return small_codes
               ? quantized_matmul<Q8Halves, Bf16Q8<2>>(x, codes, scales, nullptr, scale_supers, none, op)
               : quantized_matmul<Q8Halves>(x, codes, scales, nullptr, scale_supers, none, op);
  }
  return small_codes
             ? quantized_matmul<Q8, Bf16Q8<1>>(x, codes, scales, nullptr, scale_supers, none, op)
             : quantized_matmul<Q8>(x, codes, scales, nullptr, scale_supers, none, op);
}

// Which vector path this library was compiled with ("avx512", "avx2", "portable"),
// for the start-up line.
std::string quantized_matmul_isa() { return kIsa; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def(
      "q4_matmul(Tensor x, Tensor codes, Tensor scales, Tensor offsets, "
      "Tensor? scale_supers=None, Tensor? offset_supers=None) -> Tensor");
  m.def(
      "q8_matmul(Tensor x, Tensor codes, Tensor scales, Tensor? scale_supers=None, "
      "bool small_codes=False) -> Tensor");
  m.def("quantized_matmul_isa() -> str", quantized_matmul_isa);
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) {
  m.impl("q4_matmul", q4_matmul);
  m.impl("q8_matmul", q8_matmul);
}
