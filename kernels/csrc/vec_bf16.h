// bf16 <-> fp32 on 16 lanes at once, shared by the CPU kernels; included only where AVX-512F
// is on. `dot` is AVX512-BF16's dpbf16 where the CPU has it, else two FMAs.
#pragma once
#include <immintrin.h>

namespace deepinfer_vec {

// 16 bf16 values widened to fp32, exactly
inline __m512 widen_bf16(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// 16 fp32 values rounded to bf16 (to nearest even, NaN kept a quiet NaN), one per 32-bit lane
inline __m512i to_bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

// 16 fp32 values rounded to bf16 (to nearest even): cvtneps where the CPU has AVX512-BF16
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return _mm512_cvtepi32_epi16(to_bf16_bits(v));
#endif
}

// 32 bf16 values as an operand of `dot`, each 32-bit lane a pair: as loaded where the CPU has
// AVX512-BF16 (dpbf16 takes them so), else each pair's halves widened to fp32 once, so that an
// operand used in many products is split once
#if defined(__AVX512BF16__)
struct Pairs {
  __m512i v;
};
inline Pairs pairs(__m512i x) { return Pairs{x}; }
// acc + a.b, each 32-bit lane adding its pair's two products
inline __m512 dot(__m512 acc, Pairs a, Pairs b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a.v, (__m512bh)b.v);
}
#else
struct Pairs {
  __m512 lo, hi;
};
inline Pairs pairs(__m512i x) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  return Pairs{_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
               _mm512_castsi512_ps(_mm512_and_si512(x, high))};
}
// products of bf16 values are exact in fp32: only the order of the additions differs from dpbf16
inline __m512 dot(__m512 acc, Pairs a, Pairs b) {
  return _mm512_fmadd_ps(a.hi, b.hi, _mm512_fmadd_ps(a.lo, b.lo, acc));
}
#endif

}  // namespace deepinfer_vec
