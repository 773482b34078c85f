// Paged decode attention on CPU that reads K/V blocks in place: one query token per row, GQA,
// fp32 or bf16 caches, fp32 accumulation and an online softmax. Consecutive rows whose tables
// agree (a request's verify rows: one per draft position) form a span that reads each chunk
// of K/V from memory once for all its rows. Parallel over (span, piece of its context); a
// task takes every KV head of each 16-token chunk in turn, so a chunk's rows are read side by
// side. Pieces of one context are merged at the end. Vector code needs AVX-512 (F, BW, VL,
// DQ); bf16 products use AVX512-BF16 where the CPU has it, fp32 FMAs elsewhere.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
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

constexpr int kMaxGroup = 16;  // query heads per KV head
constexpr int kChunk = 16;     // tokens scored together

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float load_float(const float* p, int64_t i) { return p[i]; }
inline float load_float(const at::BFloat16* p, int64_t i) {
  return bf16_to_float(reinterpret_cast<const uint16_t*>(p)[i]);
}

struct Problem {
  int64_t hkv, group, dim, block_size, max_blocks;
  float scale;
  const int64_t* tables;  // [B, max_blocks]
  const int64_t* lens;    // [B]
};

// The rows a task attends: `rows` consecutive ones from `first`, every one reading the blocks
// of `table` (its longest row's); row r attends the task's positions below lens[first + r],
// its query the next row's after the first's (hkv * group * dim apart), its state (below) the
// next row's (hkv * head_step apart).
struct Span {
  int64_t first;
  int rows;
  const int64_t* table;
};

// The softmax state of one (row, KV head, context piece) lives in `state`: acc [G, D]
// (sum of p * v), then m [G] (running max) and l [G] (running sum of p); a task starts it
// with acc = l = 0, m = -inf. A task attends tokens [begin, end) of one span for every KV
// head: its first row's state at `state` (head h's at state + h * head_step), its first
// row's query at `q`.
template <typename T>
using AttendFn = void (*)(const Problem&, const Span& sp, const T* q, const T* kc,
                          const T* vc, int64_t begin, int64_t end, float* state,
                          int64_t head_step);

// Scalar kernel (any head_dim, any group): one row's tokens [begin, end) of `table`.
template <typename T>
void attend_generic_row(const Problem& pb, const int64_t* table, const T* q, const T* kc,
                        const T* vc, int64_t begin, int64_t end, float* state,
                        int64_t head_step) {
  const int64_t G = pb.group, D = pb.dim, bs = pb.block_size;
  std::vector<float> qf(G * D);
  for (int64_t h = 0; h < pb.hkv; ++h) {
    float* acc_all = state + h * head_step;
    float* m = acc_all + G * D;
    float* l = m + G;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load_float(q, (h * G + g) * D + d);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = (table[t / bs] * bs + t % bs) * pb.hkv + h;
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * load_float(kc, row * D + d);
        s *= pb.scale;
        const float m_new = std::max(m[g], s);
        const float corr = std::exp(m[g] - m_new);
        const float p = std::exp(s - m_new);
        l[g] = l[g] * corr + p;
        float* acc = acc_all + g * D;
        for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * corr + p * load_float(vc, row * D + d);
        m[g] = m_new;
      }
    }
  }
}

// The scalar kernel over a span: each row in turn, up to its own length.
template <typename T>
void attend_generic(const Problem& pb, const Span& sp, const T* q, const T* kc, const T* vc,
                    int64_t begin, int64_t end, float* state, int64_t head_step) {
  for (int r = 0; r < sp.rows; ++r)
    attend_generic_row(pb, sp.table, q + r * pb.hkv * pb.group * pb.dim, kc, vc, begin,
                       std::min(end, pb.lens[sp.first + r]), state + r * pb.hkv * head_step,
                       head_step);
}

#ifdef DEEPINFER_AVX512

using deepinfer_vec::exp_neg;
using deepinfer_vec::Pairs;
using deepinfer_vec::widen_bf16;

// Lane j of the result = the sum of v[j]'s 16 lanes (a transpose-and-add tree).
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88),
                         _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44),
                         _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                 _mm512_shuffle_ps(c[0], c[1], 0xDD));
  // d holds the sums in the order 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, d);
}

// D / 16 float lanes of a row, as fp32 vectors.
template <int D>
inline void load_row(const float* p, __m512* out) {
  for (int i = 0; i < D / 16; ++i) out[i] = _mm512_loadu_ps(p + 16 * i);
}
template <int D>
inline void load_row(const at::BFloat16* p, __m512* out) {
  for (int i = 0; i < D / 16; ++i)
    out[i] = widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * i)));
}

