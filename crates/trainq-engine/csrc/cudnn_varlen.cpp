// cuDNN's ragged (THD) scaled-dot-product attention for packed documents: causal within each
// document, GQA native, q/k/v read where trainq's q/k/v kernel wrote them (v at the fused
// projection's row stride). One autograd function whose forward and backward run cuDNN graphs
// built with the cudnn frontend's C++ API (header-only; cuDNN and the CUDA runtime are found at
// run time among the libraries libtorch_cuda already loaded), cached per bucketed shape. The
// Rust side (model/cudnn_varlen.rs) builds the per-document lengths and offsets and the
// buckets. Errors come back as a malloc'd string (trainq_free_message, in offload.cpp).
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include "guarded.h"

namespace cudnn_frontend {
// The frontend resolves cuDNN's symbols through this handle (dynamic loading).
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace fe = cudnn_frontend;

namespace {

enum Uid : int64_t { kQ = 1, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSeq, kOffQ, kOffK, kOffV, kOffStats };

// One graph's shape: documents (bucketed), longest document (bucketed), tokens (bucketed),
// heads, kv heads, head dim, v's row stride, dtype, direction.
struct Key {
  int64_t device, b, s, t, h, kv, d, v_row;
  bool half, backward;
  auto tie() const { return std::tie(device, b, s, t, h, kv, d, v_row, half, backward); }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

void check(fe::error_t status, const char* what) {
  if (!status.is_good()) throw std::runtime_error(std::string("cuDNN ") + what + ": " + status.get_message());
}

void load_cudnn() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (fe::cudnn_dlhandle != nullptr) return;
  // libtorch_cuda loaded libcudnn.so.9 already; this finds that copy by its soname.
  void* handle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) throw std::runtime_error(std::string("cannot load libcudnn.so.9: ") + dlerror());
  fe::cudnn_dlhandle = handle;
}

// A cuDNN handle per (thread, device), bound to the current stream at each use.
cudnnHandle_t handle_for(const at::Tensor& like) {
  load_cudnn();
  thread_local std::map<int64_t, cudnnHandle_t> handles;
  auto device = like.device().index();
  auto found = handles.find(device);
  cudnnHandle_t handle;
  if (found == handles.end()) {
    c10::DeviceGuard guard(like.device());
    if (fe::detail::create_handle(&handle) != CUDNN_STATUS_SUCCESS) throw std::runtime_error("cudnnCreate failed");
    handles.emplace(device, handle);
  } else {
    handle = found->second;
  }
  auto stream = c10::cuda::getCurrentCUDAStream(device).stream();
  if (fe::detail::set_stream(handle, stream) != CUDNN_STATUS_SUCCESS) throw std::runtime_error("cudnnSetStream failed");
  return handle;
}

std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph& g, const char* name, Uid uid,
                                                     std::vector<int64_t> dim, std::vector<int64_t> stride) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride));
}

// The forward's and the backward's shared settings: causal within each document (`seq` its
// length; keys past it masked), scaled by 1/√D, at most `t` packed tokens.
template <typename Attributes>
Attributes ragged_causal(Attributes options, std::shared_ptr<fe::graph::Tensor_attributes> seq, float scale,
                         int64_t t) {
  options.set_attn_scale(scale);
  options.set_causal_mask(true);
  options.set_padding_mask(true);
  options.set_seq_len_q(seq);
  options.set_seq_len_kv(seq);
  options.set_max_total_seq_len_q(t);
  options.set_max_total_seq_len_kv(t);
  return options;
}

