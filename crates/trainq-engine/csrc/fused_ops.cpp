// Autograd functions for the decoder layer's fused elementwise work (tch has no custom autograd
// functions): libtorch records each as one node of the graph, and its forward and backward call
// the CUDA kernels that trainq's Rust side compiles with NVRTC and launches
// (crates/trainq-engine/src/kernels/fused.rs), registered once through
// trainq_fused_register. Tensors cross the boundary as at::Tensor*, tch's own representation;
// errors come back as a malloc'd string (trainq_free_message, in offload.cpp).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "guarded.h"

namespace {

// Mirrors kernels::fused::QkvArgs (repr(C)).
struct QkvArgs {
  int64_t device;
  uint64_t qkv, q_weight, k_weight, cos, sin, rstd, q, k, v, dqkv, q_weight_partial, k_weight_partial;
  int64_t n;
  int32_t heads, kv_heads, head_dim;
  float eps;
};

// Mirrors kernels::fused::SwiGluArgs.
struct SwiGluArgs {
  int64_t device;
  uint64_t gate_up, out, grad_gate_up;
  int64_t n, intermediate;
};

// Mirrors kernels::fused::AddNormArgs.
struct AddNormArgs {
  int64_t device;
  uint64_t x, h, weight, s, n, rstd, ds, dn, d, weight_partial;
  int64_t rows;
  int32_t width;
  float eps;
};

// Mirrors kernels::fused::FusedLaunchers.
struct Launchers {
  int (*qkv_forward)(const QkvArgs*, char*, size_t);
  int (*qkv_backward)(const QkvArgs*, char*, size_t);
  int (*swiglu_forward)(const SwiGluArgs*, char*, size_t);
  int (*swiglu_backward)(const SwiGluArgs*, char*, size_t);
  int (*add_norm_forward)(const AddNormArgs*, char*, size_t);
  int (*add_norm_backward)(const AddNormArgs*, char*, size_t);
};

Launchers launchers{};
// Blocks of the q/k/v backward kernel: rows of the norm weights' partial gradient sums.
int64_t norm_grad_blocks = 0;

template <typename Args>
void run(int (*launch)(const Args*, char*, size_t), const Args& args) {
  if (launch == nullptr) throw std::runtime_error("fused kernels are not registered");
  char message[512] = {0};
  if (launch(&args, message, sizeof(message)) != 0) throw std::runtime_error(message);
}

// Optional inputs of the autograd functions are passed as empty placeholder tensors (libtorch's
// C++ Function::apply cannot take undefined ones, and std::optional inputs would shift the
// indices of needs_input_grad); `present` tells them apart.
bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

uint64_t address(const at::Tensor& t) { return present(t) ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0; }

// The kernels read and write 16 bytes at a time: `t` itself when its data is 16-byte aligned
// (fresh allocations are), else an aligned copy (a parameter viewed inside a flat buffer can sit
// at any offset). Only used for tensors the kernels read.
at::Tensor aligned(const at::Tensor& t) {
  if (!present(t) || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  return t.clone();
}

// q/k RMSNorm per head and RoPE, from the fused projection's output.
class QkvNormRope : public torch::autograd::Function<QkvNormRope> {
 public:
  // qkv (N, (H + 2·KV)·D); q_weight, k_weight (D) or empty; cos, sin (N, D) or empty.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv,
                                                const at::Tensor& q_weight, const at::Tensor& k_weight,
                                                const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                                int64_t kv_heads, double eps) {
    auto n = qkv.size(0);
    auto d = qkv.size(1) / (heads + 2 * kv_heads);
    auto q = at::empty({n, heads, d}, qkv.options());
    auto k = at::empty({n, kv_heads, d}, qkv.options());
    // v is the projection's own v columns, a view (N, KV, D) with rows T·D apart: the kernel
    // leaves it alone, and attention saves no copy of it (the output is kept for backward).
    auto v = qkv.narrow(1, (heads + kv_heads) * d, kv_heads * d).view({n, kv_heads, d});
    auto rstd = at::empty({n, heads + kv_heads}, qkv.options().dtype(at::kFloat));
    auto qkv_in = aligned(qkv), qw = aligned(q_weight), kw = aligned(k_weight), c = aligned(cos), s = aligned(sin);
    QkvArgs args{qkv.device().index(), address(qkv_in), address(qw), address(kw), address(c),
                 address(s), address(rstd), address(q), address(k), 0, 0, 0, 0, n,
                 static_cast<int32_t>(heads), static_cast<int32_t>(kv_heads), static_cast<int32_t>(d),
                 static_cast<float>(eps)};
    run(launchers.qkv_forward, args);
    ctx->save_for_backward({qkv, q_weight, k_weight, cos, sin});
    ctx->saved_data["rstd"] = rstd;
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["kv_heads"] = kv_heads;
    return {q, k, v};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto &qkv = saved[0], &q_weight = saved[1], &k_weight = saved[2], &cos = saved[3], &sin = saved[4];
    auto rstd = ctx->saved_data["rstd"].toTensor();
    auto heads = ctx->saved_data["heads"].toInt();
    auto kv_heads = ctx->saved_data["kv_heads"].toInt();
    auto n = qkv.size(0);
    auto d = qkv.size(1) / (heads + 2 * kv_heads);
    auto grad = [&](size_t i, int64_t h) {
      return grads[i].defined() ? grads[i].contiguous() : at::zeros({n, h, d}, qkv.options());
    };
    auto dq = aligned(grad(0, heads)), dk = aligned(grad(1, kv_heads)), dv = aligned(grad(2, kv_heads));
    auto qkv_in = aligned(qkv), qw = aligned(q_weight), kw = aligned(k_weight), c = aligned(cos), s = aligned(sin);
    auto dqkv = at::empty_like(qkv);
    bool q_trains = present(q_weight) && ctx->needs_input_grad(1);
    bool k_trains = present(k_weight) && ctx->needs_input_grad(2);
    auto partial_options = qkv.options().dtype(at::kFloat);
    auto q_part = q_trains ? at::empty({norm_grad_blocks, d}, partial_options) : at::Tensor();
    auto k_part = k_trains ? at::empty({norm_grad_blocks, d}, partial_options) : at::Tensor();
    QkvArgs args{qkv.device().index(), address(qkv_in), address(qw), address(kw), address(c),
                 address(s), address(rstd), address(dq), address(dk), address(dv), address(dqkv),
                 address(q_part), address(k_part), n, static_cast<int32_t>(heads),
                 static_cast<int32_t>(kv_heads), static_cast<int32_t>(d), 0.0f};
    run(launchers.qkv_backward, args);
    auto dqw = q_trains ? q_part.sum(0).to(q_weight.scalar_type()) : at::Tensor();
    auto dkw = k_trains ? k_part.sum(0).to(k_weight.scalar_type()) : at::Tensor();
    return {dqkv, dqw, dkw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor swiglu_forward(const at::Tensor& gate_up_in) {
  auto gate_up = aligned(gate_up_in);
  auto n = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({n, inter}, gate_up.options());
  SwiGluArgs args{gate_up.device().index(), address(gate_up), address(out), 0, n, inter};
  run(launchers.swiglu_forward, args);
  return out;
}

at::Tensor swiglu_backward(const at::Tensor& gate_up_in, const at::Tensor& dout_in) {
  auto gate_up = aligned(gate_up_in), dout = aligned(dout_in);
  auto dgu = at::empty_like(gate_up);
  SwiGluArgs args{gate_up.device().index(), address(gate_up), address(dout), address(dgu), gate_up.size(0),
                  gate_up.size(1) / 2};
  run(launchers.swiglu_backward, args);
  return dgu;
}

// scale · (m1 m2) as one GEMM: cuBLAS's alpha, with beta 0 so the uninitialized output is never
// read (no separate pass to scale the product).
at::Tensor scaled_mm(const at::Tensor& m1, const at::Tensor& m2, double scale) {
  return at::empty({m1.size(0), m2.size(1)}, m1.options()).addmm_(m1, m2, /*beta=*/0, /*alpha=*/scale);
}

// y = x Wᵀ + b + s · (x Aᵀ) Bᵀ for x (rows, in), with A (k, in) and B (out, k) empty when there
// is no adapter. Returns y and the scaled low-rank s · x Aᵀ (undefined without adapter). The
// adapter's term rides in the base GEMM, [x, s·x Aᵀ] [W, B]ᵀ, when that moves fewer bytes than
// adding it by a second GEMM's epilogue.
std::pair<at::Tensor, at::Tensor> project_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                                  const at::Tensor& a, const at::Tensor& b, double scale) {
  if (!present(a)) return {present(bias) ? at::addmm(bias, x, weight.t()) : at::mm(x, weight.t()), at::Tensor()};
  auto low = scaled_mm(x, a.t(), scale);
  // Append the low-rank columns to the input and B to the weight, one GEMM (K grows by k),
  // when the output is wider than the input and the weight smaller than the output (its copy
  // costs less than a second pass over the output): q/k/v and gate/up at thousands of rows,
  // not o/down, nor a big model's few rows. (H200: 0.6b LoRA 4×4096 −6.6 ms a step; qwen3-32b
  // 1×8192 3% faster than folding gate/up alone.)
  auto rows = x.size(0), in = weight.size(1), out = weight.size(0);
  bool fold = out > in && in < rows;
  auto input = fold ? at::cat({x, low}, 1) : x;
  auto w = fold ? at::cat({weight, b}, 1) : weight;
  auto y = present(bias) ? at::addmm(bias, input, w.t()) : at::mm(input, w.t());
  if (!fold) y.addmm_(low, b.t());
  return {y, low};
}

// Gradients of project_forward for upstream dy (rows, out): {dx, dW, db, dA, dB}, each computed
// only when `needed` says so. dx = dy W + s · (dy B) A: the adapter's part either rides in the
// base GEMM ([dy, s·dy B] [W; A]) or is added by the epilogue of its own GEMM.
std::vector<at::Tensor> project_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                         const at::Tensor& a, const at::Tensor& b, const at::Tensor& low,
                                         double scale, const std::array<bool, 5>& needed) {
  at::Tensor dx, dw, db, da, dbb, dlow;
  bool adapter = present(a);
  if (adapter && (needed[0] || needed[3])) dlow = scaled_mm(dy, b, scale);
  if (needed[0]) {
    // Narrow outputs (o, down: out < in): append dlow to dy and A to W, one GEMM whose K grows
    // by k, when copying dy and W moves fewer bytes than the second GEMM's read and write of dx.
    // Wide outputs (q/k/v, gate/up) keep the in-place epilogue.
    auto rows = dy.size(0), out = weight.size(0), in = weight.size(1);
    bool fold = adapter && out * in + rows * out < 2 * rows * in;
    if (fold) {
      dx = at::mm(at::cat({dy, dlow}, 1), at::cat({weight, a}, 0));
    } else {
      dx = at::mm(dy, weight);
      if (adapter) dx.addmm_(dlow, a);
    }
  }
  if (needed[1]) dw = at::mm(dy.t(), x);
  if (needed[2]) db = dy.sum(0);
  if (adapter && needed[3]) da = at::mm(dlow.t(), x);
  if (adapter && needed[4]) dbb = at::mm(dy.t(), low);
  return {dx, dw, db, da, dbb};
}

std::array<bool, 5> needed_grads(torch::autograd::AutogradContext* ctx) {
  return {ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2), ctx->needs_input_grad(3),
          ctx->needs_input_grad(4)};
}

// What a projection reads (`trainq_projection`'s `input`): x as it is, or silu(gate) · up of the
// fused gate/up output x — computed again in the backward (only gate/up kept: (rows, I) less
// activation memory a layer) or kept from the forward (one elementwise pass a layer less).
enum ProjectionInput : int64_t { kPlain = 0, kSwiGluRecomputed = 1, kSwiGluKept = 2 };

// A linear projection with an optional LoRA adapter (A, B already stacked by the caller), reading
// x or silu(gate) · up of it as `input` (a ProjectionInput) says.
class Projection : public torch::autograd::Function<Projection> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, double scale,
                            int64_t input) {
    auto read = input == kPlain ? x : swiglu_forward(x);
    auto [y, low] = project_forward(read, weight, bias, a, b, scale);
    ctx->save_for_backward({x, weight, a, b, low, input == kSwiGluKept ? read : at::Tensor()});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["input"] = input;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto& x = saved[0];
    auto input = ctx->saved_data["input"].toInt();
    auto needed = needed_grads(ctx);
    // The projection's input, for dW and dA: x itself, the kept silu(gate) · up, or it again.
    auto read = input == kPlain            ? x
                : input == kSwiGluKept     ? saved[5]
                : needed[1] || needed[3]   ? swiglu_forward(x)
                                           : at::Tensor();
    auto g = project_backward(grads[0].contiguous(), read, saved[1], saved[2], saved[3], saved[4],
                              ctx->saved_data["scale"].toDouble(), needed);
    auto dx = input != kPlain && needed[0] ? swiglu_backward(x, g[0]) : g[0];
    return {dx, g[1], g[2], g[3], g[4], at::Tensor(), at::Tensor()};
  }
};

