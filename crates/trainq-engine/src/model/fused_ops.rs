//! The decoder layer's fused ops with their own autograd (csrc/fused_ops.cpp, whose forward and
//! backward launch `kernels::fused` or libtorch GEMMs): per-head q/k RMSNorm + RoPE from the fused
//! q/k/v projection, SwiGLU from the fused gate/up projection, projections with their LoRA
//! adapter whose input gradient is one GEMM plus an epilogue, and a residual add with the
//! RMSNorm after it. On CUDA in bf16 when the
//! shim was built and the kernels compile; [`available`] says when, and the layers fall back to
//! the tensor-op composites otherwise. One of the few `unsafe` modules (shim calls).
#![allow(unsafe_code)]

#[cfg(trainq_shim)]
use std::ffi::{c_char, c_void};
#[cfg(trainq_shim)]
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};

use super::layers::{LowRank, TchResult};

#[cfg(trainq_shim)]
extern "C" {
    fn trainq_fused_register(table: *const crate::kernels::FusedLaunchers, blocks: i64);
    #[allow(clippy::too_many_arguments)]
    fn trainq_qkv_norm_rope(
        qkv: *const c_void,
        q_weight: *const c_void,
        k_weight: *const c_void,
        cos: *const c_void,
        sin: *const c_void,
        heads: i64,
        kv_heads: i64,
        eps: f64,
        q: *mut *mut c_void,
        k: *mut *mut c_void,
        v: *mut *mut c_void,
    ) -> *mut c_char;
    fn trainq_swiglu(gate_up: *const c_void, out: *mut *mut c_void) -> *mut c_char;
    fn trainq_add_rms_norm(
        x: *const c_void,
        h: *const c_void,
        weight: *const c_void,
        eps: f64,
        s: *mut *mut c_void,
        n: *mut *mut c_void,
    ) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    fn trainq_projection(
        x: *const c_void,
        weight: *const c_void,
        bias: *const c_void,
        a: *const c_void,
        b: *const c_void,
        scale: f64,
        input: i32,
        out: *mut *mut c_void,
    ) -> *mut c_char;
}

/// Whether the fused ops can run on `device` in `kind`: CUDA, bf16, the shim built, and the
/// kernels compiled (once per process; the launchers are registered with the shim then).
pub(crate) fn available(device: Device, kind: Kind) -> bool {
    #[cfg(trainq_shim)]
    {
        static REGISTERED: OnceLock<bool> = OnceLock::new();
        if kind != Kind::BFloat16 || !device.is_cuda() {
            return false;
        }
        *REGISTERED.get_or_init(|| {
            let ok = crate::kernels::unavailable(device).is_none();
            if ok {
                // SAFETY: a 'static table of extern "C" functions with the layout the shim declares.
                unsafe {
                    trainq_fused_register(&crate::kernels::FUSED_LAUNCHERS, crate::kernels::NORM_GRAD_BLOCKS as i64)
                };
            }
            ok
        })
    }
    #[cfg(not(trainq_shim))]
    {
        let _ = (device, kind);
        false
    }
}

/// What [`qkv_norm_rope`] needs besides the projection output.
#[derive(Debug)]
pub(crate) struct QkvSpec<'a> {
    /// (D,) q/k norm weights (Qwen3), or `None`.
    pub(crate) norms: Option<(&'a Tensor, &'a Tensor)>,
    /// (N, D) cos and sin in the model dtype.
    pub(crate) cos_sin: (&'a Tensor, &'a Tensor),
    pub(crate) heads: i64,
    pub(crate) kv_heads: i64,
    pub(crate) eps: f64,
}

/// qkv (N, (H + 2·KV)·D) -> q (N, H, D), k and v (N, KV, D): q and k normed per head (when
/// `norms`) and rotated; v is a view of qkv's v columns (rows (H + 2·KV)·D apart), not a copy.
pub(crate) fn qkv_norm_rope(qkv: &Tensor, spec: &QkvSpec<'_>) -> TchResult<(Tensor, Tensor, Tensor)> {
    #[cfg(trainq_shim)]
    {
        let qkv = qkv.f_contiguous()?;
        let (cos, sin) = (spec.cos_sin.0.f_contiguous()?, spec.cos_sin.1.f_contiguous()?);
        let norms = match spec.norms {
            Some((q, k)) => Some((q.f_contiguous()?, k.f_contiguous()?)),
            None => None,
        };
        let (mut q, mut k, mut v) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: every pointer is a live tch tensor (at::Tensor*) or null for the call; the shim
        // catches every C++ exception and returns an error string or three new tensors.
        check(unsafe {
            trainq_qkv_norm_rope(
                qkv.as_ptr().cast(),
                optional_ptr(norms.as_ref().map(|n| &n.0)),
                optional_ptr(norms.as_ref().map(|n| &n.1)),
                cos.as_ptr().cast(),
                sin.as_ptr().cast(),
                spec.heads,
                spec.kv_heads,
                spec.eps,
                &mut q,
                &mut k,
                &mut v,
            )
        })?;
        // SAFETY: three `new at::Tensor`s handed over to us; tch frees them on drop.
        Ok(unsafe { (Tensor::from_ptr(q.cast()), Tensor::from_ptr(k.cast()), Tensor::from_ptr(v.cast())) })
    }
    #[cfg(not(trainq_shim))]
    {
        let _ = (qkv, spec);
        Err(not_built())
    }
}

