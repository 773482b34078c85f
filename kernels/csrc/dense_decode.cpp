// deepinfer::dense_decode_layers on a CPU: a decode step through every layer of a Llama-style
// decoder (RMSNorm, fused qkv, RoPE, paged attention, o_proj, RMSNorm, fused gate/up, SiLU*up,
// down) in one call. The linears are packed_linear's and the attention paged_decode_attention's;
// the norms, RoPE, the cache writes and the residual adds are loops here. One call a step instead
// of a compiled graph's Python wrapper and boxed calls per layer (~60 us a layer of SmolLM2).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias);  // csrc/packed_linear.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens, double scale,
                                  int64_t block_size, int64_t splits,
                                  bool generic);  // csrc/paged_attention.cpp

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define DEEPINFER_AVX512 1
#include "vec_bf16.h"
#include "vec_exp.h"
#endif

namespace {

constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate/up, down
constexpr int64_t kRowGrain = 8;         // rows a thread takes in the element-wise loops

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }
// one rounding to the tensor's dtype, as torch's `.to(dtype)` (to nearest even)
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(at::BFloat16* p, int64_t i, float v) { p[i] = at::BFloat16(v); }
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const at::BFloat16*) {
  return static_cast<float>(at::BFloat16(v));
}

#ifdef DEEPINFER_AVX512
// 16 lanes at a time, `m` masking a row's tail; bf16 widened exactly, rounded to nearest even
inline __mmask16 tail(int64_t i, int64_t n) {
  return n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
}
inline __m512 vload(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
using deepinfer_vec::to_bf16_bits;
inline __m512 vload(const at::BFloat16* p, __mmask16 m) {
  return deepinfer_vec::widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}
inline void vstore(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void vstore(at::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(to_bf16_bits(v)));
}
inline __m512 vround(__m512 v, const float*) { return v; }
inline __m512 vround(__m512 v, const at::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(to_bf16_bits(v), 16));
}
#endif

// out = RMSNorm(x) * w, x's rows [lo, hi): the sums and the scaling in fp32, one rounding
template <typename T>
void rms_norm(const T* x, const float* w, T* out, int64_t lo, int64_t hi, int64_t h, float eps) {
  for (int64_t r = lo; r < hi; ++r) {
    const T* xr = x + r * h;
    T* o = out + r * h;
#ifdef DEEPINFER_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
      const __m512 v = vload(xr + i, tail(i, h));
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 inv =
        _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(h) + eps));
    for (int64_t i = 0; i < h; i += 16) {
      const __mmask16 m = tail(i, h);
      vstore(o + i, _mm512_mul_ps(_mm512_mul_ps(vload(xr + i, m), inv), vload(w + i, m)), m);
    }
#else
    float sum = 0.f;
    for (int64_t i = 0; i < h; ++i) sum += load(xr, i) * load(xr, i);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + eps);
    for (int64_t i = 0; i < h; ++i) store(o, i, load(xr, i) * inv * w[i]);
#endif
  }
}

// x += d (rounded as the tensors' dtype), then out = RMSNorm(x) * w where `w` is given
template <typename T>
void add_norm(T* x, const T* d, const float* w, T* out, int64_t t, int64_t h, float eps) {
  at::parallel_for(0, t, kRowGrain, [&](int64_t lo, int64_t hi) {
#ifdef DEEPINFER_AVX512
    for (int64_t i = lo * h; i < hi * h; i += 16) {
      const __mmask16 m = tail(i, hi * h);
      vstore(x + i, _mm512_add_ps(vload(x + i, m), vload(d + i, m)), m);
    }
#else
    for (int64_t i = lo * h; i < hi * h; ++i) store(x, i, load(x, i) + load(d, i));
#endif
    if (w != nullptr) rms_norm(x, w, out, lo, hi, h, eps);
  });
}

// The half-rotation RoPE of `heads` heads of a row (src) into dst; cos / sin [dim / 2] fp32.
template <typename T>
inline void rope(const T* src, T* dst, const float* cos, const float* sin, int64_t heads,
                 int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    const T* s = src + hd * dim;
    T* o = dst + hd * dim;
#ifdef DEEPINFER_AVX512
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = tail(i, half);
      const __m512 x1 = vload(s + i, m), x2 = vload(s + half + i, m);
      const __m512 c = vload(cos + i, m), sn = vload(sin + i, m);
      vstore(o + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, sn)), m);
      vstore(o + half + i, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, sn)), m);
    }
#else
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = load(s, i), x2 = load(s, i + half);
      store(o, i, x1 * cos[i] - x2 * sin[i]);
      store(o, i + half, x2 * cos[i] + x1 * sin[i]);
    }
#endif
  }
}

struct Shape {
  int64_t t, hidden, heads, kv_heads, dim, inter;
};

