// Autograd functions for the decoder layer's fused elementwise work (tch has no custom autograd
// functions): libtorch records each as one node of the graph, and its forward and backward call
// the CUDA kernels that trainq's Rust side compiles with NVRTC and launches
// (crates/trainq-engine/src/kernels/fused.rs), registered once through
// trainq_fused_register. Tensors cross the boundary as at::Tensor*, tch's own representation;
// errors come back as a malloc'd string (trainq_free_message, in offload.cpp).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

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

// Mirrors kernels::fused::FusedLaunchers.
struct Launchers {
  int (*qkv_forward)(const QkvArgs*, char*, size_t);
  int (*qkv_backward)(const QkvArgs*, char*, size_t);
  int (*swiglu_forward)(const SwiGluArgs*, char*, size_t);
  int (*swiglu_backward)(const SwiGluArgs*, char*, size_t);
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

uint64_t address(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
}

// q/k RMSNorm per head and RoPE, from the fused projection's output.
class QkvNormRope : public torch::autograd::Function<QkvNormRope> {
 public:
  // qkv (N, (H + 2·KV)·D); q_weight, k_weight (D) or undefined; cos, sin (N, D) or undefined.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv,
                                                const at::Tensor& q_weight, const at::Tensor& k_weight,
                                                const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                                int64_t kv_heads, double eps) {
    auto n = qkv.size(0);
    auto d = qkv.size(1) / (heads + 2 * kv_heads);
    auto q = at::empty({n, heads, d}, qkv.options());
    auto k = at::empty({n, kv_heads, d}, qkv.options());
    auto v = at::empty({n, kv_heads, d}, qkv.options());
    auto rstd = at::empty({n, heads + kv_heads}, qkv.options().dtype(at::kFloat));
    QkvArgs args{qkv.device().index(), address(qkv), address(q_weight), address(k_weight), address(cos),
                 address(sin), address(rstd), address(q), address(k), address(v), 0, 0, 0, n,
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
    auto dq = grad(0, heads), dk = grad(1, kv_heads), dv = grad(2, kv_heads);
    auto dqkv = at::empty_like(qkv);
    bool q_trains = q_weight.defined() && ctx->needs_input_grad(1);
    bool k_trains = k_weight.defined() && ctx->needs_input_grad(2);
    auto partial_options = qkv.options().dtype(at::kFloat);
    auto q_part = q_trains ? at::empty({norm_grad_blocks, d}, partial_options) : at::Tensor();
    auto k_part = k_trains ? at::empty({norm_grad_blocks, d}, partial_options) : at::Tensor();
    QkvArgs args{qkv.device().index(), address(qkv), address(q_weight), address(k_weight), address(cos),
                 address(sin), address(rstd), address(dq), address(dk), address(dv), address(dqkv),
                 address(q_part), address(k_part), n, static_cast<int32_t>(heads),
                 static_cast<int32_t>(kv_heads), static_cast<int32_t>(d), 0.0f};
    run(launchers.qkv_backward, args);
    auto dqw = q_trains ? q_part.sum(0).to(q_weight.scalar_type()) : at::Tensor();
    auto dkw = k_trains ? k_part.sum(0).to(k_weight.scalar_type()) : at::Tensor();
    return {dqkv, dqw, dkw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// silu(gate) · up from the fused gate/up projection's output.
class SwiGlu : public torch::autograd::Function<SwiGlu> {
 public:
  // gate_up (N, 2I) -> (N, I)
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up) {
    auto n = gate_up.size(0), inter = gate_up.size(1) / 2;
    auto out = at::empty({n, inter}, gate_up.options());
    SwiGluArgs args{gate_up.device().index(), address(gate_up), address(out), 0, n, inter};
    run(launchers.swiglu_forward, args);
    ctx->save_for_backward({gate_up});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto gate_up = ctx->get_saved_variables()[0];
    auto dout = grads[0].contiguous();
    auto dgu = at::empty_like(gate_up);
    SwiGluArgs args{gate_up.device().index(), address(gate_up), address(dout), address(dgu), gate_up.size(0),
                    gate_up.size(1) / 2};
    run(launchers.swiglu_backward, args);
    return {dgu};
  }
};

bool usable(const at::Tensor& t) {
  return t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 2;
}

at::Tensor optional(const at::Tensor* t) { return t == nullptr ? at::Tensor() : *t; }

}  // namespace

extern "C" {

// Registers the Rust launchers (and the backward kernel's block count) once per process.
void trainq_fused_register(const Launchers* table, int64_t blocks) {
  launchers = *table;
  norm_grad_blocks = blocks;
}

// qkv (N, (H + 2·KV)·D) bf16 contiguous on CUDA; q_weight / k_weight (D) or null; cos / sin
// (N, D) bf16 contiguous or null (no RoPE). Writes q (N, H, D), k and v (N, KV, D).
char* trainq_qkv_norm_rope(const at::Tensor* qkv, const at::Tensor* q_weight, const at::Tensor* k_weight,
                           const at::Tensor* cos, const at::Tensor* sin, int64_t heads, int64_t kv_heads,
                           double eps, at::Tensor** q, at::Tensor** k, at::Tensor** v) {
  try {
    if (!usable(*qkv)) throw std::runtime_error("qkv must be a contiguous 2-d bf16 CUDA tensor");
    auto out = QkvNormRope::apply(*qkv, optional(q_weight), optional(k_weight), optional(cos), optional(sin), heads,
                                  kv_heads, eps);
    *q = new at::Tensor(std::move(out[0]));
    *k = new at::Tensor(std::move(out[1]));
    *v = new at::Tensor(std::move(out[2]));
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}

// gate_up (N, 2I) bf16 contiguous on CUDA -> silu(gate) · up (N, I).
char* trainq_swiglu(const at::Tensor* gate_up, at::Tensor** out) {
  try {
    if (!usable(*gate_up)) throw std::runtime_error("gate_up must be a contiguous 2-d bf16 CUDA tensor");
    *out = new at::Tensor(SwiGlu::apply(*gate_up));
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}

}  // extern "C"