// silu(gate) · up from the fused gate/up projection's output.
class SwiGlu : public torch::autograd::Function<SwiGlu> {
 public:
  // gate_up (N, 2I) -> (N, I)
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up) {
    ctx->save_for_backward({gate_up});
    return swiglu_forward(gate_up);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {swiglu_backward(ctx->get_saved_variables()[0], grads[0].contiguous())};
  }
};

// A residual add and the RMSNorm after it (post-attention, next layer's input, final): s = x + h,
// n = RMSNorm(s)·w.
// Keeps s and the per-row 1/RMS; the backward returns one gradient, ds + the norm's, for both x
// and h (autograd's sum of the residual and norm paths happens in the kernel).
class AddRmsNorm : public torch::autograd::Function<AddRmsNorm> {
 public:
  // x, h (rows, W); weight (W) -> {s, n}
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& h, const at::Tensor& weight, double eps) {
    auto rows = x.size(0), width = x.size(1);
    auto s = at::empty_like(x), n = at::empty_like(x);
    auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    auto xi = aligned(x), hi = aligned(h), w = aligned(weight);
    AddNormArgs args{x.device().index(), address(xi), address(hi), address(w), address(s), address(n),
                     address(rstd), 0, 0, 0, 0, rows, static_cast<int32_t>(width), static_cast<float>(eps)};
    run(launchers.add_norm_forward, args);
    ctx->save_for_backward({s, weight});
    ctx->saved_data["rstd"] = rstd;
    return {s, n};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto &s = saved[0], &weight = saved[1];
    auto rows = s.size(0), width = s.size(1);
    auto ds = grads[0].defined() ? aligned(grads[0].contiguous()) : at::Tensor();
    if (!grads[1].defined()) {
      auto d = ds.defined() ? ds : at::zeros_like(s);
      return {d, d, at::Tensor(), at::Tensor()};
    }
    auto dn = aligned(grads[1].contiguous());
    auto d = at::empty_like(s);
    bool weight_trains = ctx->needs_input_grad(2);
    auto part = weight_trains ? at::empty({norm_grad_blocks, width}, s.options().dtype(at::kFloat)) : at::Tensor();
    auto w = aligned(weight);
    auto rstd = ctx->saved_data["rstd"].toTensor();
    AddNormArgs args{s.device().index(), 0, 0, address(w), address(s), 0, address(rstd), address(ds), address(dn),
                     address(d), address(part), rows, static_cast<int32_t>(width), 0.0f};
    run(launchers.add_norm_backward, args);
    auto dw = weight_trains ? part.sum(0).to(weight.scalar_type()) : at::Tensor();
    return {d, d, dw, at::Tensor()};
  }
};