// q [T, Hq, D] gets the rotated q of each row; k (rotated) and v go to their cache slots
template <typename T>
void split_qkv(const Shape& s, const T* qkv, T* q, T* kc, T* vc, const int64_t* slots,
               const int64_t* pos, const float* cos, const float* sin) {
  const int64_t half = s.dim / 2, qs = s.heads * s.dim, kvs = s.kv_heads * s.dim;
  at::parallel_for(0, s.t, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* row = qkv + r * (qs + 2 * kvs);
      const float* c = cos + pos[r] * half;
      const float* sn = sin + pos[r] * half;
      rope(row, q + r * qs, c, sn, s.heads, s.dim);
      rope(row + qs, kc + slots[r] * kvs, c, sn, s.kv_heads, s.dim);
      const T* v = row + qs + kvs;
      T* vo = vc + slots[r] * kvs;
      for (int64_t i = 0; i < kvs; ++i) vo[i] = v[i];
    }
  });
}

// silu(gate) * up of gate_up [T, 2I] into out [T, I]; silu rounded first, as eager torch does
template <typename T>
void silu_mul(const T* gu, T* out, int64_t t, int64_t inter) {
  at::parallel_for(0, t, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* g = gu + r * 2 * inter;
      T* o = out + r * inter;
#ifdef DEEPINFER_AVX512
      const __m512 one = _mm512_set1_ps(1.f);
      for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 m = tail(i, inter);
        const __m512 x = vload(g + i, m);
        // sigmoid from e = exp(-|x|) <= 1: 1 / (1 + e) where x >= 0, e / (1 + e) below
        const __m512 minus_abs = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x));
        const __m512 e = deepinfer_vec::exp_neg(minus_abs);
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 num = _mm512_mask_mov_ps(one, neg, e);
        const __m512 silu = vround(_mm512_mul_ps(x, _mm512_div_ps(num, _mm512_add_ps(one, e))), g);
        vstore(o + i, _mm512_mul_ps(silu, vload(g + inter + i, m)), m);
      }
#else
      for (int64_t i = 0; i < inter; ++i) {
        const float x = load(g, i);
        const float s = round_to(x / (1.f + std::exp(-x)), g);
        store(o, i, s * load(g, inter + i));
      }
#endif
    }
  });
}

template <typename T>
at::Tensor run(const Shape& s, at::Tensor x, const at::Tensor& positions,
               const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens,
               at::TensorList k_caches, at::TensorList v_caches, at::TensorList weights,
               const at::Tensor& cos, const at::Tensor& sin, double eps, double scale,
               int64_t block_size) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  const float feps = static_cast<float>(eps);
  // the norms' weights in fp32, as eager promotes them: [layer][input, post-attention][hidden]
  std::vector<float> norms(2 * layers * s.hidden);
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t j : {0, 1}) {
      const auto& w = weights[l * kWeightsPerLayer + 3 * j];
      float* out = norms.data() + (2 * l + j) * s.hidden;
      if (w.scalar_type() == at::kFloat) {
        const float* p = w.data_ptr<float>();
        std::copy(p, p + s.hidden, out);
      } else {
        const at::BFloat16* p = w.data_ptr<at::BFloat16>();
        for (int64_t i = 0; i < s.hidden; ++i) out[i] = static_cast<float>(p[i]);
      }
    }
  const auto norm = [&](int64_t l, int64_t j) { return norms.data() + (2 * l + j) * s.hidden; };
  auto h = at::empty_like(x);
  at::parallel_for(0, s.t, kRowGrain, [&](int64_t lo, int64_t hi) {
    rms_norm(x.data_ptr<T>(), norm(0, 0), h.data_ptr<T>(), lo, hi, s.hidden, feps);
  });
  auto q = at::empty({s.t, s.heads, s.dim}, x.options());
  auto act = at::empty({s.t, s.inter}, x.options());
  const c10::optional<at::Tensor> none;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[l * kWeightsPerLayer];
    const auto qkv = packed_linear(h, w[1], none);
    split_qkv(s, qkv.data_ptr<T>(), q.data_ptr<T>(), k_caches[l].data_ptr<T>(),
              v_caches[l].data_ptr<T>(), slots.data_ptr<int64_t>(),
              positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
    const auto o = paged_decode_attention(q, k_caches[l], v_caches[l], tables, lens, scale,
                                          block_size, 0, false);
    const auto attn = packed_linear(o.view({s.t, s.heads * s.dim}), w[2], none);
    add_norm(x.data_ptr<T>(), attn.data_ptr<T>(), norm(l, 1), h.data_ptr<T>(), s.t, s.hidden,
             feps);
    const auto gu = packed_linear(h, w[4], none);
    silu_mul(gu.data_ptr<T>(), act.data_ptr<T>(), s.t, s.inter);
    const auto down = packed_linear(act, w[5], none);
    const bool last = l + 1 == layers;
    add_norm(x.data_ptr<T>(), down.data_ptr<T>(),
             last ? nullptr : norm(l + 1, 0), h.data_ptr<T>(), s.t, s.hidden, feps);
  }
  return x;
}

}  // namespace

