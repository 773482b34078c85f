// Sampling of one token per row on CPU from weights e^(x - max x) (x: logits / temperature):
// top-k and top-p by a partial sort that grows only as far as the cut, min-p, then the inverse
// CDF of the kept weights (in token id order) at one uniform draw per row.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// p: one row's weights e^(x - max x) (the most likely token weighs 1), total: their sum;
// order: scratch.
int64_t sample_row(const float* p, float total, int64_t vocab, int64_t top_k, float top_p,
                   float min_p, float u, std::vector<int64_t>& order) {
  const bool limit = top_k < vocab || top_p < 1.f;
  int64_t kept = vocab;  // with `limit`: order[0, kept) are the kept tokens
  if (limit) {
    const int64_t k = std::min(top_k, vocab);
    std::iota(order.begin(), order.end(), 0);
    auto more = [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
    // sort a prefix, growing it until it holds the top-p cut (or all of top-k)
    int64_t sorted = 0;
    int64_t c = std::min<int64_t>(k, 64);
    // in float32 as torch's sort, softmax, cumsum - probs: the same cut at a tie with top_p
    float cum = 0.f;  // probability mass up to position i
    kept = -1;
    while (kept < 0) {
      if (c < vocab) std::nth_element(order.begin() + sorted, order.begin() + c, order.end(), more);
      std::sort(order.begin() + sorted, order.begin() + c, more);
      for (int64_t i = sorted; i < c; ++i) {
        const float prob = p[order[i]] / total;
        cum += prob;
        if (cum - prob >= top_p) {
          kept = i;
          break;
        }
      }
      sorted = c;
      if (kept < 0 && c == k) kept = k;
      c = std::min(k, 4 * c);
    }
    kept = std::max<int64_t>(kept, 1);
    std::sort(order.begin(), order.begin() + kept);  // the draw walks tokens in id order
  }
  // min-p: the most likely token has p = 1 here, so keep p >= min_p
  double mass = 0.0;
  for (int64_t i = 0; i < kept; ++i) {
    const int64_t id = limit ? order[i] : i;
    if (p[id] >= min_p) mass += p[id];
  }
  const double target = static_cast<double>(u) * mass;
  double acc = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < kept; ++i) {
    const int64_t id = limit ? order[i] : i;
    if (p[id] < min_p) continue;
    acc += p[id];
    last = id;
    if (acc > target) return id;
  }
  return last;  // u * mass rounded up to the whole mass
}

// weights [S, V] float32 (each row's largest = 1), totals [S] their row sums; top_k [S] int64
// (V = off); top_p, min_p, u [S] float32, u in [0, 1) -> [S] int64.
at::Tensor sample_rows(const at::Tensor& weights_in, const at::Tensor& totals_in,
                       const at::Tensor& top_k_in,
                       const at::Tensor& top_p_in, const at::Tensor& min_p_in,
                       const at::Tensor& u_in) {
  TORCH_CHECK(weights_in.dim() == 2 && weights_in.scalar_type() == at::kFloat,
              "weights must be [S, V] float32");
  const auto weights = weights_in.contiguous();
  const auto totals = totals_in.to(at::kFloat).contiguous();
  const auto top_k = top_k_in.to(at::kLong).contiguous();
  const auto top_p = top_p_in.to(at::kFloat).contiguous();
  const auto min_p = min_p_in.to(at::kFloat).contiguous();
  const auto u = u_in.to(at::kFloat).contiguous();
  const int64_t rows = weights.size(0), vocab = weights.size(1);
  for (const at::Tensor* t : {&totals, &top_k, &top_p, &min_p, &u})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows, "one parameter per row");
  auto out = at::empty({rows}, weights.options().dtype(at::kLong));
  const float* wp = weights.data_ptr<float>();
  const float* sp = totals.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float* pp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> order(vocab);
    for (int64_t r = lo; r < hi; ++r)
      op[r] = sample_row(wp + r * vocab, sp[r], vocab, kp[r], pp[r], mp[r], up[r], order);
  });
  return out;
}

}  // namespace

// The schema and the shape-only implementation are defined in kernels/sampling_cpu.py.
TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("sample_rows", &sample_rows); }
