//! Fused forward and backward kernels of the decoder layer's elementwise work, called by the
//! C++ autograd functions in csrc/fused_ops.cpp (libtorch records them in the graph; these
//! launch the arithmetic):
//!
//! - `qkv_norm_rope`: from the fused q/k/v projection's output, per head the RMSNorm of q and k
//!   (Qwen3's `q_norm`/`k_norm`, statistics in f32) and the rotary embedding, in one pass that
//!   writes q and k in their own tensors (v stays a view of the projection output, or is copied
//!   out when the caller passes a v buffer); backward in one pass that writes the gradient of the
//!   whole projection output (and per-block partial sums of the norm weights' gradients when they
//!   train). Replaces two norm kernels, six RoPE passes and the copies between them.
//! - `swiglu`: `silu(gate) · up` from the fused gate/up projection's output, and its backward,
//!   keeping nothing but that output for the backward (autograd through `silu` and `mul` also
//!   keeps `silu(gate)`).
//! - `add_rms_norm`: a residual add and the RMSNorm after it (post-attention, the next layer's
//!   input norm, the final norm) in one pass, and one pass back that also adds the residual
//!   path's gradient (the unfused backward is a norm kernel, then autograd's sum of the two
//!   gradients).
//!
//! All arithmetic in f32, one rounding to bf16 per output.

use std::ffi::c_char;

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::error::{Error, Result};

const SOURCE_NAME: &str = "trainq_fused.cu";

/// (source name, source, one of its kernels), for [`super::unavailable`].
pub(super) const SOURCE_NAME_AND_KERNEL: (&str, &str, &str) = (SOURCE_NAME, SOURCE, "qkv_norm_rope_fwd_128");

/// Threads per block of the row kernels (8 warps; 16 or 32 lanes per row of `head_dim`).
const ROW_THREADS: u32 = 256;
/// Blocks of the backward row kernel (a grid-stride loop; each block writes one partial sum
/// of the norm weights' gradients).
pub const NORM_GRAD_BLOCKS: u32 = 1056;

const SOURCE: &str = concat!(
    bf16_helpers!(),
    r#"
#define FULL 0xffffffffu

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
    return x;
}

// E consecutive bf16 (E = 2, 4 or 8, aligned to 2·E bytes) to and from f32 registers, in one
// 4-, 8- or 16-byte access.
__device__ __forceinline__ void unpack(unsigned int two, float* x) {
    x[0] = __uint_as_float(two << 16);
    x[1] = __uint_as_float(two & 0xffff0000u);
}
__device__ __forceinline__ unsigned int pack(const float* x) {
    return (unsigned int)float_to_bf16(x[0]) | ((unsigned int)float_to_bf16(x[1]) << 16);
}
template <int E> __device__ __forceinline__ void load_row(const unsigned short* p, float* x);
template <> __device__ __forceinline__ void load_row<2>(const unsigned short* p, float* x) {
    unpack(*(const unsigned int*)p, x);
}
template <> __device__ __forceinline__ void load_row<4>(const unsigned short* p, float* x) {
    uint2 w = *(const uint2*)p;
    unpack(w.x, x);
    unpack(w.y, x + 2);
}
template <> __device__ __forceinline__ void load_row<8>(const unsigned short* p, float* x) {
    uint4 w = *(const uint4*)p;
    unpack(w.x, x);
    unpack(w.y, x + 2);
    unpack(w.z, x + 4);
    unpack(w.w, x + 6);
}
template <int E> __device__ __forceinline__ void store_row(unsigned short* p, const float* x);
template <> __device__ __forceinline__ void store_row<2>(unsigned short* p, const float* x) {
    *(unsigned int*)p = pack(x);
}
template <> __device__ __forceinline__ void store_row<4>(unsigned short* p, const float* x) {
    *(uint2*)p = make_uint2(pack(x), pack(x + 2));
}
template <> __device__ __forceinline__ void store_row<8>(unsigned short* p, const float* x) {
    *(uint4*)p = make_uint4(pack(x), pack(x + 2), pack(x + 4), pack(x + 6));
}

// Sum over the L lanes of a row group (L a power of two, groups aligned within the warp).
template <int L> __device__ __forceinline__ float group_sum(float x) {
    #pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
    return x;
}