// x [T, hidden] (the step's embedded tokens, one a sequence), positions / slots [T] int64,
// tables [T, blocks] and lens [T] (as paged_decode_attention's), per layer its K and V cache
// [slots, Hkv, D] and six weights (input norm [hidden], qkv [(Hq + 2 Hkv) D, hidden], o
// [hidden, Hq D], post-attention norm, gate/up [2 I, hidden], down [hidden, I]); cos / sin
// [positions, D / 2] fp32 -> the hidden states after the last layer (before the final norm).
at::Tensor dense_decode_layers(const at::Tensor& x_in, const at::Tensor& positions_in,
                               const at::Tensor& slots_in, const at::Tensor& tables,
                               const at::Tensor& lens, at::TensorList k_caches,
                               at::TensorList v_caches, at::TensorList weights,
                               const at::Tensor& cos_in, const at::Tensor& sin_in,
                               int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                               int64_t block_size) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(v_caches.size()) == layers,
              "a K and a V cache a layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer,
              "six weights a layer");
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), "x must be [T, hidden] on a CPU");
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 only");
  const int64_t t = x_in.size(0), hidden = x_in.size(1);
  const auto& k0 = k_caches[0];
  TORCH_CHECK(k0.dim() == 3 && k0.size(1) == num_kv_heads, "caches must be [slots, Hkv, D]");
  const int64_t dim = k0.size(2);
  TORCH_CHECK(dim % 2 == 0 && num_heads % num_kv_heads == 0, "bad head shapes");
  const int64_t inter = weights[5].size(1);
  TORCH_CHECK(cos_in.dim() == 2 && cos_in.size(1) == dim / 2 && sin_in.sizes() == cos_in.sizes(),
              "cos / sin must be [positions, head_dim / 2]: full rotary only");
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[l * kWeightsPerLayer];
    for (int i : {0, 3})
      TORCH_CHECK(w[i].numel() == hidden && w[i].is_contiguous() &&
                      (w[i].scalar_type() == at::kFloat || w[i].scalar_type() == at::kBFloat16),
                  "norm weights must be [hidden], float32 or bfloat16");
    TORCH_CHECK(w[1].dim() == 2 && w[1].size(0) == (num_heads + 2 * num_kv_heads) * dim &&
                    w[1].size(1) == hidden,
                "qkv weight shape");
    TORCH_CHECK(w[2].dim() == 2 && w[2].size(0) == hidden && w[2].size(1) == num_heads * dim,
                "o weight shape");
    TORCH_CHECK(w[4].dim() == 2 && w[4].size(0) == 2 * inter && w[4].size(1) == hidden,
                "gate/up weight shape");
    TORCH_CHECK(w[5].dim() == 2 && w[5].size(0) == hidden && w[5].size(1) == inter,
                "down weight shape");
    for (int i : {1, 2, 4, 5}) TORCH_CHECK(w[i].scalar_type() == dtype, "weights in x's dtype");
    for (const auto& c : {k_caches[l], v_caches[l]})
      TORCH_CHECK(c.is_contiguous() && c.scalar_type() == dtype && c.sizes() == k0.sizes(),
                  "caches must be contiguous, in x's dtype, all of one shape");
  }
  const auto positions = positions_in.to(at::kLong).contiguous();
  const auto slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(positions.numel() == t && slots.numel() == t, "a position and a slot a row");
  const auto cos = cos_in.to(at::kFloat).contiguous();
  const auto sin = sin_in.to(at::kFloat).contiguous();
  {
    const int64_t* pp = positions.data_ptr<int64_t>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t r = 0; r < t; ++r) {
      TORCH_CHECK(pp[r] >= 0 && pp[r] < cos.size(0), "position out of range");
      TORCH_CHECK(sp[r] >= 0 && sp[r] < k0.size(0), "slot out of range");
    }
  }
  auto x = x_in.contiguous().clone();
  if (t == 0) return x;
  const Shape s{t, hidden, num_heads, num_kv_heads, dim, inter};
  if (dtype == at::kFloat)
    return run<float>(s, x, positions, slots, tables, lens, k_caches, v_caches, weights, cos, sin,
                      eps, scale, block_size);
  return run<at::BFloat16>(s, x, positions, slots, tables, lens, k_caches, v_caches, weights, cos,
                           sin, eps, scale, block_size);
}

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def(
      "dense_decode_layers(Tensor x, Tensor positions, Tensor slots, Tensor tables, "
      "Tensor lens, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor[] weights, Tensor cos, "
      "Tensor sin, int num_heads, int num_kv_heads, float eps, float scale, int block_size) "
      "-> Tensor");
}
TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("dense_decode_layers", &dense_decode_layers); }
