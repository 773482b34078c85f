// exp of softmax arguments (x <= 0) on 16 floats at once, shared by the CPU attention kernels;
// included only where AVX-512 is on (DEEPINFER_AVX512).
#pragma once
#include <immintrin.h>

namespace deepinfer_vec {

// exp for x <= 0 (softmax arguments): 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5],
// 2^f by its degree-6 Taylor polynomial (relative error ~1e-7).
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace deepinfer_vec
