// deepinfer::packed_linear on a CPU: F.linear on the copy of the weight that oneDNN packed at
// load, found here by the weight's storage, shape and strides (no Python in a call: ~5 us a
// call less, 121 calls a step of SmolLM2-135M), packed again if the weight was written in
// place. Up to `small_rows` rows go to the plain weight instead (bf16: small_linear; fp32:
// at::linear). A bf16 weight may be packed widened to fp32, for CPUs without bf16 arithmetic,
// where oneDNN's bf16 GEMM is emulated (2.0x slower than its fp32 one at 16 rows, 2.8x at 64
// on Ice Lake): the rows are widened and the output rounded to bf16, the same sums of the same
// values.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias);  // csrc/small_linear.cpp

namespace {

struct Key {
  int64_t ptr, n, k, s0, s1;
  bool operator==(const Key& o) const {
    return ptr == o.ptr && n == o.n && k == o.k && s0 == o.s0 && s1 == o.s1;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = std::hash<int64_t>()(key.ptr);
    for (int64_t v : {key.n, key.k, key.s0, key.s1}) h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

struct Packed {
  at::Tensor packed;   // oneDNN's copy of the weight, in fp32 if `widened`
  int64_t version;     // the weight's version counter when packed
  int64_t pack_rows;   // the rows oneDNN was told to expect
  int64_t small_rows;  // up to this many rows run on the plain weight (0: none)
  bool widened;
};

std::mutex mu;
std::unordered_map<Key, Packed, KeyHash> table;

Key key_of(const at::Tensor& w) {
  return {reinterpret_cast<int64_t>(w.data_ptr()), w.size(0), w.size(1), w.stride(0), w.stride(1)};
}

at::Tensor reorder(const at::Tensor& weight, int64_t rows, bool widen) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  torch::jit::Stack stack{widen ? weight.to(at::kFloat).contiguous() : weight.contiguous(), rows};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor onednn_linear(const at::Tensor& rows, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{rows, packed, bias, std::string("none"),
                          c10::List<c10::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

void pack(const at::Tensor& weight, int64_t pack_rows, int64_t small_rows, bool widen) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "a 2-d CPU weight");
  TORCH_CHECK(!widen || weight.scalar_type() == at::kBFloat16, "only bf16 weights are widened");
  TORCH_CHECK(small_rows == 0 || weight.scalar_type() == at::kFloat ||
                  weight.scalar_type() == at::kBFloat16,
              "small rows need a bf16 or fp32 weight");
  at::NoGradGuard no_grad;
  Packed entry{reorder(weight, pack_rows, widen), weight._version(), pack_rows, small_rows,
               widen};
  std::lock_guard<std::mutex> hold(mu);
  table[key_of(weight)] = std::move(entry);
}

void forget(int64_t ptr, int64_t n, int64_t k, int64_t s0, int64_t s1) {
  std::lock_guard<std::mutex> hold(mu);
  table.erase(Key{ptr, n, k, s0, s1});
}

}  // namespace

// x [..., K] times weight [N, K] (+ bias) -> [..., N]; a weight `pack` never saw, or x of
// another dtype than the weight's: at::linear.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias) {
  if (weight.dim() != 2 || x.scalar_type() != weight.scalar_type()) {
    return at::linear(x, weight, bias);
  }
  at::Tensor packed;
  int64_t small_rows = 0;
  bool widened = false;
  {
    std::lock_guard<std::mutex> hold(mu);
    auto it = table.find(key_of(weight));
    if (it == table.end()) return at::linear(x, weight, bias);
    if (it->second.version != weight._version()) {  // written since it was packed
      at::NoGradGuard no_grad;
      it->second.packed = reorder(weight, it->second.pack_rows, it->second.widened);
      it->second.version = weight._version();
    }
    packed = it->second.packed;
    small_rows = it->second.small_rows;
    widened = it->second.widened;
  }
  auto sizes = x.sizes().vec();
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  sizes.back() = weight.size(0);
  if (rows.size(0) >= 1 && rows.size(0) <= small_rows) {
    if (weight.scalar_type() == at::kBFloat16) return small_linear(rows, weight, bias).view(sizes);
    return at::linear(rows, weight, bias).view(sizes);
  }
  if (widened) {
    c10::optional<at::Tensor> wide_bias;
    if (bias.has_value() && bias->defined()) wide_bias = bias->to(at::kFloat);
    return onednn_linear(rows.to(at::kFloat), packed, wide_bias).to(x.scalar_type()).view(sizes);
  }
  return onednn_linear(rows, packed, bias).view(sizes);
}

// packed_linear's schema and shape-only implementation are in kernels/packed_linear.py; the
// table's two ops have no tensor to dispatch on, hence catch-all kernels defined here.
TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("packed_linear_pack(Tensor weight, int pack_rows, int small_rows, bool widen) -> ()",
        &pack);
  m.def("packed_linear_forget(int ptr, int n, int k, int s0, int s1) -> ()", &forget);
}
TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("packed_linear", &packed_linear); }
