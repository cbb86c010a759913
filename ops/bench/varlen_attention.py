"""One attention layer on packed documents: libtorch's varlen flash kernel (trainq's packed path,
forward + backward), cuDNN's ragged (varlen) SDPA forward through aten::_cudnn_attention_forward
with cumulative sequence lengths, and cuDNN's dense causal SDPA over whole rows (the unpacked
path; different math, shown for speed). Checks cuDNN varlen's output against flash varlen and
both against an f32 per-document reference.

cuDNN varlen's backward is broken in torch 2.11 (its nested branch of _cudnn_attention_backward
takes max_seqlen_batch_q from query.size(2), which is head_dim for (T, H, D) inputs: gradients
come back wrong or NaN and a later kernel faults), so only its forward is timed by default;
--cudnn-backward runs the broken backward last, to show the fault, and may end the process.

Run on the GPU box: /opt/torch/.venv/bin/python ops/bench/varlen_attention.py [--quick]
Prints one JSON line per case and a table.
"""

import argparse
import json
import math
import random

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def documents(total, lo, hi, rows, seed):
    """Document lengths, log-uniform in [lo, hi], cut at row boundaries (rows of total/rows)."""
    rng = random.Random(seed)
    row = total // rows
    lengths, used = [], 0
    while used < total:
        n = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        n = min(n, total - used)
        start_row, end_row = used // row, (used + n - 1) // row
        if start_row != end_row:  # cut at the row boundary, as the packer's rows do
            first = (start_row + 1) * row - used
            lengths.append(first)
            lengths.append(n - first)
        else:
            lengths.append(n)
        used += n
    return lengths


def qkv(total, heads, kv_heads, dim, strided_v):
    """q, k, v as trainq has them: q and k (T, n, D) contiguous; v a strided view of the fused
    projection output when strided_v (row stride (H + 2·KV)·D)."""
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    if strided_v:
        fused = torch.randn(total, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16)
        v = fused.requires_grad_()[:, (heads + kv_heads) * dim :].view(total, kv_heads, dim)
    else:
        v = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    return [t.requires_grad_() if t.is_leaf else t for t in (q, k, v)], (fused if strided_v else None)


def cu_seqlens(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu.cuda()


def flash_fwd_bwd(q, k, v, cu, max_len, grad):
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False)[0]
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out, dq, dk, dv


def flash_fwd(q, k, v, cu, max_len):
    with torch.no_grad():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False)[0]


def cudnn_fwd(q, k, v, cu, max_len):
    with torch.no_grad():
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False)[0]


def cudnn_fwd_bwd(q, k, v, cu, max_len, grad):
    """Through autograd (the backward needs an undefined attn_bias, which Python cannot pass)."""
    out = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False)[0]
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out, dq, dk, dv


def dense_fwd(q, k, v, rows):
    with torch.no_grad():
        return dense(q, k, v, rows)


