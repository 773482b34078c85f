// Causal prefill attention on CPU, bf16 or fp32: flash-style blocks whose two products (Q K^T
// and P V) run as oneDNN's batch-reduce GEMM into fp32 (torch's cpublas::brgemm; for bf16 AMX
// where the CPU has it, AVX512-BF16 otherwise; without either, bf16 operands are widened to
// fp32 as they are packed, and the products run in fp32), the online softmax in fp32 in
// between. The query rows of a KV head's whole group share each product. Parallel over (KV
// head, query block).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#include <immintrin.h>
#define DEEPINFER_AVX512 1
#include "vec_bf16.h"
#include "vec_exp.h"
#endif

namespace {

#ifdef DEEPINFER_AVX512

constexpr int64_t kKeyBlock = 128;  // keys per product (even: the VNNI layout pairs them)
constexpr int64_t kRows = 128;      // query rows per product, over the whole head group

using bf16 = at::BFloat16;
using deepinfer_vec::exp_neg;

// K's block [KB, D] (rows `stride` apart) as the B operand of Q K^T, K^T [D, KB]: for bf16 in
// the VNNI layout ([D/2][KB][2]) the products take. Rows past `n` are zero.
void pack_keys(const bf16* k, int64_t stride, int64_t n, int64_t D, bf16* out) {
  auto* o = reinterpret_cast<uint32_t*>(out);  // one (d, d + 1) pair of a key per word
  for (int64_t t = 0; t < kKeyBlock; ++t) {
    const auto* row = reinterpret_cast<const uint32_t*>(k + t * stride);
    for (int64_t p = 0; p < D / 2; ++p) o[p * kKeyBlock + t] = t < n ? row[p] : 0u;
  }
}
template <typename T>
void pack_keys(const T* k, int64_t stride, int64_t n, int64_t D, float* out) {
  for (int64_t t = 0; t < kKeyBlock; ++t)
    for (int64_t d = 0; d < D; ++d)
      out[d * kKeyBlock + t] = t < n ? static_cast<float>(k[t * stride + d]) : 0.f;
}

// V's block [KB, D] as the B operand of P V: for bf16 VNNI ([KB/2][D][2]). Rows past `n` are
// zero.
void pack_values(const bf16* v, int64_t stride, int64_t n, int64_t D, bf16* out) {
  const bf16 zero(0.f);
  for (int64_t t = 0; t < kKeyBlock; t += 2) {
    const bf16* r0 = v + t * stride;
    const bf16* r1 = r0 + stride;
    bf16* o = out + t * D;
    for (int64_t d = 0; d < D; ++d) {
      o[2 * d] = t < n ? r0[d] : zero;
      o[2 * d + 1] = t + 1 < n ? r1[d] : zero;
    }
  }
}
template <typename T>
void pack_values(const T* v, int64_t stride, int64_t n, int64_t D, float* out) {
  for (int64_t t = 0; t < kKeyBlock; ++t) {
    if (t >= n)
      std::memset(out + t * D, 0, D * sizeof(float));
    else if constexpr (std::is_same_v<T, float>)
      std::memcpy(out + t * D, v + t * stride, D * sizeof(float));
    else
      for (int64_t d = 0; d < D; ++d) out[t * D + d] = static_cast<float>(v[t * stride + d]);
  }
}

// 16 probabilities stored as the P operand's type.
inline void store_probs(__m512 p, bf16* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), deepinfer_vec::to_bf16(p));
}
inline void store_probs(__m512 p, float* out) { _mm512_storeu_ps(out, p); }

// The lanes of a 16-key vector whose keys a row may see, given how many remain visible.
inline __mmask16 live_lanes(int64_t visible) {
  return visible <= 0 ? 0 : visible >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << visible) - 1);
}

struct Shape {
  int64_t n, ctx, hkv, group, dim, q_rows;  // q_rows: query tokens per task
  int64_t q_stride, k_stride, v_stride, o_stride;  // between tokens, in elements
  float scale;
};