// The query of one head, held as the key loads it: fp32 lanes, or bf16 pairs (vec_bf16.h).
template <typename T, int D>
struct QueryRegs;

template <int D>
struct QueryRegs<float, D> {
  __m512 r[D / 16];
  void load(const float* q) { load_row<D>(q, r); }
  // 16 partial sums of q . k
  inline __m512 dot(const float* k) const {
    __m512 s = _mm512_mul_ps(r[0], _mm512_loadu_ps(k));
    for (int i = 1; i < D / 16; ++i) s = _mm512_fmadd_ps(r[i], _mm512_loadu_ps(k + 16 * i), s);
    return s;
  }
};

template <int D>
struct QueryRegs<at::BFloat16, D> {
  Pairs r[D / 32];
  void load(const at::BFloat16* q) {
    for (int i = 0; i < D / 32; ++i) r[i] = deepinfer_vec::pairs(_mm512_loadu_si512(q + 32 * i));
  }
  inline __m512 dot(const at::BFloat16* k) const {
    __m512 s = _mm512_setzero_ps();
    for (int i = 0; i < D / 32; ++i)
      s = deepinfer_vec::dot(s, r[i], deepinfer_vec::pairs(_mm512_loadu_si512(k + 32 * i)));
    return s;
  }
};

// acc[g] += sum_j probs[g][j] * v_j over the chunk's n rows, in fp32.
template <typename T, int D, int G>
inline void accumulate_v(__m512 (&acc)[G][D / 16], const float (&probs)[G][kChunk],
                         const T* vrow, int n, int64_t row_stride) {
  for (int j = 0; j < n; ++j, vrow += row_stride) {
    __m512 vr[D / 16];
    load_row<D>(vrow, vr);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g][j]);
      for (int i = 0; i < D / 16; ++i) acc[g][i] = _mm512_fmadd_ps(p, vr[i], acc[g][i]);
    }
  }
}

#ifdef __AVX512BF16__
// bf16 caches: acc[g] += sum_j probs[g][j] * v_j by dpbf16 over token pairs, the probabilities
// rounded to bf16 (as flash kernels round P for their P.V product) and `sums[g]` the sum of
// those rounded ones (the softmax's denominator of the same weights). A pair's V rows are
// interleaved by unpacklo / unpackhi, so acc[g][2i] and acc[g][2i + 1] hold lanes of
// zmm i of a row in that order (`unpermute` puts them back): a third of the float path's
// instructions per token.
template <int D, int G>
inline void accumulate_v_pairs(__m512 (&acc)[G][D / 16], const float (&probs)[G][kChunk],
                               float (&sums)[G], const at::BFloat16* vrow, int n,
                               int64_t row_stride) {
  alignas(64) uint32_t pairs[G][kChunk / 2];
  for (int g = 0; g < G; ++g) {
    const __m256bh p = _mm512_cvtneps_pbh(_mm512_load_ps(probs[g]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[g]), (__m256i)p);
    const __m512 rounded = widen_bf16((__m256i)p);
    sums[g] = _mm512_reduce_add_ps(rounded);  // lanes past n hold 0
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int j = 0; j < n; j += 2, vrow += 2 * row_stride) {
    const bool both = j + 1 < n;
    for (int i = 0; i < D / 32; ++i) {
      const __m512i a = _mm512_loadu_si512(vrow + 32 * i);
      const __m512i b = both ? _mm512_loadu_si512(vrow + row_stride + 32 * i) : zero;
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < G; ++g) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][j / 2]));
        acc[g][2 * i] = _mm512_dpbf16_ps(acc[g][2 * i], lo, pp);
        acc[g][2 * i + 1] = _mm512_dpbf16_ps(acc[g][2 * i + 1], hi, pp);
      }
    }
  }
}

// The lanes accumulate_v_pairs leaves (per 32 values of a row: unpacklo's then unpackhi's)
// back in the row's order, for the D floats at `acc`.
template <int D>
inline void unpermute(float* acc) {
  // value d of a 32-wide block: 128-bit lane L = d / 8, w = d % 8; unpacklo holds w < 4 at
  // dword 4L + w, unpackhi w >= 4 at dword 4L + w - 4 (indices >= 16 pick from the second)
  const __m512i i1 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i2 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < D / 32; ++i) {
    const __m512 lo = _mm512_loadu_ps(acc + 32 * i), hi = _mm512_loadu_ps(acc + 32 * i + 16);
    _mm512_storeu_ps(acc + 32 * i, _mm512_permutex2var_ps(lo, i1, hi));
    _mm512_storeu_ps(acc + 32 * i + 16, _mm512_permutex2var_ps(lo, i2, hi));
  }
}
#endif  // __AVX512BF16__