def dense(q, k, v, rows):
    """(T, n, D) -> (B, n, L, D) causal over whole rows, cuDNN backend."""
    qb, kb, vb = (t.view(rows, -1, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)


def dense_fwd_bwd(q, k, v, rows, grad):
    out = dense(q, k, v, rows)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out, dq, dk, dv


class CudnnRagged:
    """cuDNN's ragged (THD) SDPA through the cudnn frontend's Python graph API (PyPI
    nvidia-cudnn-frontend; carried to the GPU box): causal per document, GQA native, q/k/o/dO
    contiguous (T, n, D), v at its own row stride. One forward and one backward graph per
    (documents, longest document); returns None when the package is missing."""

    def __init__(self, docs, max_len, heads, kv_heads, dim, v_row, all_plans=False):
        import cudnn

        self.all_plans = all_plans
        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        self.dims = (docs, max_len, heads, kv_heads, dim, v_row)
        self.scale = 1.0 / math.sqrt(dim)
        self.uid = {}
        # Stats (the softmax's log-sum-exp, kept for backward) ragged (T, H) like flash's, else
        # dense (B, H, S) when this cuDNN declines ragged stats.
        try:
            self.ragged_stats = True
            self.fwd = self.build(backward=False)
            self.bwd = self.build(backward=True)
        except Exception:
            self.ragged_stats = False
            self.fwd = self.build(backward=False)
            self.bwd = self.build(backward=True)

    def tensor(self, graph, name, dims, stride, dtype=None, ragged=None):
        uid = self.uid.setdefault(name, len(self.uid) + 1)
        t = graph.tensor(name=name, dim=dims, stride=stride, uid=uid,
                         data_type=dtype or self.cudnn.data_type.BFLOAT16)
        if ragged is not None:
            t.set_ragged_offset(ragged)
        return t

    def build(self, backward):
        cudnn = self.cudnn
        b, s, h, kv, d, v_row = self.dims
        graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                              intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        one = (1, 1, 1, 1)
        offsets = {n: self.tensor(graph, f"off_{n}", (b + 1, 1, 1, 1), one, cudnn.data_type.INT64)
                   for n in ("q", "k", "v", "stats")[: 4 if self.ragged_stats else 3]}
        q = self.tensor(graph, "q", (b, h, s, d), (s * h * d, d, h * d, 1), ragged=offsets["q"])
        k = self.tensor(graph, "k", (b, kv, s, d), (s * kv * d, d, kv * d, 1), ragged=offsets["k"])
        v = self.tensor(graph, "v", (b, kv, s, d), (s * v_row, d, v_row, 1), ragged=offsets["v"])
        seq = self.tensor(graph, "seq", (b, 1, 1, 1), one, cudnn.data_type.INT32)
        mask = dict(attn_scale=self.scale, use_causal_mask=True, use_padding_mask=True,
                    seq_len_q=seq, seq_len_kv=seq)
        q_dims, q_stride = (b, h, s, d), (s * h * d, d, h * d, 1)
        stats_dims = (b, h, s, 1)
        stats_stride = (s * h, 1, h, 1) if self.ragged_stats else (h * s, s, 1, 1)
        stats_ragged = offsets["stats"] if self.ragged_stats else None
        if not backward:
            o, stats = graph.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, **mask)
            o.set_output(True).set_dim(q_dims).set_stride(q_stride).set_uid(self.uid.setdefault("o", len(self.uid) + 1))
            o.set_ragged_offset(offsets["q"])
            stats.set_output(True).set_dim(stats_dims).set_stride(stats_stride).set_data_type(cudnn.data_type.FLOAT)
            stats.set_uid(self.uid.setdefault("stats", len(self.uid) + 1))
            if stats_ragged is not None:
                stats.set_ragged_offset(stats_ragged)
        else:
            o = self.tensor(graph, "o", q_dims, q_stride, ragged=offsets["q"])
            do = self.tensor(graph, "do", q_dims, q_stride, ragged=offsets["q"])
            stats = self.tensor(graph, "stats", stats_dims, stats_stride, cudnn.data_type.FLOAT, stats_ragged)
            dq, dk, dv = graph.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats, **mask)
            kv_dims, kv_stride = (b, kv, s, d), (s * kv * d, d, kv * d, 1)
            for t, name, dims, stride in ((dq, "dq", q_dims, q_stride), (dk, "dk", kv_dims, kv_stride),
                                          (dv, "dv", kv_dims, kv_stride)):
                t.set_output(True).set_dim(dims).set_stride(stride)
                t.set_uid(self.uid.setdefault(name, len(self.uid) + 1))
                t.set_ragged_offset(offsets["q" if name == "dq" else "k"])
        graph.validate()
        graph.build_operation_graph()
        if self.all_plans:
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans(cudnn.build_plan_policy.ALL)
        else:
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
        return graph

    def run(self, graph, tensors):
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device="cuda")
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute({self.uid[n]: t for n, t in tensors.items()}, workspace, handle=self.handle)

    def packs(self, q, k, v, lengths_cu, grad):
        """The forward's and the backward's graph with their tensors by name (outputs fresh).
        lengths_cu: (seq (B,1,1,1) int32, cumulative token offsets (B+1) int64)."""
        seq, cu = lengths_cu
        b, s, h, kv, d, v_row = self.dims
        offsets = {"off_q": (cu * h * d).view(-1, 1, 1, 1), "off_k": (cu * kv * d).view(-1, 1, 1, 1),
                   "off_v": (cu * v_row).view(-1, 1, 1, 1)}
        if self.ragged_stats:
            offsets["off_stats"] = (cu * h).view(-1, 1, 1, 1)
        o = torch.empty_like(q)
        stats = torch.empty(q.shape[0] * h if self.ragged_stats else b * h * s, dtype=torch.float32, device="cuda")
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
        forward = {"q": q, "k": k, "v": v, "seq": seq, "o": o, "stats": stats, **offsets}
        backward = {**forward, "do": grad, "dq": dq, "dk": dk, "dv": dv}
        return (self.fwd, forward), (self.bwd, backward)

    def plan_times(self, q, k, v, lengths_cu, grad, iters):
        """Every plan cuDNN offers for the forward and the backward graph, timed: [(name, ms)]."""
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        result = {}
        for direction, (graph, tensors) in zip(("forward", "backward"), self.packs(q, k, v, lengths_cu, grad)):
            pack = {self.uid[n]: t for n, t in tensors.items()}
            times = []
            for index in range(graph.get_execution_plan_count()):
                try:
                    size = graph.get_workspace_size_plan_at_index(index)
                    workspace = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
                    run = lambda: graph.execute_plan_at_index(pack, workspace, index, handle=self.handle)  # noqa: E731
                    times.append((graph.get_plan_name_at_index(index), round(timed(run, iters), 4)))
                except Exception as error:
                    times.append((f"plan {index}", f"{type(error).__name__}: {error}"[:120]))
            result[direction] = times
        return result

    def fwd_bwd(self, q, k, v, lengths_cu, grad):
        (fwd, forward), (bwd, backward) = self.packs(q, k, v, lengths_cu, grad)
        self.run(fwd, forward)
        self.run(bwd, backward)
        return backward["o"], backward["dq"], backward["dk"], backward["dv"]


