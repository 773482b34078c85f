// Greedy sampling on CPU: each row's argmax, the first of tied maxima (as torch's max / argmax),
// over fp32 or bf16 logits, one pass with a running maximum and its index per vector lane.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define DEEPINFER_GREEDY_AVX512 1
#include "vec_bf16.h"
#endif

namespace {

inline float as_float(float x) { return x; }
inline float as_float(at::BFloat16 x) { return static_cast<float>(x); }

#ifdef DEEPINFER_GREEDY_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return deepinfer_vec::widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// NaNs are passed over (torch's max would return the first NaN's index).
template <typename T>
int64_t row_argmax(const T* p, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0, i = 0;
#ifdef DEEPINFER_GREEDY_AVX512
  if (n >= 16) {
    __m512 vbest = _mm512_set1_ps(best);
    __m512i vat = _mm512_setzero_si512();
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; i + 16 <= n; i += 16, lane = _mm512_add_epi32(lane, step)) {
      const __m512 x = load16(p + i);
      const __mmask16 more = _mm512_cmp_ps_mask(x, vbest, _CMP_GT_OQ);  // strictly: the first
      vbest = _mm512_mask_mov_ps(vbest, more, x);
      vat = _mm512_mask_mov_epi32(vat, more, lane);
    }
    best = _mm512_reduce_max_ps(vbest);
    const __mmask16 tied = _mm512_cmp_ps_mask(vbest, _mm512_set1_ps(best), _CMP_EQ_OQ);
    // the smallest index among the lanes holding the maximum
    at = _mm512_mask_reduce_min_epi32(tied, vat);
  }
#endif
  for (; i < n; ++i) {
    const float x = as_float(p[i]);
    if (x > best) {
      best = x;
      at = i;
    }
  }
  return at;
}

template <typename T>
void rows_argmax(const at::Tensor& logits, int64_t* out) {
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  const T* base = logits.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) out[r] = row_argmax(base + r * stride, vocab);
  });
}

}  // namespace

// logits [S, V] float32 or bfloat16 (rows of any stride, each contiguous) -> [S] int64.
at::Tensor greedy_rows(const at::Tensor& logits_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.size(1) > 0, "logits must be [S, V], V > 0");
  TORCH_CHECK(logits_in.device().is_cpu(), "CPU tensors only");
  const auto logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat) {
    rows_argmax<float>(logits, out.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "float32 or bfloat16 logits only");
    rows_argmax<at::BFloat16>(logits, out.data_ptr<int64_t>());
  }
  return out;
}

// The schema and the shape-only implementation are defined in kernels/sampling_cpu.py.
TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("greedy_rows", &greedy_rows); }