// qkv (N, T·D), T = H + 2·KV heads (q heads, then k, then v). A group of L = D / E lanes takes
// one (token, head) row, 32 / L rows per warp; lane l of a group holds elements [l·E, l·E + E),
// so rotate_half's partner of each element sits in lane l ^ (L / 2) at the same slot. qw / kw (D)
// may be null (no q/k norm); rope = 0 skips RoPE; v may be null (the caller reads v from qkv
// itself). Rows past the end are computed on a clamped row (every lane takes part in the
// shuffles) and not stored.
template <int E, int L> __device__ void qkv_fwd(const unsigned short* qkv, const unsigned short* qw,
        const unsigned short* kw, const unsigned short* cosv, const unsigned short* sinv,
        unsigned short* q, unsigned short* k, unsigned short* v, float* rstd,
        long long n, int H, int KV, float eps, int rope) {
    const int D = E * L;
    int T = H + 2 * KV, sub = threadIdx.x % L;
    long long rows = n * T;
    long long wanted = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / L;
    bool valid = wanted < rows;
    long long row = valid ? wanted : rows - 1;
    long long tok = row / T;
    int head = (int)(row - tok * T);
    float x[E];
    load_row<E>(qkv + row * D + sub * E, x);
    if (head >= H + KV) {  // v: uniform over the group, and groups never share a shuffle below
        if (valid && v) store_row<E>(v + (tok * KV + (head - H - KV)) * D + sub * E, x);
    }
    bool is_q = head < H, is_v = head >= H + KV;
    const unsigned short* w = is_q ? qw : kw;
    // Shuffles run on every lane (v rows included) so that no lane of the warp sits one out.
    float ss = 0.0f;
    #pragma unroll
    for (int e = 0; e < E; e++) ss += x[e] * x[e];
    ss = group_sum<L>(ss);
    if (w && !is_v) {
        float r = rsqrtf(ss / D + eps), wv[E];
        load_row<E>(w + sub * E, wv);
        #pragma unroll
        for (int e = 0; e < E; e++) x[e] = x[e] * r * wv[e];
        if (sub == 0 && valid) rstd[tok * (H + KV) + head] = r;
    }
    float y[E];
    if (rope) {
        float c[E], s[E];
        load_row<E>(cosv + tok * D + sub * E, c);
        load_row<E>(sinv + tok * D + sub * E, s);
        float sign = sub < L / 2 ? -1.0f : 1.0f;
        #pragma unroll
        for (int e = 0; e < E; e++) {
            float partner = __shfl_xor_sync(FULL, x[e], L / 2);
            y[e] = x[e] * c[e] + sign * partner * s[e];
        }
    } else {
        #pragma unroll
        for (int e = 0; e < E; e++) y[e] = x[e];
    }
    if (!valid || is_v) return;
    unsigned short* dst = (is_q ? q + (tok * H + head) * D : k + (tok * KV + (head - H)) * D) + sub * E;
    store_row<E>(dst, y);
}

// A row index with its (token, head), stepped through the rows without a division per row.
struct RowPos {
    long long row, tok;
    int head;
};
__device__ __forceinline__ RowPos row_pos(long long row, int T) {
    RowPos p;
    p.row = row;
    p.tok = row / T;
    p.head = (int)(row - p.tok * T);
    return p;
}
__device__ __forceinline__ void advance(RowPos& p, RowPos step, int T) {
    p.row += step.row;
    p.tok += step.tok;
    p.head += step.head;
    if (p.head >= T) { p.head -= T; p.tok += 1; }
}