template <typename T, int D, int G>
void attend_avx512(const Problem& pb, const Span& sp, const T* q_span, const T* kc,
                   const T* vc, int64_t begin, int64_t end, float* state_span,
                   int64_t head_step) {
  constexpr int V = D / 16;  // fp32 vectors per row
  // bf16 caches take P.V by dpbf16 (accumulate_v_pairs) where the CPU has it; the state is
  // in its lane order until the task's last chunk (it starts at zero, which any order holds).
  // Without dpbf16, a pair's products cost what the widened rows' FMAs cost: accumulate_v.
#ifdef __AVX512BF16__
  constexpr bool kPairs = std::is_same_v<T, at::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  const int64_t bs = pb.block_size, hkv = pb.hkv, row_stride = hkv * D;
  const __m512 scale = _mm512_set1_ps(pb.scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t* table = sp.table;
  alignas(64) float probs[G][kChunk];
  __m512 part[G][kChunk];
  for (int64_t t0 = begin; t0 < end;) {
    // a chunk stays inside one block: its rows are row_stride apart, every head's side by side
    const int64_t first = table[t0 / bs] * bs + t0 % bs;
    const int64_t block_end = std::min(end, (t0 / bs + 1) * bs);
    const int n = static_cast<int>(std::min<int64_t>(kChunk, block_end - t0));
    if (t0 + n < end) {  // the next chunk's rows, every head's, while this one computes
      const int64_t t1 = t0 + n;
      const int64_t next = table[t1 / bs] * bs + t1 % bs;
      const int rows = static_cast<int>(std::min<int64_t>(kChunk, end - t1));
      const char* kn = reinterpret_cast<const char*>(kc + next * row_stride);
      const char* vn = reinterpret_cast<const char*>(vc + next * row_stride);
      const int64_t bytes = rows * row_stride * static_cast<int64_t>(sizeof(T));
      for (int64_t off = 0; off < bytes; off += 64) {
        _mm_prefetch(kn + off, _MM_HINT_T0);
        _mm_prefetch(vn + off, _MM_HINT_T0);
      }
    }
    // each row of the span scores the chunk while it sits in L1, up to its own length
    for (int64_t h = 0; h < hkv; ++h) {
      for (int r = 0; r < sp.rows; ++r) {
        const int64_t row_end = std::min(t0 + n, pb.lens[sp.first + r]);
        if (row_end <= t0) continue;
        const int n_r = static_cast<int>(row_end - t0);
        const __mmask16 valid = static_cast<__mmask16>((1u << n_r) - 1);
        const T* q = q_span + r * hkv * G * D;
        float* acc_mem = state_span + (r * hkv + h) * head_step;
        float* m = acc_mem + G * D;
        float* l = m + G;
        QueryRegs<T, D> qr[G];
        for (int g = 0; g < G; ++g) qr[g].load(q + (h * G + g) * D);
        const T* krow = kc + (first * hkv + h) * D;
        for (int j = 0; j < n_r; ++j, krow += row_stride)
          for (int g = 0; g < G; ++g) part[g][j] = qr[g].dot(krow);
        __m512 acc[G][V];
        for (int g = 0; g < G; ++g) {
          for (int j = n_r; j < kChunk; ++j) part[g][j] = _mm512_setzero_ps();
          __m512 s = _mm512_mul_ps(hsum16(part[g]), scale);
          s = _mm512_mask_blend_ps(valid, neg_inf, s);
          const float m_new = std::max(m[g], _mm512_reduce_max_ps(s));
          const __m512 p =
              _mm512_maskz_mov_ps(valid, exp_neg(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
          _mm512_store_ps(probs[g], p);
          for (int i = 0; i < V; ++i) acc[g][i] = _mm512_loadu_ps(acc_mem + g * D + 16 * i);
          if (m_new != m[g]) {
            const float corr = std::exp(m[g] - m_new);
            const __m512 c = _mm512_set1_ps(corr);
            for (int i = 0; i < V; ++i) acc[g][i] = _mm512_mul_ps(acc[g][i], c);
            l[g] *= corr;
            m[g] = m_new;
          }
          if constexpr (!kPairs) l[g] += _mm512_reduce_add_ps(p);
        }
        const T* vrow = vc + (first * hkv + h) * D;
#ifdef __AVX512BF16__
        if constexpr (kPairs) {
          float sums[G];
          accumulate_v_pairs<D, G>(acc, probs, sums, vrow, n_r, row_stride);
          for (int g = 0; g < G; ++g) l[g] += sums[g];
        } else
#endif
        {
          accumulate_v<T, D, G>(acc, probs, vrow, n_r, row_stride);
        }
        for (int g = 0; g < G; ++g)
          for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc_mem + g * D + 16 * i, acc[g][i]);
      }
    }
    t0 += n;
  }
#ifdef __AVX512BF16__
  if constexpr (kPairs)
    for (int r = 0; r < sp.rows; ++r)
      for (int64_t h = 0; h < hkv; ++h)
        for (int g = 0; g < G; ++g)
          unpermute<D>(state_span + (r * hkv + h) * head_step + g * D);
#endif
}

#endif  // DEEPINFER_AVX512

#ifdef DEEPINFER_AVX512
template <typename T, int D>
AttendFn<T> pick_group(int64_t group) {
  switch (group) {
    case 1: return attend_avx512<T, D, 1>;
    case 2: return attend_avx512<T, D, 2>;
    case 3: return attend_avx512<T, D, 3>;
    case 4: return attend_avx512<T, D, 4>;
    case 5: return attend_avx512<T, D, 5>;
    case 6: return attend_avx512<T, D, 6>;
    case 7: return attend_avx512<T, D, 7>;
    case 8: return attend_avx512<T, D, 8>;
    default: return nullptr;
  }
}
#endif

// The vector kernel for head_dim 64 / 128 and up to 8 query heads per KV head, else scalar.
template <typename T>
AttendFn<T> pick_kernel(int64_t dim, int64_t group) {
  AttendFn<T> fn = nullptr;
#ifdef DEEPINFER_AVX512
  if (dim == 64) fn = pick_group<T, 64>(group);
  if (dim == 128) fn = pick_group<T, 128>(group);
#endif
  return fn != nullptr ? fn : attend_generic<T>;
}

inline void store_out(float x, float* p) { *p = x; }
inline void store_out(float x, at::BFloat16* p) { *p = at::BFloat16(x); }

// out[g] = sum over pieces of e^(m_s - m) acc_s / sum of e^(m_s - m) l_s, for the `pieces`
// states of one (sequence, KV head), `stride` floats apart.
constexpr int64_t kMaxPieces = 64;

// out[g] = sum over pieces of e^(m_s - m) acc_s / sum of e^(m_s - m) l_s, for the `pieces`
// (<= kMaxPieces) states of one (sequence, KV head), `stride` floats apart.
template <typename T>
void merge(const float* st, int64_t pieces, int64_t stride, int64_t G, int64_t D, T* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float w[kMaxPieces];
  for (int64_t g = 0; g < G; ++g) {
    float m = kNegInf;
    for (int64_t s = 0; s < pieces; ++s) m = std::max(m, st[s * stride + G * D + g]);
    float l = 0.f;
    for (int64_t s = 0; s < pieces; ++s) {
      const float ms = st[s * stride + G * D + g];
      w[s] = ms == kNegInf ? 0.f : std::exp(ms - m);  // an empty piece weighs nothing
      l += w[s] * st[s * stride + G * (D + 1) + g];
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* dst = out + g * D;
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.f;
      for (int64_t s = 0; s < pieces; ++s) acc += w[s] * st[s * stride + g * D + d];
      store_out(acc * inv, dst + d);
    }
  }
}

// Spans of consecutive rows that may read one table: every row's blocks are the first ones of
// the span's longest row (a request's verify rows; rows of requests that share their whole
// context too, which is as correct). At most kMaxRows rows a span.
constexpr int kMaxRows = 16;

std::vector<Span> find_spans(const Problem& pb, int64_t batch) {
  const int64_t bs = pb.block_size;
  auto blocks = [&](int64_t b) { return (pb.lens[b] + bs - 1) / bs; };
  auto table = [&](int64_t b) { return pb.tables + b * pb.max_blocks; };
  std::vector<Span> spans;
  int64_t b = 0;
  while (b < batch) {
    int64_t longest = b, e = b + 1;
    for (; e < batch && e - b < kMaxRows; ++e) {
      const int64_t common = std::min(blocks(e), blocks(longest));
      if (!std::equal(table(e), table(e) + common, table(longest))) break;
      if (pb.lens[e] > pb.lens[longest]) longest = e;
    }
    spans.push_back(Span{b, static_cast<int>(e - b), table(longest)});
    b = e;
  }
  return spans;
}

template <typename T>
void run(const Problem& pb, const T* q, const T* kc, const T* vc, T* o, int64_t batch,
         int64_t splits, bool use_generic, const std::vector<Span>& spans) {
  const int64_t G = pb.group, D = pb.dim, hkv = pb.hkv, bs = pb.block_size;
  const AttendFn<T> attend = use_generic ? attend_generic<T> : pick_kernel<T>(D, G);
  // state of (b, h, s) at ((b * hkv + h) * splits + s) * stride
  const int64_t stride = G * (D + 2);
  std::vector<float> states(batch * hkv * splits * stride);
  const int64_t num_spans = static_cast<int64_t>(spans.size());
  at::parallel_for(0, num_spans * splits, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const Span& sp = spans[task / splits];
      const int64_t s = task % splits;
      int64_t len = 0;  // the span's longest row
      for (int r = 0; r < sp.rows; ++r) len = std::max(len, pb.lens[sp.first + r]);
      const int64_t per = ((len + bs - 1) / bs + splits - 1) / splits;  // blocks per piece
      const int64_t begin = std::min(len, s * per * bs), end = std::min(len, (s + 1) * per * bs);
      float* state = states.data() + (sp.first * hkv * splits + s) * stride;
      for (int r = 0; r < sp.rows; ++r)
        for (int64_t h = 0; h < hkv; ++h) {
          float* st = state + (r * hkv + h) * splits * stride;
          std::fill(st, st + G * D, 0.f);
          std::fill(st + G * D, st + G * (D + 1), -std::numeric_limits<float>::infinity());
          std::fill(st + G * (D + 1), st + stride, 0.f);
        }
      if (begin < end)
        attend(pb, sp, q + sp.first * hkv * G * D, kc, vc, begin, end, state, splits * stride);
      if (splits == 1)  // the only piece: normalise now
        for (int r = 0; r < sp.rows; ++r)
          for (int64_t h = 0; h < hkv; ++h)
            merge(state + (r * hkv + h) * stride, 1, stride, G, D,
                  o + ((sp.first + r) * hkv + h) * G * D);
    }
  });
  if (splits == 1) return;
  at::parallel_for(0, batch * hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh)
      merge(states.data() + bh * splits * stride, splits, stride, G, D, o + bh * G * D);
  });
}