bool usable(const at::Tensor& t) {
  return t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 2;
}

// `*t`, or an empty placeholder on `like`'s device for an absent input.
at::Tensor optional(const at::Tensor* t, const at::Tensor& like) {
  return t == nullptr ? at::empty({0}, like.options()) : *t;
}

}  // namespace

extern "C" {

// Registers the Rust launchers (and the backward kernel's block count) once per process.
void trainq_fused_register(const Launchers* table, int64_t blocks) {
  launchers = *table;
  norm_grad_blocks = blocks;
}

// qkv (N, (H + 2·KV)·D) bf16 contiguous on CUDA; q_weight / k_weight (D) or null; cos / sin
// (N, D) bf16 contiguous or null (no RoPE). Writes q (N, H, D) and k (N, KV, D), and v (N, KV, D)
// as a view of qkv's v columns.
char* trainq_qkv_norm_rope(const at::Tensor* qkv, const at::Tensor* q_weight, const at::Tensor* k_weight,
                           const at::Tensor* cos, const at::Tensor* sin, int64_t heads, int64_t kv_heads,
                           double eps, at::Tensor** q, at::Tensor** k, at::Tensor** v) {
  return guarded([&] {
    if (!usable(*qkv)) throw std::runtime_error("qkv must be a contiguous 2-d bf16 CUDA tensor");
    auto out = QkvNormRope::apply(*qkv, optional(q_weight, *qkv), optional(k_weight, *qkv), optional(cos, *qkv),
                                  optional(sin, *qkv), heads, kv_heads, eps);
    *q = new at::Tensor(std::move(out[0]));
    *k = new at::Tensor(std::move(out[1]));
    *v = new at::Tensor(std::move(out[2]));
  });
}

// x, h (rows, W) bf16 contiguous on CUDA, weight (W) -> s = x + h and n = RMSNorm(s) · weight.
char* trainq_add_rms_norm(const at::Tensor* x, const at::Tensor* h, const at::Tensor* weight, double eps,
                          at::Tensor** s, at::Tensor** n) {
  return guarded([&] {
    if (!usable(*x) || !usable(*h) || x->sizes() != h->sizes())
      throw std::runtime_error("x and h must be contiguous 2-d bf16 CUDA tensors of one shape");
    auto out = AddRmsNorm::apply(*x, *h, *weight, eps);
    *s = new at::Tensor(std::move(out[0]));
    *n = new at::Tensor(std::move(out[1]));
  });
}

// gate_up (N, 2I) bf16 contiguous on CUDA -> silu(gate) · up (N, I).
char* trainq_swiglu(const at::Tensor* gate_up, at::Tensor** out) {
  return guarded([&] {
    if (!usable(*gate_up)) throw std::runtime_error("gate_up must be a contiguous 2-d bf16 CUDA tensor");
    *out = new at::Tensor(SwiGlu::apply(*gate_up));
  });
}

// x (rows, in) -> x Wᵀ + b + s · (x Aᵀ) Bᵀ (rows, out); bias, a and b may be null (a and b
// together). `input` is a ProjectionInput: with either SwiGLU value, x is the fused gate/up
// output (rows, 2·in) and the projection reads silu(gate) · up.
char* trainq_projection(const at::Tensor* x, const at::Tensor* weight, const at::Tensor* bias, const at::Tensor* a,
                        const at::Tensor* b, double scale, int input, at::Tensor** out) {
  return guarded([&] {
    if (!usable(*x)) throw std::runtime_error("the projection's input must be a contiguous 2-d bf16 CUDA tensor");
    if ((a == nullptr) != (b == nullptr)) throw std::runtime_error("an adapter needs both A and B");
    if (input < kPlain || input > kSwiGluKept) throw std::runtime_error("unknown projection input " + std::to_string(input));
    *out = new at::Tensor(Projection::apply(*x, *weight, optional(bias, *x), optional(a, *x), optional(b, *x), scale,
                                            static_cast<int64_t>(input)));
  });
}

}  // extern "C"