// Backward of qkv_fwd: dq (N, H, D), dk and dv (N, KV, D) -> dqkv (N, T·D). When qw_part /
// kw_part are not null, each block adds up its rows' contributions to the norm weights'
// gradients and writes them to row blockIdx.x of (gridDim.x, D) f32 partials.
template <int E, int L> __device__ void qkv_bwd(const unsigned short* qkv, const unsigned short* qw,
        const unsigned short* kw, const unsigned short* cosv, const unsigned short* sinv,
        const float* rstd, const unsigned short* dq, const unsigned short* dk, const unsigned short* dv,
        unsigned short* dqkv, float* qw_part, float* kw_part, long long n, int H, int KV, int rope) {
    const int D = E * L;
    const int GROUPS = 256 / L;
    __shared__ float acc_q[GROUPS][D];
    __shared__ float acc_k[GROUPS][D];
    int T = H + 2 * KV, sub = threadIdx.x % L, group = threadIdx.x / L;
    int groups = blockDim.x / L;
    float gq[E], gk[E], wq[E], wk[E];
    #pragma unroll
    for (int e = 0; e < E; e++) { gq[e] = 0.0f; gk[e] = 0.0f; wq[e] = 0.0f; wk[e] = 0.0f; }
    if (qw) load_row<E>(qw + sub * E, wq);
    if (kw) load_row<E>(kw + sub * E, wk);
    long long rows = n * T;
    long long stride = (long long)gridDim.x * groups;
    // Every group of a warp runs the same number of iterations (rows past the end on a clamped
    // row, not stored), so the shuffles always see the whole warp.
    long long first = (long long)blockIdx.x * groups + group;
    long long warp_first = (long long)blockIdx.x * groups + (group / (32 / L)) * (32 / L);
    RowPos at = row_pos(first, T), step = row_pos(stride, T), last = row_pos(rows - 1, T);
    for (long long base = warp_first; base < rows; base += stride, advance(at, step, T)) {
        bool valid = at.row < rows;
        RowPos p = valid ? at : last;
        long long row = p.row, tok = p.tok;
        int head = p.head;
        bool is_q = head < H, is_v = head >= H + KV;
        unsigned short* dst = dqkv + row * D + sub * E;
        bool norm = !is_v && (is_q ? qw != 0 : kw != 0);
        // Every load of the row is issued here, before any shuffle waits on one: the row's
        // gradient, cos/sin, and the projection output and rstd the norm's backward reads.
        float dy[E], x[E], c[E], s[E], r = 1.0f;
        if (is_v) {
            load_row<E>(dv + (tok * KV + (head - H - KV)) * D + sub * E, dy);
        } else {
            load_row<E>((is_q ? dq + (tok * H + head) * D : dk + (tok * KV + (head - H)) * D) + sub * E, dy);
        }
        // v rows pass their gradient through unrotated: no cos/sin loads (the shuffle still runs
        // on them, with cos 1 and sin 0)
        if (rope && !is_v) {
            load_row<E>(cosv + tok * D + sub * E, c);
            load_row<E>(sinv + tok * D + sub * E, s);
        } else {
            #pragma unroll
            for (int e = 0; e < E; e++) { c[e] = 1.0f; s[e] = 0.0f; }
        }
        if (norm) {
            load_row<E>(qkv + row * D + sub * E, x);
            r = rstd[tok * (H + KV) + head];
        } else {
            #pragma unroll
            for (int e = 0; e < E; e++) x[e] = 0.0f;
        }
        float du[E];
        if (rope) {
            // du_j = dy_j cos_j + sign_j · dy_p(j) sin_p(j), sign +1 in the first half, −1 in the second
            float sign = sub < L / 2 ? 1.0f : -1.0f;
            #pragma unroll
            for (int e = 0; e < E; e++) {
                float partner = __shfl_xor_sync(FULL, dy[e] * s[e], L / 2);
                du[e] = dy[e] * c[e] + sign * partner;
            }
        } else {
            #pragma unroll
            for (int e = 0; e < E; e++) du[e] = dy[e];
        }
        float dx[E], dot = 0.0f;
        #pragma unroll
        for (int e = 0; e < E; e++) {
            x[e] *= r;                                  // x̂
            dx[e] = du[e] * (is_q ? wq[e] : wk[e]);     // dx̂
            dot += dx[e] * x[e];
        }
        dot = group_sum<L>(dot) / D;
        if (!valid) continue;
        if (is_v) {
            store_row<E>(dst, dy);
        } else if (!norm) {
            store_row<E>(dst, du);
        } else {
            #pragma unroll
            for (int e = 0; e < E; e++) {
                if (is_q) gq[e] += du[e] * x[e]; else gk[e] += du[e] * x[e];
                dx[e] = r * (dx[e] - x[e] * dot);
            }
            store_row<E>(dst, dx);
        }
    }
    if (!qw_part && !kw_part) return;
    #pragma unroll
    for (int e = 0; e < E; e++) { acc_q[group][sub * E + e] = gq[e]; acc_k[group][sub * E + e] = gk[e]; }
    __syncthreads();
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float sq = 0.0f, sk = 0.0f;
        for (int g = 0; g < groups; g++) { sq += acc_q[g][i]; sk += acc_k[g][i]; }
        if (qw_part) qw_part[(long long)blockIdx.x * D + i] = sq;
        if (kw_part) kw_part[(long long)blockIdx.x * D + i] = sk;
    }
}

