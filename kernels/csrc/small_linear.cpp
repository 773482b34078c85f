// y = x W^T for a few bf16 rows (decode at low concurrency): W [N, K] read once, in place, front
// to back, each 32-element chunk of a weight row dotted with every row of x (fp32 sums: dpbf16
// where the CPU has AVX512-BF16, else fp32 FMAs on the widened halves), the next block's lines
// prefetched. `bench.cpu_kernels linear` against oneDNN.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DEEPINFER_SMALL_LINEAR 1
#include "vec_bf16.h"
#endif

namespace {

constexpr int64_t kMaxRows = 8;

#ifdef DEEPINFER_SMALL_LINEAR
using deepinfer_vec::Pairs;
inline Pairs load_pairs(const at::BFloat16* p) {
  return deepinfer_vec::pairs(_mm512_loadu_si512(p));
}
inline Pairs load_pairs(const at::BFloat16* p, __mmask32 tail) {
  return deepinfer_vec::pairs(_mm512_maskz_loadu_epi16(tail, p));
}

// Output features [lo, hi) for all M rows of x, NB weight rows at a time.
template <int M, int NB>
void dot_rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
              at::BFloat16* y, int64_t k, int64_t n, int64_t lo, int64_t hi) {
  const int64_t full = k / 32 * 32;
  const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);
  int64_t j = lo;
  for (; j + NB <= hi; j += NB) {
    __m512 acc[NB][M];
    for (int b = 0; b < NB; ++b)
      for (int m = 0; m < M; ++m) acc[b][m] = _mm512_setzero_ps();
    const at::BFloat16* wj = w + j * k;
    for (int64_t c = 0; c < full; c += 32) {
      Pairs xs[M];
      for (int m = 0; m < M; ++m) xs[m] = load_pairs(x + m * k + c);
      for (int b = 0; b < NB; ++b) {
        // the next block's rows, at this chunk: a 4 KiB page's first lines are not left to
        // the hardware prefetcher, which stops at page ends
        _mm_prefetch(reinterpret_cast<const char*>(wj + (NB + b) * k + c), _MM_HINT_T0);
        const Pairs wv = load_pairs(wj + b * k + c);
        for (int m = 0; m < M; ++m) acc[b][m] = deepinfer_vec::dot(acc[b][m], wv, xs[m]);
      }
    }
    if (full < k) {
      for (int b = 0; b < NB; ++b) {
        const Pairs wv = load_pairs(wj + b * k + full, tail);
        for (int m = 0; m < M; ++m)
          acc[b][m] = deepinfer_vec::dot(acc[b][m], wv, load_pairs(x + m * k + full, tail));
      }
    }
    for (int b = 0; b < NB; ++b) {
      const float add = bias ? static_cast<float>(bias[j + b]) : 0.0f;
      for (int m = 0; m < M; ++m)
        y[m * n + j + b] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[b][m]) + add);
    }
  }
  if (j < hi) dot_rows<M, 1>(x, w, bias, y, k, n, j, hi);
}

template <int M>
void small_linear_rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
                       at::BFloat16* y, int64_t k, int64_t n) {
  // NB * M sums and NB + M inputs (each 1 register with dpbf16, else 2) in 32 registers
  constexpr int kRegs = sizeof(Pairs) / sizeof(__m512);
  constexpr int NB = M <= 2 ? 8 : M <= 4 ? 4 : kRegs == 1 ? 2 : 1;
  // chunks of 64 features: a thread's share is contiguous, read front to back
  at::parallel_for(0, (n + 63) / 64, 1, [&](int64_t lo, int64_t hi) {
    dot_rows<M, NB>(x, w, bias, y, k, n, lo * 64, std::min(hi * 64, n));
  });
}

using RowsFn = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*,
                        at::BFloat16*, int64_t, int64_t);
constexpr RowsFn kByRows[kMaxRows] = {
    small_linear_rows<1>, small_linear_rows<2>, small_linear_rows<3>, small_linear_rows<4>,
    small_linear_rows<5>, small_linear_rows<6>, small_linear_rows<7>, small_linear_rows<8>};
#endif

}  // namespace

// x [M, K] bf16 (1 <= M <= 8), weight [N, K] bf16, bias [N] bf16 or none -> [M, N] bf16;
// the sums in fp32, as oneDNN's. Where the library was built without AVX-512: F.linear.
at::Tensor small_linear(const at::Tensor& x_in, const at::Tensor& weight_in,
                        const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && weight_in.dim() == 2, "x must be [M, K], weight [N, K]");
  TORCH_CHECK(x_in.size(1) == weight_in.size(1), "x and weight disagree on K");
  TORCH_CHECK(x_in.size(0) >= 1 && x_in.size(0) <= kMaxRows, "1 to 8 rows of x");
  TORCH_CHECK(x_in.device().is_cpu() && weight_in.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && weight_in.scalar_type() == at::kBFloat16,
              "bfloat16 only");
#ifdef DEEPINFER_SMALL_LINEAR
  const auto x = x_in.contiguous();
  const auto weight = weight_in.contiguous();
  const at::BFloat16* bias = nullptr;
  at::Tensor b;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == weight.size(0), "bias must be [N]");
    b = bias_in->to(at::kBFloat16).contiguous();
    bias = b.data_ptr<at::BFloat16>();
  }
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  auto y = at::empty({m, n}, x.options());
  kByRows[m - 1](x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), bias,
                 y.data_ptr<at::BFloat16>(), k, n);
  return y;
#else
  return at::linear(x_in, weight_in, bias_in);
#endif
}

// The schemas and the shape-only implementation are defined in kernels/small_linear.py.
TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("small_linear", &small_linear); }
