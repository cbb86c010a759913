//! Variable-length flash attention (`aten::_flash_attention_forward` with cumulative sequence
//! lengths) through the C shim in csrc/flash_varlen.cpp, which build.rs compiles against the
//! libtorch tch links: one kernel for every document of a packed batch, causal within each,
//! GQA native, no L×L mask. CUDA with bf16/f16 only; elsewhere packed attention runs per
//! segment. The one other `unsafe` module besides kernels/ and collective/nccl.
#![allow(unsafe_code)]

#[cfg(trainq_flash_varlen)]
use std::ffi::{c_char, c_void};

use tch::{Device, Kind, Tensor};

use super::layers::TchResult;

#[cfg(trainq_flash_varlen)]
extern "C" {
    fn trainq_flash_varlen_forward(
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        cu: *const c_void,
        max_len: i64,
        out: *mut *mut c_void,
    ) -> *mut c_char;
}

/// The cumulative segment starts of a packed batch on its device, and its longest segment.
#[derive(Debug)]
pub(crate) struct CuSeqlens {
    /// int32 (N + 1,): 0, l₀, l₀ + l₁, …, B·L.
    cu: Tensor,
    max_len: i64,
}

impl CuSeqlens {
    /// From the segment lengths (read on the host), when the flash kernel can run on `device`
    /// in `kind`; `None` otherwise (no shim built, CPU, f32).
    pub(crate) fn new(lengths: &[i64], device: Device, kind: Kind) -> TchResult<Option<Self>> {
        if !cfg!(trainq_flash_varlen) || !device.is_cuda() || !matches!(kind, Kind::BFloat16 | Kind::Half) {
            return Ok(None);
        }
        let mut starts = Vec::with_capacity(lengths.len() + 1);
        let mut at = 0i32;
        starts.push(at);
        for &len in lengths {
            at += len as i32;
            starts.push(at);
        }
        let cu = Tensor::from_slice(&starts).f_to_device(device)?;
        Ok(Some(Self { cu, max_len: lengths.iter().copied().max().unwrap_or(0) }))
    }
}

/// q (T, H, D), k and v (T, KV, D) with H a multiple of KV, last dim contiguous; returns
/// (T, H, D), each segment of `cu` attending causally within itself.
pub(crate) fn flash_varlen(q: &Tensor, k: &Tensor, v: &Tensor, cu: &CuSeqlens) -> TchResult<Tensor> {
    call(q, k, v, cu)
}

#[cfg(trainq_flash_varlen)]
fn call(q: &Tensor, k: &Tensor, v: &Tensor, cu: &CuSeqlens) -> TchResult<Tensor> {
    let mut out = std::ptr::null_mut();
    // SAFETY: the pointers are live tch tensors (at::Tensor*) for the duration of the call; the
    // shim catches every C++ exception and returns either an error string or a new tensor.
    let error = unsafe {
        trainq_flash_varlen_forward(
            q.as_ptr().cast(),
            k.as_ptr().cast(),
            v.as_ptr().cast(),
            cu.cu.as_ptr().cast(),
            cu.max_len,
            &mut out,
        )
    };
    crate::shim_error::check(error, "flash varlen attention")?;
    // SAFETY: `out` is a `new at::Tensor` the shim handed over; tch frees it on drop.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

#[cfg(not(trainq_flash_varlen))]
fn call(_q: &Tensor, _k: &Tensor, _v: &Tensor, _cu: &CuSeqlens) -> TchResult<Tensor> {
    Err(tch::TchError::Torch("flash varlen attention was not built (no LIBTORCH at build time)".into()))
}