std::shared_ptr<fe::graph::Graph> build(const Key& key, cudnnHandle_t handle) {
  auto [device, b, s, t, h, kv, d, v_row, half, backward] = key;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(half ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto offset = [&](const char* name, Uid uid) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({b + 1, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT64));
  };
  auto off_q = offset("off_q", kOffQ), off_k = offset("off_k", kOffK), off_v = offset("off_v", kOffV);
  auto off_stats = offset("off_stats", kOffStats);
  // (B, n, S, D) over (T, n, D) memory: each document starts at its ragged offset.
  std::vector<int64_t> q_dim{b, h, s, d}, q_stride{s * h * d, d, h * d, 1};
  std::vector<int64_t> kv_dim{b, kv, s, d}, kv_stride{s * kv * d, d, kv * d, 1};
  std::vector<int64_t> stats_dim{b, h, s, 1}, stats_stride{s * h, 1, h, 1};
  auto q = tensor(*g, "q", kQ, q_dim, q_stride);
  auto k = tensor(*g, "k", kK, kv_dim, kv_stride);
  auto v = tensor(*g, "v", kV, kv_dim, {s * v_row, d, v_row, 1});
  q->set_ragged_offset(off_q);
  k->set_ragged_offset(off_k);
  v->set_ragged_offset(off_v);
  auto seq = g->tensor(fe::graph::Tensor_attributes()
                           .set_name("seq")
                           .set_uid(kSeq)
                           .set_dim({b, 1, 1, 1})
                           .set_stride({1, 1, 1, 1})
                           .set_data_type(fe::DataType_t::INT32));
  auto scale = 1.0f / std::sqrt(static_cast<float>(d));
  if (!backward) {
    auto options = ragged_causal(fe::graph::SDPA_attributes(), seq, scale, t);
    options.set_name("sdpa").set_generate_stats(true);
    auto [o, stats] = g->sdpa(q, k, v, options);
    o->set_output(true).set_uid(kO).set_dim(q_dim).set_stride(q_stride).set_ragged_offset(off_q);
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dim)
        .set_stride(stats_stride)
        .set_ragged_offset(off_stats);
  } else {
    auto o = tensor(*g, "o", kO, q_dim, q_stride);
    auto d_o = tensor(*g, "do", kDO, q_dim, q_stride);
    o->set_ragged_offset(off_q);
    d_o->set_ragged_offset(off_q);
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("stats")
                               .set_uid(kStats)
                               .set_dim(stats_dim)
                               .set_stride(stats_stride)
                               .set_data_type(fe::DataType_t::FLOAT)
                               .set_ragged_offset(off_stats));
    auto options = ragged_causal(fe::graph::SDPA_backward_attributes(), seq, scale, t);
    options.set_name("sdpa_backward");
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, options);
    dq->set_output(true).set_uid(kDQ).set_dim(q_dim).set_stride(q_stride).set_ragged_offset(off_q);
    // dk and dv come out contiguous (T, KV, D), at k's offsets.
    dk->set_output(true).set_uid(kDK).set_dim(kv_dim).set_stride(kv_stride).set_ragged_offset(off_k);
    dv->set_output(true).set_uid(kDV).set_dim(kv_dim).set_stride(kv_stride).set_ragged_offset(off_k);
  }
  check(g->validate(), "graph validation");
  check(g->build_operation_graph(handle), "operation graph");
  check(g->create_execution_plans({fe::HeurMode_t::A}), "execution plans");
  check(g->check_support(), "support check");
  check(g->build_plans(), "plan build");
  return g;
}

std::shared_ptr<fe::graph::Graph> graph_for(const Key& key, cudnnHandle_t handle) {
  static std::mutex mutex;
  static std::map<Key, std::shared_ptr<fe::graph::Graph>> graphs;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = graphs.find(key);
  if (found != graphs.end()) return found->second;
  auto graph = build(key, handle);
  graphs.emplace(key, graph);
  return graph;
}

void execute(const fe::graph::Graph& graph, cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack,
             const at::Tensor& like) {
  int64_t bytes = 0;
  check(graph.get_workspace_size(bytes), "workspace size");
  auto workspace = at::empty({std::max<int64_t>(bytes, 1)}, like.options().dtype(at::kByte));
  check(graph.execute(handle, pack, workspace.data_ptr()), "execute");
}

// The rows of `offsets` (4, B + 1): q, k, v and stats offsets in elements.
void* row(const at::Tensor& offsets, int64_t i) { return offsets[i].data_ptr(); }

Key key_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t b, int64_t s, int64_t t,
           bool backward) {
  return Key{q.device().index(), b, s, t, q.size(1), k.size(1), q.size(2), v.stride(0),
             q.scalar_type() == at::kHalf, backward};
}

