// The kernels' element types to and from float, shared by every kvchat kernel source.
//
// bf16 -> float is exact (the bits shifted up). float -> bf16 rounds to nearest even,
// as torch does, in integer arithmetic the compiler can vectorize; a NaN stays a NaN
// (tested on the bits: -ffast-math may assume no NaN exists and drop std::isnan).
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvchat {

inline float widen(float x) { return x; }
inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  c10::BFloat16 out;
  out.x = nan ? uint16_t{0x7FC0} : static_cast<uint16_t>(bits >> 16);
  return out;
}

// x as torch holds it after an op in dtype T: rounded to T, read back as float.
template <typename T>
inline float rounded(float x) {
  return widen(narrow<T>(x));
}

#if defined(__AVX512F__)
// 16 consecutive elements as floats.
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

// narrow<bf16> of 16 floats at once, bit for bit (the same integer rounding, NaN tested
// on the bits), as 16 bf16 bit patterns.
inline __m256i narrow16_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  const __m512i half = _mm512_mask_mov_epi32(_mm512_srli_epi32(up, 16), nan,
                                             _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(half);
}

// 16 floats stored as T (rounded as `narrow` rounds).
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow16_bf16(x));
}

// `rounded<T>` of 16 floats: as T holds them, read back.
template <typename T>
inline __m512 rounded16(__m512 x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow16_bf16(x)), 16));
  } else {
    return x;
  }
}
#endif

}  // namespace kvchat