// Forward with (EF, LF) lanes per row, backward with (EB, LB): the backward keeps more arrays
// live per lane and runs best at one row per warp.
#define QKV_KERNELS(EF, LF, EB, LB, D)                                                                       \
extern "C" __global__ void __launch_bounds__(256) qkv_norm_rope_fwd_##D(const unsigned short* qkv,          \
        const unsigned short* qw, const unsigned short* kw, const unsigned short* cosv,                      \
        const unsigned short* sinv, unsigned short* q, unsigned short* k, unsigned short* v, float* rstd,    \
        long long n, int H, int KV, float eps, int rope) {                                                   \
    qkv_fwd<EF, LF>(qkv, qw, kw, cosv, sinv, q, k, v, rstd, n, H, KV, eps, rope);                            \
}                                                                                                            \
extern "C" __global__ void __launch_bounds__(256) qkv_norm_rope_bwd_##D(const unsigned short* qkv,          \
        const unsigned short* qw, const unsigned short* kw, const unsigned short* cosv,                      \
        const unsigned short* sinv, const float* rstd, const unsigned short* dq, const unsigned short* dk,   \
        const unsigned short* dv, unsigned short* dqkv, float* qw_part, float* kw_part, long long n, int H,  \
        int KV, int rope) {                                                                                  \
    qkv_bwd<EB, LB>(qkv, qw, kw, cosv, sinv, rstd, dq, dk, dv, dqkv, qw_part, kw_part, n, H, KV, rope);      \
}
QKV_KERNELS(4, 16, 2, 32, 64)
QKV_KERNELS(8, 16, 4, 32, 128)
QKV_KERNELS(8, 32, 8, 32, 256)

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// gu (N, 2I): gate in the first I columns of each row, up in the last I; out (N, I). Each thread
// takes eight neighbouring columns (I a multiple of 8: 16-byte accesses).
extern "C" __global__ void swiglu_fwd(const unsigned short* gu, unsigned short* out, long long n, long long I) {
    long long per_row = I / 8, total = n * per_row, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        long long row = i / per_row, col = 8 * (i - row * per_row);
        float g[8], u[8], y[8];
        load_row<8>(gu + row * 2 * I + col, g);
        load_row<8>(gu + row * 2 * I + I + col, u);
        #pragma unroll
        for (int e = 0; e < 8; e++) y[e] = g[e] * sigmoid(g[e]) * u[e];
        store_row<8>(out + row * I + col, y);
    }
}

// dgu (N, 2I) from dout (N, I) and gu.
extern "C" __global__ void swiglu_bwd(const unsigned short* gu, const unsigned short* dout, unsigned short* dgu,
        long long n, long long I) {
    long long per_row = I / 8, total = n * per_row, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        long long row = i / per_row, col = 8 * (i - row * per_row);
        float g[8], u[8], d[8], dg[8], du[8];
        load_row<8>(gu + row * 2 * I + col, g);
        load_row<8>(gu + row * 2 * I + I + col, u);
        load_row<8>(dout + row * I + col, d);
        #pragma unroll
        for (int e = 0; e < 8; e++) {
            float s = sigmoid(g[e]);
            dg[e] = d[e] * u[e] * s * (1.0f + g[e] * (1.0f - s));
            du[e] = d[e] * g[e] * s;
        }
        store_row<8>(dgu + row * 2 * I + col, dg);
        store_row<8>(dgu + row * 2 * I + I + col, du);
    }
}

// Residual add + RMSNorm over rows of width W (a multiple of 8). A block of 256 threads takes R
// rows at a time, TPR = 256 / R threads each; a thread holds the 8 columns l·8 + k·TPR·8 of each
// chunk k < C (l its lane in the row), so C · TPR · 8 ≥ W. Every row group of a block runs the
// same iterations (rows past the end on a clamped row, not stored), so the block can sync.
// The sum over a row's TPR threads: shuffles within each warp, then `shared` across its warps.
template <int R> __device__ __forceinline__ float row_sum(float v, float (*shared)[8]) {
    const int TPR = 256 / R, WARPS = TPR / 32;
    v = warp_sum(v);
    if (WARPS == 1) return v;
    int group = threadIdx.x / TPR, warp = (threadIdx.x % TPR) / 32;
    __syncthreads();
    if (threadIdx.x % 32 == 0) shared[group][warp] = v;
    __syncthreads();
    float total = 0.0f;
    #pragma unroll
    for (int i = 0; i < WARPS; i++) total += shared[group][i];
    return total;
}

// s = x + h, rounded to bf16 as the unfused add is, and n = s · rstd · w with one rounding.
template <int R, int C> __device__ void add_norm_fwd(const unsigned short* x, const unsigned short* h,
        const unsigned short* w, unsigned short* s, unsigned short* n, float* rstd, long long rows, int W,
        float eps) {
    const int TPR = 256 / R;
    __shared__ float shared[R][8];
    int lane = threadIdx.x % TPR;
    float wv[C][8];
    #pragma unroll
    for (int k = 0; k < C; k++) {
        int c = lane * 8 + k * TPR * 8;
        if (c < W) load_row<8>(w + c, wv[k]);
    }
    for (long long base = (long long)blockIdx.x * R; base < rows; base += (long long)gridDim.x * R) {
        long long wanted = base + threadIdx.x / TPR;
        bool valid = wanted < rows;
        long long row = valid ? wanted : rows - 1;
        float v[C][8], ss = 0.0f;
        #pragma unroll
        for (int k = 0; k < C; k++) {
            int c = lane * 8 + k * TPR * 8;
            if (c >= W) continue;
            float a[8], b[8];
            load_row<8>(x + row * W + c, a);
            load_row<8>(h + row * W + c, b);
            #pragma unroll
            for (int e = 0; e < 8; e++) {
                v[k][e] = bf16_to_float(float_to_bf16(a[e] + b[e]));
                ss += v[k][e] * v[k][e];
            }
            if (valid) store_row<8>(s + row * W + c, v[k]);
        }
        float r = rsqrtf(row_sum<R>(ss, shared) / W + eps);
        if (!valid) continue;
        if (lane == 0) rstd[row] = r;
        #pragma unroll
        for (int k = 0; k < C; k++) {
            int c = lane * 8 + k * TPR * 8;
            if (c >= W) continue;
            float y[8];
            #pragma unroll
            for (int e = 0; e < 8; e++) y[e] = v[k][e] * r * wv[k][e];
            store_row<8>(n + row * W + c, y);
        }
    }
}