// How many pieces to cut each context into: enough tasks to keep every thread busy when the
// batch is small, never pieces under `min_blocks` blocks.
int64_t choose_splits(int64_t tasks, int64_t max_blocks, int64_t min_blocks) {
  const int64_t threads = at::get_num_threads();
  const int64_t want = 4 * threads;
  if (tasks >= want || max_blocks < 2 * min_blocks) return 1;
  const int64_t by_tasks = (want + tasks - 1) / tasks;
  return std::max<int64_t>(1, std::min(by_tasks, max_blocks / min_blocks));
}

}  // namespace

// q [B, Hq, D]; k_cache, v_cache [slots, Hkv, D]; block_tables [B, max_blocks] (int64);
// context_lens [B] (int64, each >= 1). splits <= 0: chosen from the batch and threads.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache,
                                     at::Tensor v_cache, at::Tensor block_tables,
                                     at::Tensor context_lens, double scale, int64_t block_size,
                                     int64_t splits, bool generic) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k and v caches differ in shape");
  const int64_t batch = q.size(0), hq = q.size(1), dim = q.size(2);
  const int64_t hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim, "head_dim differs between q and the cache");
  TORCH_CHECK(hq % hkv == 0 && hq / hkv <= kMaxGroup, "unsupported GQA ratio");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch, "bad block table");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == batch, "bad context lengths");
  q = q.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  auto out = at::empty_like(q);
  if (batch == 0) return out;
  const int64_t max_blocks = tables.size(1);
  {
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t* tp = tables.data_ptr<int64_t>();
    const int64_t pool = k_cache.size(0) / block_size;
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * block_size, "context length out of range");
      for (int64_t i = 0; i < (lp[b] + block_size - 1) / block_size; ++i)
        TORCH_CHECK(tp[b * max_blocks + i] >= 0 && tp[b * max_blocks + i] < pool,
                    "block id out of range");
    }
  }
  Problem pb{hkv, hq / hkv, dim, block_size, max_blocks, static_cast<float>(scale),
             tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>()};
  const std::vector<Span> spans = find_spans(pb, batch);
  if (splits <= 0)
    splits = choose_splits(static_cast<int64_t>(spans.size()), max_blocks, 64 / block_size + 1);
  splits = std::min(splits, kMaxPieces);
  if (q.scalar_type() == at::kFloat) {
    run<float>(pb, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
               out.data_ptr<float>(), batch, splits, generic, spans);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    run<at::BFloat16>(pb, q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                      v_cache.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), batch,
                      splits, generic, spans);
  }
  return out;
}

// The schema and the shape-only implementation are defined in kernels/paged_attention_cpu.py.
TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
