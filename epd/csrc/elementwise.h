// Elementwise helpers over float32 arrays shared by epd's C++ operators: conversions to and from
// the model dtype (bfloat16 or float32) and rounding to it, and SiLU. AVX-512 where the build
// targets it, plain loops otherwise (the compiler vectorises them for AVX2).
#pragma once

#include <c10/util/BFloat16.h>

#include "vec_math.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace epd_vec {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline float round_to(float x) {  // x rounded to T and back (identity for float)
  return static_cast<float>(static_cast<T>(x));
}

#ifdef __AVX512F__
// float32 -> nearest bfloat16 (ties to even), back as float32 bits
inline __m512 vround_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(0xFFFF0000))), nan, x);
}

// 16 values of T at src as float32
inline __m512 vload(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 vload(const c10::BFloat16* src) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// 16 float32 values stored as T (rounded to nearest even for bfloat16)
inline void vstore(float* dst, __m512 x) { _mm512_storeu_ps(dst, x); }
inline void vstore(c10::BFloat16* dst, __m512 x) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(vround_bf16(x)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(bits));
}

// silu(x) = x / (1 + exp(-x)), as ATen computes it in float32
inline __m512 vsilu(__m512 v) {
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), vexp(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}
#endif

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// sum of x[i]^2 (lanes of 16, then the lanes: not the sequential order, which serialises on the
// add's latency)
inline float sum_squares(const float* x, int64_t n) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i), acc);
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// x[i] <- x[i] * w[i] for w of T
template <typename T>
inline void mul_by(float* x, const T* w, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vload(w + i)));
#endif
  for (; i < n; ++i) x[i] *= to_float(w[i]);
}

// x <- silu(x)
inline void silu_inplace(float* x, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, vsilu(_mm512_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = silu(x[i]);
}

// x <- x rounded to T (nothing for float32)
template <typename T>
inline void round_inplace(float* x, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, vround_bf16(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; ++i) x[i] = round_to<T>(x[i]);
  }
}

// dst <- src as T (rounded to nearest even for bfloat16)
template <typename T>
inline void store_as(T* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) vstore(dst + i, _mm512_loadu_ps(src + i));
#endif
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

// dst <- src as float32
template <typename T>
inline void load_as(float* dst, const T* src, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, vload(src + i));
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

}  // namespace epd_vec