// Backward of add_norm_fwd: d = ds + rstd · (g − x̂ · mean(g · x̂)), x̂ = s · rstd, g = dn · w,
// the gradient of both x and h. ds may be null (zero). When w_part is not null, each block adds
// up dn · x̂ over its rows and writes row blockIdx.x of (gridDim.x, W) f32 partials.
template <int R, int C> __device__ void add_norm_bwd(const unsigned short* s, const unsigned short* w,
        const float* rstd, const unsigned short* ds, const unsigned short* dn, unsigned short* d,
        float* w_part, long long rows, int W) {
    const int TPR = 256 / R;
    __shared__ float shared[R][8];
    __shared__ float part[256 * 8 * C];
    int lane = threadIdx.x % TPR;
    float wv[C][8], gw[C][8];
    #pragma unroll
    for (int k = 0; k < C; k++) {
        int c = lane * 8 + k * TPR * 8;
        #pragma unroll
        for (int e = 0; e < 8; e++) gw[k][e] = 0.0f;
        if (c < W) load_row<8>(w + c, wv[k]);
    }
    for (long long base = (long long)blockIdx.x * R; base < rows; base += (long long)gridDim.x * R) {
        long long wanted = base + threadIdx.x / TPR;
        bool valid = wanted < rows;
        long long row = valid ? wanted : rows - 1;
        float r = rstd[row], xh[C][8], g[C][8], dot = 0.0f;
        #pragma unroll
        for (int k = 0; k < C; k++) {
            int c = lane * 8 + k * TPR * 8;
            if (c >= W) continue;
            float dnv[8];
            load_row<8>(s + row * W + c, xh[k]);
            load_row<8>(dn + row * W + c, dnv);
            #pragma unroll
            for (int e = 0; e < 8; e++) {
                xh[k][e] *= r;
                g[k][e] = dnv[e] * wv[k][e];
                dot += g[k][e] * xh[k][e];
                if (valid) gw[k][e] += dnv[e] * xh[k][e];
            }
        }
        dot = row_sum<R>(dot, shared) / W;
        if (!valid) continue;
        #pragma unroll
        for (int k = 0; k < C; k++) {
            int c = lane * 8 + k * TPR * 8;
            if (c >= W) continue;
            float dx[8], dsv[8];
            if (ds) {
                load_row<8>(ds + row * W + c, dsv);
            } else {
                #pragma unroll
                for (int e = 0; e < 8; e++) dsv[e] = 0.0f;
            }
            #pragma unroll
            for (int e = 0; e < 8; e++) dx[e] = dsv[e] + r * (g[k][e] - xh[k][e] * dot);
            store_row<8>(d + row * W + c, dx);
        }
    }
    if (!w_part) return;
    // The R row groups of the block hold partial sums of the same columns: add them up.
    for (int i = threadIdx.x; i < W; i += 256) part[i] = 0.0f;
    __syncthreads();
    #pragma unroll
    for (int k = 0; k < C; k++) {
        int c = lane * 8 + k * TPR * 8;
        if (c >= W) continue;
        #pragma unroll
        for (int e = 0; e < 8; e++) atomicAdd(&part[c + e], gw[k][e]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < W; i += 256) w_part[(long long)blockIdx.x * W + i] = part[i];
}

#define ADD_NORM_KERNELS(R, C)                                                                               \
extern "C" __global__ void __launch_bounds__(256) add_rms_norm_fwd_##R##_##C(const unsigned short* x,       \
        const unsigned short* h, const unsigned short* w, unsigned short* s, unsigned short* n, float* rstd, \
        long long rows, int W, float eps) {                                                                  \
    add_norm_fwd<R, C>(x, h, w, s, n, rstd, rows, W, eps);                                                   \
}                                                                                                            \
extern "C" __global__ void __launch_bounds__(256) add_rms_norm_bwd_##R##_##C(const unsigned short* s,       \
        const unsigned short* w, const float* rstd, const unsigned short* ds, const unsigned short* dn,      \
        unsigned short* d, float* w_part, long long rows, int W) {                                          \
    add_norm_bwd<R, C>(s, w, rstd, ds, dn, d, w_part, rows, W);                                              \
}
ADD_NORM_KERNELS(8, 1)
ADD_NORM_KERNELS(4, 1)
ADD_NORM_KERNELS(2, 1)
ADD_NORM_KERNELS(1, 1)
ADD_NORM_KERNELS(1, 2)
ADD_NORM_KERNELS(1, 3)
ADD_NORM_KERNELS(1, 4)
"#
);