// One task: KV head h, query tokens [i0, i0 + qn). Row r of the products is (head
// h * group + r / qn, token i0 + r % qn). T: the tensors' type; C: the products' operands
// (T, or fp32 for bf16 widened).
template <typename T, typename C>
void attend_block(const Shape& s, const T* q, const C* kp, const C* vp, T* o, int64_t h,
                  int64_t i0, int64_t qn) {
  constexpr bool vnni = std::is_same_v<C, bf16>;
  const int64_t D = s.dim, M = s.group * qn, KB = kKeyBlock;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<C> qa(M * D);
  std::vector<float> scores(M * KB), acc(M * D, 0.f), m(M, kNegInf), l(M, 0.f);
  std::vector<C> probs(M * KB);
  for (int64_t r = 0; r < M; ++r) {
    const int64_t head = h * s.group + r / qn, tok = i0 + r % qn;
    const T* row = q + tok * s.q_stride + head * D;
    if constexpr (std::is_same_v<T, C>)
      std::memcpy(&qa[r * D], row, D * sizeof(T));
    else
      for (int64_t d = 0; d < D; ++d) qa[r * D + d] = static_cast<C>(row[d]);
  }
  const int64_t first_pos = s.ctx - s.n + i0;  // the context position of token i0
  const int64_t blocks = (first_pos + qn - 1) / KB + 1;
  const int64_t per_head = (s.ctx + KB - 1) / KB * KB * D;
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t j = 0; j < blocks; ++j) {
    at::native::cpublas::brgemm(M, KB, D, D, KB, KB, false, qa.data(),
                                kp + h * per_head + j * KB * D, scores.data(), vnni);
    for (int64_t r = 0; r < M; ++r) {
      const int64_t valid = std::min(KB, first_pos + r % qn + 1 - j * KB);
      float* sr = &scores[r * KB];
      C* pr = &probs[r * KB];
      if (valid <= 0) {
        std::memset(pr, 0, KB * sizeof(C));
        continue;
      }
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int64_t t = 0; t < KB; t += 16) {
        const __mmask16 live = live_lanes(valid - t);
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr + t), scale);
        _mm512_storeu_ps(sr + t, x);
        mx = _mm512_mask_max_ps(mx, live, mx, x);
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < KB; t += 16) {
        const __mmask16 live = live_lanes(valid - t);
        const __m512 p = _mm512_maskz_mov_ps(
            live, exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sr + t), mv)));
        sum = _mm512_add_ps(sum, p);
        store_probs(p, pr + t);
      }
      const float corr = std::exp(m[r] - m_new);  // 0 at the first block (m = -inf)
      l[r] = l[r] * corr + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
      if (corr != 1.f) {
        float* ar = &acc[r * D];
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      }
    }
    at::native::cpublas::brgemm(M, D, KB, KB, D, D, true, probs.data(),
                                vp + h * per_head + j * KB * D, acc.data(), vnni);
  }
  for (int64_t r = 0; r < M; ++r) {
    const int64_t head = h * s.group + r / qn, tok = i0 + r % qn;
    const float inv = 1.f / l[r];
    T* out = o + tok * s.o_stride + head * D;
    for (int64_t d = 0; d < D; ++d) out[d] = T(acc[r * D + d] * inv);
  }
}

template <typename T, typename C = T>
void run(const Shape& s, const T* qd, const T* kd, const T* vd, T* od) {
  constexpr bool vnni = std::is_same_v<C, bf16>;
  const int64_t hkv = s.hkv, ctx = s.ctx, D = s.dim, n = s.n, q_rows = s.q_rows;
  const int64_t key_blocks = (ctx + kKeyBlock - 1) / kKeyBlock;
  const int64_t per_head = key_blocks * kKeyBlock * D;
  std::vector<C> packed(2 * hkv * per_head);
  C* kp = packed.data();
  C* vp = kp + hkv * per_head;
  at::parallel_for(0, hkv * key_blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t h = i / key_blocks, j = i % key_blocks;
      const int64_t t0 = j * kKeyBlock, rows = std::min(kKeyBlock, ctx - t0);
      const int64_t at = h * per_head + t0 * D;
      pack_keys(kd + t0 * s.k_stride + h * D, s.k_stride, rows, D, kp + at);
      pack_values(vd + t0 * s.v_stride + h * D, s.v_stride, rows, D, vp + at);
    }
  });
  const int64_t q_blocks = (n + q_rows - 1) / q_rows;
  // the last query blocks see the most keys: they go first, and threads take the next task
  // as they finish (a static split would give one thread every long block)
  const int64_t tasks = hkv * q_blocks;
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; ++i) {
      const int64_t h = i % hkv, b = q_blocks - 1 - i / hkv;
      const int64_t i0 = b * q_rows;
      attend_block<T, C>(s, qd, kp, vp, od, h, i0, std::min(q_rows, n - i0));
    }
    at::native::cpublas::brgemm_release(vnni);
  }
}

#endif  // DEEPINFER_AVX512

}  // namespace

// q [n, Hq, D], k and v [ctx, Hkv, D], out [n, Hq, D] (one dtype, bf16 or fp32; the last dim
// contiguous, any token stride): query token i sits at context position ctx - n + i and
// attends keys 0..that (causal, lower-right). Writes out.
void prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale, at::Tensor out) {
#ifdef DEEPINFER_AVX512
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "bad ranks");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "CPU tensors only");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "bfloat16 or float32 only");
  for (const auto* t : {&q, &k, &v, &out}) {
    TORCH_CHECK(t->scalar_type() == dtype, "q, k, v and out must share a dtype");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "heads must be dense rows");
  }
  const int64_t n = q.size(0), hq = q.size(1), D = q.size(2);
  const int64_t ctx = k.size(0), hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == D, "k and v must be [ctx, Hkv, D]");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(hq % hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(D % 32 == 0, "head_dim must be a multiple of 32");
  TORCH_CHECK(n >= 1 && ctx >= n, "need 1 <= n <= ctx");
  const int64_t group = hq / hkv;
  const Shape s{n, ctx, hkv, group, D, std::max<int64_t>(1, kRows / group), q.stride(0),
                k.stride(0), v.stride(0), out.stride(0), static_cast<float>(scale)};
  // oneDNN's bf16 batch-reduce GEMM needs AVX512-BF16 (or AMX, which comes with it; the
  // library is built for this CPU): without it, widened to fp32
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16)
    run(s, q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), out.data_ptr<bf16>());
#else
  if (dtype == at::kBFloat16)
    run<bf16, float>(s, q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(),
                     out.data_ptr<bf16>());
#endif
  else
    run(s, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>());
#else
  TORCH_CHECK(false, "prefill_attention needs AVX-512 (not in this build)");
#endif
}

// The schema is defined in kernels/prefill_attention_cpu.py.
TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