def reference(q, k, v, lengths):
    """f32 per-document causal attention with K/V repeated per group."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(outs), (q, k, v)


def timed(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def case(name, total, rows, lengths, heads, kv_heads, dim, strided_v, iters, check_ref):
    (q, k, v), _fused = qkv(total, heads, kv_heads, dim, strided_v)
    grad = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    cu, max_len = cu_seqlens(lengths), max(lengths)
    flash = flash_fwd_bwd(q, k, v, cu, max_len, grad)
    cudnn_out = cudnn_fwd(q, k, v, cu, max_len)
    row = {"case": name, "tokens": total, "rows": rows, "docs": len(lengths), "max_doc": max_len,
           "heads": heads, "kv_heads": kv_heads, "strided_v": strided_v}
    row["cudnn_vs_flash_out_max_diff"] = round(max_diff(cudnn_out, flash[0]), 5)
    frontend = None
    try:
        import time

        started = time.perf_counter()
        frontend = CudnnRagged(len(lengths), max_len, heads, kv_heads, dim, v.stride(0))
        row["frontend_build_s"] = round(time.perf_counter() - started, 3)
        row["frontend_ragged_stats"] = frontend.ragged_stats
        seq = torch.tensor(lengths, dtype=torch.int32, device="cuda").view(-1, 1, 1, 1)
        lengths_cu = (seq, cu.long())
        qd, kd, vd = (t.detach() for t in (q, k, v))
        frontend_run = lambda: frontend.fwd_bwd(qd, kd, vd, lengths_cu, grad)  # noqa: E731
        got = frontend_run()
        row["frontend_vs_flash_max_diff"] = [round(max_diff(a, b), 5) for a, b in zip(got, flash)]
    except Exception as error:  # the package missing, or cuDNN declining the graph
        row["frontend_error"] = f"{type(error).__name__}: {error}"[:300]
        frontend = None
    if check_ref:
        ref, leaves = reference(q, k, v, lengths)
        ref_grads = torch.autograd.grad(ref, leaves, grad.float())
        row["cudnn_out_vs_f32_max_diff"] = round(max_diff(cudnn_out, ref), 5)
        row["flash_vs_f32_max_diff"] = [round(max_diff(a, b), 5) for a, b in zip(flash, (ref, *ref_grads))]
    row["flash_fwd_bwd_ms"] = round(timed(lambda: flash_fwd_bwd(q, k, v, cu, max_len, grad), iters), 3)
    row["flash_fwd_ms"] = round(timed(lambda: flash_fwd(q, k, v, cu, max_len), iters), 3)
    row["cudnn_varlen_fwd_ms"] = round(timed(lambda: cudnn_fwd(q, k, v, cu, max_len), iters), 3)
    if frontend is not None:
        row["frontend_fwd_bwd_ms"] = round(timed(frontend_run, iters), 3)
    row["cudnn_dense_rows_fwd_bwd_ms"] = round(timed(lambda: dense_fwd_bwd(q, k, v, rows, grad), iters), 3)
    row["cudnn_dense_rows_fwd_ms"] = round(timed(lambda: dense_fwd(q, k, v, rows), iters), 3)
    # attention FLOPs actually needed (causal per document): 4·n²/2·H·D forward, 2.5× that backward
    fwd_flops = sum(4 * n * n / 2 * heads * dim for n in lengths)
    row["flash_fwd_bwd_tflops"] = round(fwd_flops * 3.5 / row["flash_fwd_bwd_ms"] / 1e9, 1)
    row["flash_fwd_tflops"] = round(fwd_flops / row["flash_fwd_ms"] / 1e9, 1)
    row["cudnn_varlen_fwd_tflops"] = round(fwd_flops / row["cudnn_varlen_fwd_ms"] / 1e9, 1)
    if "frontend_fwd_bwd_ms" in row:
        row["frontend_fwd_bwd_tflops"] = round(fwd_flops * 3.5 / row["frontend_fwd_bwd_ms"] / 1e9, 1)
    print(json.dumps(row), flush=True)
    return row


def broken_cudnn_backward(total, lengths, heads, kv_heads, dim):
    """torch 2.11's cuDNN varlen backward against flash's: prints the gradients' max |Δ|."""
    (q, k, v), _ = qkv(total, heads, kv_heads, dim, False)
    grad = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    cu, max_len = cu_seqlens(lengths), max(lengths)
    flash = flash_fwd_bwd(q, k, v, cu, max_len, grad)
    cudnn = cudnn_fwd_bwd(q, k, v, cu, max_len, grad)
    torch.cuda.synchronize()
    print(json.dumps({"cudnn_varlen_backward_vs_flash_max_diff (out, dq, dk, dv)":
                      [max_diff(a, b) for a, b in zip(cudnn, flash)]}), flush=True)