/// Arguments of the q/k/v kernels, as csrc/fused_ops.cpp passes them: device addresses (0 for
/// an absent tensor) and sizes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct QkvArgs {
    /// CUDA ordinal of every tensor.
    pub device: i64,
    /// (N, T·D) bf16, the projection's output.
    pub qkv: u64,
    /// (D,) bf16 or 0.
    pub q_weight: u64,
    /// (D,) bf16 or 0.
    pub k_weight: u64,
    /// (N, D) bf16, or 0 for no RoPE.
    pub cos: u64,
    /// (N, D) bf16, or 0 for no RoPE.
    pub sin: u64,
    /// (N, H + KV) f32.
    pub rstd: u64,
    /// (N, H, D) bf16: output of the forward, gradient in the backward.
    pub q: u64,
    /// (N, KV, D) bf16, likewise.
    pub k: u64,
    /// (N, KV, D) bf16, likewise; 0 in the forward when v is read from `qkv` itself.
    pub v: u64,
    /// (N, T·D) bf16, written by the backward.
    pub dqkv: u64,
    /// (NORM_GRAD_BLOCKS, D) f32 partial sums, or 0 when the norm weights do not train.
    pub q_weight_partial: u64,
    /// Likewise for k.
    pub k_weight_partial: u64,
    /// Tokens.
    pub n: i64,
    /// Query heads.
    pub heads: i32,
    /// Key/value heads.
    pub kv_heads: i32,
    /// Head dim: 64, 128 or 256.
    pub head_dim: i32,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// Arguments of the SwiGLU kernels: gate/up (N, 2I), out / its gradient (N, I), and the
/// gradient of gate/up (backward).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SwiGluArgs {
    /// CUDA ordinal.
    pub device: i64,
    /// (N, 2I) bf16.
    pub gate_up: u64,
    /// (N, I) bf16: the output, or its gradient in the backward.
    pub out: u64,
    /// (N, 2I) bf16, written by the backward.
    pub grad_gate_up: u64,
    /// Rows.
    pub n: i64,
    /// Intermediate size.
    pub intermediate: i64,
}

/// Widest row the residual add + RMSNorm kernels take (a block of 256 threads per row, 4 chunks
/// of 8 columns per thread).
pub const ADD_NORM_MAX_WIDTH: i64 = 4 * 2048;

/// Arguments of the residual add + RMSNorm kernels: device addresses (0 for an absent tensor)
/// and sizes. Forward: x, h → s, n, rstd. Backward: s, weight, rstd, ds (or 0), dn → d, and
/// the weight's partial sums when it trains.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AddNormArgs {
    /// CUDA ordinal of every tensor.
    pub device: i64,
    /// (rows, W) bf16: the residual stream.
    pub x: u64,
    /// (rows, W) bf16: the branch output added to it.
    pub h: u64,
    /// (W,) bf16: the norm weight.
    pub weight: u64,
    /// (rows, W) bf16: x + h.
    pub s: u64,
    /// (rows, W) bf16: the normed s.
    pub n: u64,
    /// (rows,) f32: 1 / RMS of each row of s.
    pub rstd: u64,
    /// (rows, W) bf16: the gradient of s from the residual path, or 0.
    pub ds: u64,
    /// (rows, W) bf16: the gradient of n.
    pub dn: u64,
    /// (rows, W) bf16, written by the backward: the gradient of x and of h.
    pub d: u64,
    /// (NORM_GRAD_BLOCKS, W) f32 partial sums of the weight's gradient, or 0.
    pub weight_partial: u64,
    /// Rows.
    pub rows: i64,
    /// Row width (a multiple of 8, at most [`ADD_NORM_MAX_WIDTH`]).
    pub width: i32,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// The launchers csrc/fused_ops.cpp calls, in the layout it declares: each returns 0, or 1
/// after writing a NUL-terminated message of at most `len` bytes into `message`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FusedLaunchers {
    /// q/k/v forward.
    pub qkv_forward: unsafe extern "C" fn(*const QkvArgs, *mut c_char, usize) -> i32,
    /// q/k/v backward.
    pub qkv_backward: unsafe extern "C" fn(*const QkvArgs, *mut c_char, usize) -> i32,
    /// SwiGLU forward.
    pub swiglu_forward: unsafe extern "C" fn(*const SwiGluArgs, *mut c_char, usize) -> i32,
    /// SwiGLU backward.
    pub swiglu_backward: unsafe extern "C" fn(*const SwiGluArgs, *mut c_char, usize) -> i32,
    /// Residual add + RMSNorm forward.
    pub add_norm_forward: unsafe extern "C" fn(*const AddNormArgs, *mut c_char, usize) -> i32,
    /// Residual add + RMSNorm backward.
    pub add_norm_backward: unsafe extern "C" fn(*const AddNormArgs, *mut c_char, usize) -> i32,
}

