//! One fused AdamW update over a flat parameter bucket: each element's gradient, parameter and
//! both moments are read once and written once (~20 bytes per bf16 parameter, in 16- and 32-byte
//! accesses of eight elements a thread), instead of the
//! ~15 tensor-op passes of the portable path in `train::adamw`. Same arithmetic as that path
//! (and `torch.optim.AdamW`): `p ← p·(1 − lr·wd)`, `m ← lerp(m, c·g, 1−β1)`,
//! `v ← lerp(v, (c·g)², 1−β2)`, `p ← p − (lr/(1−β1ᵗ)) · m / (√v/√(1−β2ᵗ) + eps)`, in f32, with the
//! clipping coefficient `c` folded in; bf16 parameters round to nearest even on the way back.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

const SOURCE_NAME: &str = "trainq_adamw.cu";

/// (source name, source, one of its kernels), for [`super::unavailable`].
pub(super) const SOURCE_NAME_AND_KERNEL: (&str, &str, &str) = (SOURCE_NAME, SOURCE, "adamw_bf16");

const SOURCE: &str = concat!(
    bf16_helpers!(),
    r#"
__device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ void store(float* p, long long i, float x) { p[i] = x; }
__device__ __forceinline__ float load(const unsigned short* p, long long i) { return bf16_to_float(p[i]); }
__device__ __forceinline__ void store(unsigned short* p, long long i, float x) { p[i] = float_to_bf16(x); }

template <typename T>
__device__ void adamw(T* param, const T* grad, float* exp_avg, float* exp_avg_sq, long long n,
                      float decay, float w1, float w2, float step_size, float bias2_sqrt,
                      float eps, float coef) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float g = load(grad, i) * coef;
        float p = load(param, i) * decay;
        float m = exp_avg[i];
        float v = exp_avg_sq[i];
        m = m + w1 * (g - m);
        v = v + w2 * (g * g - v);
        p = p + (-step_size * m) / (sqrtf(v) / bias2_sqrt + eps);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        store(param, i, p);
    }
}

extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, long long n,
    float decay, float w1, float w2, float step_size, float bias2_sqrt, float eps, float coef) {
    adamw(p, g, m, v, n, decay, w1, w2, step_size, bias2_sqrt, eps, coef);
}

// bf16 parameters: eight elements a thread (16-byte loads of the parameters and gradients, 32
// of each moment) when every buffer is 16-byte aligned, the tail (and unaligned buffers)
// one element a thread. Same arithmetic per element as `adamw`.
extern "C" __global__ void adamw_bf16(unsigned short* p, const unsigned short* g, float* m, float* v,
    long long n, float decay, float w1, float w2, float step_size, float bias2_sqrt, float eps, float coef) {
    unsigned long long addresses = (unsigned long long)p | (unsigned long long)g | (unsigned long long)m
        | (unsigned long long)v;
    long long groups = (addresses & 15) == 0 ? n / 8 : 0;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < groups; i += stride) {
        uint4 pw = ((const uint4*)p)[i], gw = ((const uint4*)g)[i];
        float4 m0 = ((const float4*)m)[2 * i], m1 = ((const float4*)m)[2 * i + 1];
        float4 v0 = ((const float4*)v)[2 * i], v1 = ((const float4*)v)[2 * i + 1];
        float pf[8], gf[8];
        unpack8(pw, pf);
        unpack8(gw, gf);
        float mm[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
        float vv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        #pragma unroll
        for (int e = 0; e < 8; e++) {
            float grad = gf[e] * coef;
            mm[e] = mm[e] + w1 * (grad - mm[e]);
            vv[e] = vv[e] + w2 * (grad * grad - vv[e]);
            pf[e] = pf[e] * decay + (-step_size * mm[e]) / (sqrtf(vv[e]) / bias2_sqrt + eps);
        }
        ((float4*)m)[2 * i] = make_float4(mm[0], mm[1], mm[2], mm[3]);
        ((float4*)m)[2 * i + 1] = make_float4(mm[4], mm[5], mm[6], mm[7]);
        ((float4*)v)[2 * i] = make_float4(vv[0], vv[1], vv[2], vv[3]);
        ((float4*)v)[2 * i + 1] = make_float4(vv[4], vv[5], vv[6], vv[7]);
        ((uint4*)p)[i] = pack8(pf);
    }
    long long done = 8 * groups;
    adamw(p + done, g + done, m + done, v + done, n - done, decay, w1, w2, step_size, bias2_sqrt, eps, coef);
}
"#
);

/// The step's scalars, computed on the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// `1 − lr·wd`.
    pub decay: f64,
    /// `1 − β1` (the first moment's lerp weight).
    pub w1: f64,
    /// `1 − β2`.
    pub w2: f64,
    /// `lr / (1 − β1ᵗ)`.
    pub step_size: f64,
    /// `√(1 − β2ᵗ)`.
    pub bias2_sqrt: f64,
    /// `eps`.
    pub eps: f64,
    /// Gradient clipping coefficient (1 without clipping).
    pub coef: f64,
}

/// Updates `params` (a flat contiguous f32 or bf16 CUDA buffer) in place from `grads` (same
/// dtype and length) and the f32 moments `exp_avg`, `exp_avg_sq`. Queued on the device's
/// default stream after the work that produced the gradients; nothing is read back.
pub fn fused_adamw_step(
    params: &Tensor,
    grads: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    s: &AdamWScalars,
) -> Result<()> {
    let Device::Cuda(ordinal) = params.device() else {
        return Err(Error::Kernel("the fused AdamW kernel runs on CUDA tensors only".into()));
    };
    let n = params.numel();
    let kernel = match params.kind() {
        Kind::Float => "adamw_f32",
        Kind::BFloat16 => "adamw_bf16",
        other => {
            return Err(Error::Kernel(format!("the fused AdamW kernel takes f32 or bf16 parameters, not {other:?}")))
        }
    };
    let same_layout = |t: &Tensor, kind: Kind| {
        t.device() == params.device() && t.kind() == kind && t.numel() == n && t.is_contiguous()
    };
    let ok = params.is_contiguous()
        && same_layout(grads, params.kind())
        && same_layout(exp_avg, Kind::Float)
        && same_layout(exp_avg_sq, Kind::Float);
    if !ok {
        return Err(Error::Kernel(
            "fused AdamW: parameters, gradients and moments must be contiguous, on one device, of one length".into(),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let (ctx, f) = super::function(ordinal, SOURCE_NAME, SOURCE, kernel)?;
    let stream = ctx.default_stream();
    let (p, g, m, v) =
        (params.data_ptr() as u64, grads.data_ptr() as u64, exp_avg.data_ptr() as u64, exp_avg_sq.data_ptr() as u64);
    let count = n as i64;
    let scalars = [s.decay, s.w1, s.w2, s.step_size, s.bias2_sqrt, s.eps, s.coef].map(|x| x as f32);
    let threads = 256u32;
    let blocks = (n as u64).div_ceil(u64::from(threads)).min(132 * 16) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let mut launch = stream.launch_builder(&f);
    launch.arg(&p).arg(&g).arg(&m).arg(&v).arg(&count);
    for x in &scalars {
        launch.arg(x);
    }
    // SAFETY: the four pointers are live, contiguous device buffers of `n` elements of the
    // kernel's element types on this context's device (checked above), owned by tensors that
    // outlive the launch; the kernel touches indices < n only. It runs on the legacy default
    // stream, after libtorch's queued work on it.
    unsafe { launch.launch(cfg) }.map_err(|e| Error::Kernel(format!("fused AdamW launch: {e:?}")))?;
    Ok(())
}