def plans(iters):
    """Every cuDNN plan for whole causal rows (one document a row) and packed rows."""
    for name, total, heads, kv_heads, lengths in [
        ("0.6b/1.7b 4x4096 whole rows", 16384, 16, 8, [4096] * 4),
        ("0.6b/1.7b 4x4096 docs 300-6000", 16384, 16, 8, documents(16384, 300, 6000, 4, 1)),
        ("8b 2x4096 whole rows", 8192, 32, 8, [4096] * 2),
    ]:
        (q, k, v), _ = qkv(total, heads, kv_heads, 128, True)
        grad = torch.randn(total, heads, 128, device="cuda", dtype=torch.bfloat16)
        cu = cu_seqlens(lengths)
        seq = torch.tensor(lengths, dtype=torch.int32, device="cuda").view(-1, 1, 1, 1)
        frontend = CudnnRagged(len(lengths), max(lengths), heads, kv_heads, 128, v.stride(0), all_plans=True)
        times = frontend.plan_times(q.detach(), k.detach(), v.detach(), (seq, cu.long()), grad, iters)
        row = {"case": name, "docs": len(lengths), **times}
        if len(set(lengths)) == 1:  # whole rows: torch's SDPA (cuDNN backend) on the same rows
            row["torch_sdpa_cudnn_fwd_bwd_ms"] = round(timed(lambda: dense_fwd_bwd(q, k, v, len(lengths), grad), iters), 4)
            row["torch_sdpa_cudnn_fwd_ms"] = round(timed(lambda: dense_fwd(q, k, v, len(lengths)), iters), 4)
        print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plans", action="store_true", help="only time every cuDNN plan of a few shapes")
    parser.add_argument("--cudnn-backward", action="store_true",
                        help="last, run torch's broken cuDNN varlen backward (may fault)")
    args = parser.parse_args()
    torch.manual_seed(0)
    iters = 5 if args.quick else 20
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name()}))
    if args.plans:
        plans(iters)
        return
    rows = []
    small = [700, 2100, 1296]
    rows.append(case("check 1x4096, 3 docs", 4096, 1, small, 16, 8, 128, True, iters, True))
    rows.append(case("check 1x4096, 3 docs, v contiguous", 4096, 1, small, 16, 8, 128, False, iters, True))
    for name, total, r, lo, hi, h, kv in [
        ("0.6b 4x4096 docs 300-6000", 16384, 4, 300, 6000, 16, 8),
        ("0.6b 1x16384 docs 300-6000", 16384, 1, 300, 6000, 16, 8),
        ("0.6b 4x4096 docs 200-1000", 16384, 4, 200, 1000, 16, 8),
        ("8b 1x32768 docs 2000-32768", 32768, 1, 2000, 32768, 32, 8),
    ]:
        rows.append(case(name, total, r, documents(total, lo, hi, r, 1), h, kv, 128, True, iters, False))
    print("| case | docs | cuDNN frontend ragged fwd+bwd ms (TFLOP/s) | flash fwd+bwd ms (TFLOP/s) | flash fwd ms | cuDNN varlen fwd ms | cuDNN varlen fwd / flash fwd | cuDNN dense rows fwd+bwd ms | cuDNN dense rows fwd ms | max |Δout| cuDNN vs flash |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        frontend = f"{row['frontend_fwd_bwd_ms']} ({row['frontend_fwd_bwd_tflops']})" if "frontend_fwd_bwd_ms" in row else "—"
        print(f"| {row['case']} | {row['docs']} | {frontend} | {row['flash_fwd_bwd_ms']} ({row['flash_fwd_bwd_tflops']}) | "
              f"{row['flash_fwd_ms']} | {row['cudnn_varlen_fwd_ms']} | "
              f"{row['cudnn_varlen_fwd_ms'] / row['flash_fwd_ms']:.2f} | {row['cudnn_dense_rows_fwd_bwd_ms']} | "
              f"{row['cudnn_dense_rows_fwd_ms']} | {row['cudnn_vs_flash_out_max_diff']} |")
    if args.cudnn_backward:
        broken_cudnn_backward(4096, small, 16, 8, 128)


if __name__ == "__main__":
    main()