/// The launchers, for registration with the C++ side.
pub const LAUNCHERS: FusedLaunchers = FusedLaunchers {
    qkv_forward: qkv_forward_c,
    qkv_backward: qkv_backward_c,
    swiglu_forward: swiglu_forward_c,
    swiglu_backward: swiglu_backward_c,
    add_norm_forward: add_norm_forward_c,
    add_norm_backward: add_norm_backward_c,
};

fn launch_qkv(args: &QkvArgs, backward: bool) -> Result<()> {
    if !matches!(args.head_dim, 64 | 128 | 256) || args.heads <= 0 || args.kv_heads <= 0 {
        return Err(Error::Kernel(format!("qkv kernels: unsupported head layout {args:?}")));
    }
    let rows = args.n * i64::from(args.heads + 2 * args.kv_heads);
    if rows == 0 {
        return Ok(());
    }
    let name = format!("qkv_norm_rope_{}_{}", if backward { "bwd" } else { "fwd" }, args.head_dim);
    let (ctx, f) = super::function(args.device as usize, SOURCE_NAME, SOURCE, &name)?;
    let stream = ctx.default_stream();
    let rope = i32::from(args.cos != 0);
    // Rows a block takes at once: one per group of lanes (forward: 16 lanes for D ≤ 128, 32 for
    // 256; backward: 32).
    let lanes_per_row = if backward || args.head_dim == 256 { 32 } else { 16 };
    let rows_per_block = i64::from(ROW_THREADS / lanes_per_row);
    // The forward: one row per group of lanes, one pass. The backward: a fixed grid of
    // NORM_GRAD_BLOCKS blocks walking the rows (one partial sum of the norm weights' gradients
    // each, when they train) — faster than a block per 8 rows even when nothing is summed
    // (H200, 0.6b 4×4096: the full fine-tune's backward took 6.2 ms a step, LoRA's 7.4).
    // Every block writes its partial row (zeros when it had no rows), so the grid is the same
    // whatever the row count.
    let blocks = if backward { NORM_GRAD_BLOCKS } else { ((rows + rows_per_block - 1) / rows_per_block) as u32 };
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
    let mut builder = stream.launch_builder(&f);
    builder.arg(&args.qkv).arg(&args.q_weight).arg(&args.k_weight).arg(&args.cos).arg(&args.sin);
    if backward {
        builder.arg(&args.rstd).arg(&args.q).arg(&args.k).arg(&args.v).arg(&args.dqkv);
        builder.arg(&args.q_weight_partial).arg(&args.k_weight_partial);
    } else {
        builder.arg(&args.q).arg(&args.k).arg(&args.v).arg(&args.rstd);
    }
    builder.arg(&args.n).arg(&args.heads).arg(&args.kv_heads);
    if !backward {
        builder.arg(&args.eps);
    }
    builder.arg(&rope);
    // SAFETY: csrc/fused_ops.cpp passes live, contiguous bf16/f32 buffers of the sizes documented
    // on `QkvArgs`, allocated on `device` and kept alive by the autograd function until the
    // kernel has run (stream order). Each warp writes its own row; partials one row per block.
    unsafe { builder.launch(cfg) }.map_err(|e| Error::Kernel(format!("{name} launch: {e:?}")))?;
    Ok(())
}

fn launch_swiglu(args: &SwiGluArgs, backward: bool) -> Result<()> {
    if args.intermediate % 8 != 0 {
        return Err(Error::Kernel(format!(
            "swiglu kernels: intermediate size {} is not a multiple of 8",
            args.intermediate
        )));
    }
    let total = args.n * args.intermediate / 8;
    if total == 0 {
        return Ok(());
    }
    let name = if backward { "swiglu_bwd" } else { "swiglu_fwd" };
    let (ctx, f) = super::function(args.device as usize, SOURCE_NAME, SOURCE, name)?;
    let stream = ctx.default_stream();
    let blocks = ((total + 255) / 256).min(132 * 32) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let mut builder = stream.launch_builder(&f);
    builder.arg(&args.gate_up);
    if backward {
        builder.arg(&args.out).arg(&args.grad_gate_up);
    } else {
        builder.arg(&args.out);
    }
    builder.arg(&args.n).arg(&args.intermediate);
    // SAFETY: live contiguous bf16 buffers of the sizes on `SwiGluArgs`, on `device`, kept alive
    // by the autograd function; every element is written by exactly one thread.
    unsafe { builder.launch(cfg) }.map_err(|e| Error::Kernel(format!("{name} launch: {e:?}")))?;
    Ok(())
}