/// gate_up (N, 2I) -> silu(gate) · up (N, I).
pub(crate) fn swiglu(gate_up: &Tensor) -> TchResult<Tensor> {
    #[cfg(trainq_shim)]
    {
        let gate_up = gate_up.f_contiguous()?;
        let mut out = std::ptr::null_mut();
        // SAFETY: as in `qkv_norm_rope`.
        check(unsafe { trainq_swiglu(gate_up.as_ptr().cast(), &mut out) })?;
        // SAFETY: a `new at::Tensor` handed over to us.
        Ok(unsafe { Tensor::from_ptr(out.cast()) })
    }
    #[cfg(not(trainq_shim))]
    {
        let _ = gate_up;
        Err(not_built())
    }
}

/// Whether [`add_rms_norm`] takes rows of `width` (a multiple of 8 up to the kernels' widest).
pub(crate) fn add_rms_norm_fits(width: i64) -> bool {
    width % 8 == 0 && width <= crate::kernels::ADD_NORM_MAX_WIDTH
}

/// x, h (rows, W) -> (x + h, RMSNorm(x + h) · weight) as one autograd node: one pass each way,
/// the backward adding the residual path's gradient to the norm's.
pub(crate) fn add_rms_norm(x: &Tensor, h: &Tensor, weight: &Tensor, eps: f64) -> TchResult<(Tensor, Tensor)> {
    #[cfg(trainq_shim)]
    {
        let (x, h) = (x.f_contiguous()?, h.f_contiguous()?);
        let (mut s, mut n) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: as in `qkv_norm_rope`.
        check(unsafe {
            trainq_add_rms_norm(x.as_ptr().cast(), h.as_ptr().cast(), weight.as_ptr().cast(), eps, &mut s, &mut n)
        })?;
        // SAFETY: two `new at::Tensor`s handed over to us.
        Ok(unsafe { (Tensor::from_ptr(s.cast()), Tensor::from_ptr(n.cast())) })
    }
    #[cfg(not(trainq_shim))]
    {
        let _ = (x, h, weight, eps);
        Err(not_built())
    }
}

/// What [`projection`] reads: its input as it is, or `silu(gate) · up` of a fused gate/up
/// output (rows, 2·in), which the backward either computes again from gate/up (less activation
/// memory: only gate/up is kept) or takes from the forward (less time: one elementwise pass a
/// layer less, (rows, in) more memory). The values are the shim's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProjectionInput {
    Plain = 0,
    SwiGluRecomputed = 1,
    SwiGluKept = 2,
}

/// `x Wᵀ + b + s · (x Aᵀ) Bᵀ` for x (rows, in) with an optional adapter, as one autograd node
/// whose backward adds the adapter's input gradient into the base one in its GEMM's epilogue;
/// `input` says whether it reads x or `silu(gate) · up` of it.
pub(crate) fn projection(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    lora: Option<&LowRank>,
    input: ProjectionInput,
) -> TchResult<Tensor> {
    #[cfg(trainq_shim)]
    {
        let x = x.f_contiguous()?;
        let mut out = std::ptr::null_mut();
        // SAFETY: as in `qkv_norm_rope`.
        check(unsafe {
            trainq_projection(
                x.as_ptr().cast(),
                weight.as_ptr().cast(),
                optional_ptr(bias),
                optional_ptr(lora.map(|l| &l.a)),
                optional_ptr(lora.map(|l| &l.b)),
                lora.map_or(1.0, |l| l.scale),
                input as i32,
                &mut out,
            )
        })?;
        // SAFETY: a `new at::Tensor` handed over to us.
        Ok(unsafe { Tensor::from_ptr(out.cast()) })
    }
    #[cfg(not(trainq_shim))]
    {
        let _ = (x, weight, bias, lora, input);
        Err(not_built())
    }
}

#[cfg(trainq_shim)]
fn check(error: *mut c_char) -> TchResult<()> {
    crate::shim_error::check(error, "fused op")
}

/// The shim's pointer to an optional tensor: the tensor, or null.
#[cfg(trainq_shim)]
fn optional_ptr(t: Option<&Tensor>) -> *const c_void {
    t.map_or(std::ptr::null(), |t| t.as_ptr().cast())
}

#[cfg(not(trainq_shim))]
fn not_built() -> tch::TchError {
    tch::TchError::Torch("the fused ops were not built (no LIBTORCH at build time)".into())
}