class CudnnVarlen : public torch::autograd::Function<CudnnVarlen> {
 public:
  // q (T, H, D), k (T, KV, D) contiguous; v (T, KV, D) with unit last stride and head stride D;
  // seq int32 (B) document lengths (0 past the real ones); offsets int64 (4, B + 1).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq,
                                                const at::Tensor& offsets, int64_t b, int64_t s, int64_t t) {
    auto handle = handle_for(q);
    auto forward_key = key_of(q, k, v, b, s, t, false);
    auto graph = graph_for(forward_key, handle);
    // Build the backward graph now too, so a shape cuDNN declines fails here, where the caller
    // can still take another kernel, and not in the middle of backward.
    if (q.requires_grad() || k.requires_grad() || v.requires_grad()) graph_for(key_of(q, k, v, b, s, t, true), handle);
    auto o = at::empty_like(q, at::MemoryFormat::Contiguous);
    auto stats = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
    std::unordered_map<int64_t, void*> pack{
        {kQ, q.data_ptr()},           {kK, k.data_ptr()},           {kV, v.data_ptr()},
        {kSeq, seq.data_ptr()},       {kOffQ, row(offsets, 0)},     {kOffK, row(offsets, 1)},
        {kOffV, row(offsets, 2)},     {kOffStats, row(offsets, 3)}, {kO, o.data_ptr()},
        {kStats, stats.data_ptr()}};
    execute(*graph, handle, pack, q);
    ctx->save_for_backward({q, k, v, o, stats, seq, offsets});
    ctx->saved_data["b"] = b;
    ctx->saved_data["s"] = s;
    ctx->saved_data["t"] = t;
    return {o};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &stats = saved[4], &seq = saved[5],
         &offsets = saved[6];
    auto b = ctx->saved_data["b"].toInt(), s = ctx->saved_data["s"].toInt(), t = ctx->saved_data["t"].toInt();
    auto d_o = grads[0].contiguous();
    auto handle = handle_for(q);
    auto graph = graph_for(key_of(q, k, v, b, s, t, true), handle);
    auto dq = at::empty_like(q, at::MemoryFormat::Contiguous);
    auto dk = at::empty({k.size(0), k.size(1), k.size(2)}, k.options());
    auto dv = at::empty({k.size(0), k.size(1), k.size(2)}, k.options());
    std::unordered_map<int64_t, void*> pack{
        {kQ, q.data_ptr()},       {kK, k.data_ptr()},           {kV, v.data_ptr()},
        {kO, o.data_ptr()},       {kDO, d_o.data_ptr()},        {kStats, stats.data_ptr()},
        {kSeq, seq.data_ptr()},   {kOffQ, row(offsets, 0)},     {kOffK, row(offsets, 1)},
        {kOffV, row(offsets, 2)}, {kOffStats, row(offsets, 3)}, {kDQ, dq.data_ptr()},
        {kDK, dk.data_ptr()},     {kDV, dv.data_ptr()}};
    execute(*graph, handle, pack, q);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_layout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3) throw std::invalid_argument("q, k, v must be (T, n, D)");
  if (!q.is_contiguous() || !k.is_contiguous()) throw std::invalid_argument("q and k must be contiguous");
  if (v.stride(2) != 1 || v.stride(1) != v.size(2)) throw std::invalid_argument("v's heads must be contiguous");
  if (v.sizes() != k.sizes()) throw std::invalid_argument("k and v must have one shape");
  if (q.size(1) % k.size(1) != 0) throw std::invalid_argument("heads must be a multiple of kv heads");
}

}  // namespace

extern "C" {

// Causal attention within each document of packed q/k/v; see CudnnVarlen::forward for the
// layout. `b`, `s`, `t`: the bucketed document count (seq's length), longest document and token
// count the graph is built for. Writes the output (T, H, D) as a new at::Tensor* owned by the
// caller; returns nullptr or an error message to release with trainq_free_message.
char* trainq_cudnn_varlen_forward(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v,
                                  const at::Tensor* seq, const at::Tensor* offsets, int64_t b, int64_t s,
                                  int64_t t, at::Tensor** out) {
  return guarded([&] {
    check_layout(*q, *k, *v);
    auto result = CudnnVarlen::apply(*q, *k, *v, *seq, *offsets, b, s, t);
    *out = new at::Tensor(std::move(result[0]));
  });
}

}  // extern "C"