fn launch_add_norm(args: &AddNormArgs, backward: bool) -> Result<()> {
    let width = i64::from(args.width);
    if width % 8 != 0 || width <= 0 || width > ADD_NORM_MAX_WIDTH {
        return Err(Error::Kernel(format!("add + RMSNorm kernels: unsupported width {width}")));
    }
    if args.rows == 0 {
        return Ok(());
    }
    // Rows per block: as many as keep every thread of a 256-thread block busy on rows of 8·256/R
    // columns (at least a warp per row), then chunks of 256·8 columns per thread for wider rows.
    let rows_per_block: i64 = match width {
        ..=256 => 8,
        257..=512 => 4,
        513..=1024 => 2,
        _ => 1,
    };
    let chunks = (width + (256 / rows_per_block) * 8 - 1) / ((256 / rows_per_block) * 8);
    let name = format!("add_rms_norm_{}_{rows_per_block}_{chunks}", if backward { "bwd" } else { "fwd" });
    let (ctx, f) = super::function(args.device as usize, SOURCE_NAME, SOURCE, &name)?;
    let stream = ctx.default_stream();
    // A fixed grid walking the rows (the backward's partial sums have one row per block).
    let groups = (args.rows + rows_per_block - 1) / rows_per_block;
    let blocks = if backward { NORM_GRAD_BLOCKS } else { groups.min(i64::from(NORM_GRAD_BLOCKS)) as u32 };
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
    let mut builder = stream.launch_builder(&f);
    if backward {
        builder.arg(&args.s).arg(&args.weight).arg(&args.rstd).arg(&args.ds).arg(&args.dn).arg(&args.d);
        builder.arg(&args.weight_partial).arg(&args.rows).arg(&args.width);
    } else {
        builder.arg(&args.x).arg(&args.h).arg(&args.weight).arg(&args.s).arg(&args.n).arg(&args.rstd);
        builder.arg(&args.rows).arg(&args.width).arg(&args.eps);
    }
    // SAFETY: csrc/fused_ops.cpp passes live, contiguous, 16-byte aligned bf16/f32 buffers of the
    // sizes documented on `AddNormArgs`, on `device`, kept alive by the autograd function until
    // the kernel has run (stream order). Each block writes its own rows and its partial row.
    unsafe { builder.launch(cfg) }.map_err(|e| Error::Kernel(format!("{name} launch: {e:?}")))?;
    Ok(())
}

/// Writes `result`'s error (if any) into the caller's buffer, NUL-terminated and cut to fit.
fn report(result: Result<()>, message: *mut c_char, len: usize) -> i32 {
    let Err(err) = result else { return 0 };
    if !message.is_null() && len > 0 {
        let text = err.to_string();
        let bytes = &text.as_bytes()[..text.len().min(len - 1)];
        // SAFETY: the caller's buffer holds `len` bytes; we write at most `len − 1` plus the NUL.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), message.cast::<u8>(), bytes.len());
            *message.add(bytes.len()) = 0;
        }
    }
    1
}

unsafe extern "C" fn qkv_forward_c(args: *const QkvArgs, message: *mut c_char, len: usize) -> i32 {
    // SAFETY: the C++ caller passes a valid pointer to arguments it owns for the call.
    report(launch_qkv(unsafe { &*args }, false), message, len)
}

unsafe extern "C" fn qkv_backward_c(args: *const QkvArgs, message: *mut c_char, len: usize) -> i32 {
    // SAFETY: as above.
    report(launch_qkv(unsafe { &*args }, true), message, len)
}

unsafe extern "C" fn swiglu_forward_c(args: *const SwiGluArgs, message: *mut c_char, len: usize) -> i32 {
    // SAFETY: as above.
    report(launch_swiglu(unsafe { &*args }, false), message, len)
}

unsafe extern "C" fn swiglu_backward_c(args: *const SwiGluArgs, message: *mut c_char, len: usize) -> i32 {
    // SAFETY: as above.
    report(launch_swiglu(unsafe { &*args }, true), message, len)
}

unsafe extern "C" fn add_norm_forward_c(args: *const AddNormArgs, message: *mut c_char, len: usize) -> i32 {
    // SAFETY: as above.
    report(launch_add_norm(unsafe { &*args }, false), message, len)
}

unsafe extern "C" fn add_norm_backward_c(args: *const AddNormArgs, message: *mut c_char, len: usize) -> i32 {
    // SAFETY: as above.
    report(launch_add_norm(unsafe { &*args }, true), message, len)
}
