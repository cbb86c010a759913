//! Activation offloading: the layer inputs that activation checkpointing keeps go to pinned host
//! memory during the forward and come back one layer ahead of the backward walk, both copies on
//! a side stream so they overlap with compute (csrc/offload.cpp, compiled by build.rs against
//! the libtorch tch links). Without the shim, or off CUDA, the copies are plain synchronous
//! `to_device` calls: the same results, no overlap. [`upload`] is the batch's host→device copy
//! that does not wait for the queued work. One of the few `unsafe` modules (with
//! kernels/, collective/nccl, flash_varlen and cudnn_varlen).
#![allow(unsafe_code)]

#[cfg(trainq_shim)]
use std::ffi::c_char;
use std::ffi::c_void;

use tch::{Device, Tensor};

use super::layers::TchResult;

#[cfg(trainq_shim)]
extern "C" {
    fn trainq_offload_to_host(src: *const c_void, out: *mut *mut c_void) -> *mut c_char;
    fn trainq_offload_prefetch(
        host: *const c_void,
        index: i64,
        out: *mut *mut c_void,
        ready: *mut *mut c_void,
    ) -> *mut c_char;
    fn trainq_offload_wait(ready: *mut c_void, index: i64) -> *mut c_char;
    fn trainq_offload_forget(ready: *mut c_void);
    fn trainq_upload(src: *const c_void, index: i64, out: *mut *mut c_void) -> *mut c_char;
}

/// Starts moving `t` to host memory (pinned, asynchronous on CUDA) and returns the host tensor.
pub(crate) fn to_host(t: &Tensor) -> TchResult<Tensor> {
    match t.device() {
        #[cfg(trainq_shim)]
        Device::Cuda(_) => {
            let mut out = std::ptr::null_mut();
            // SAFETY: `t` is a live tch tensor (at::Tensor*) for the call; the shim catches every
            // C++ exception and returns an error string or a new tensor.
            check(unsafe { trainq_offload_to_host(t.as_ptr().cast(), &mut out) })?;
            // SAFETY: `out` is a `new at::Tensor` handed over to us; tch frees it on drop.
            Ok(unsafe { Tensor::from_ptr(out.cast()) })
        }
        _ => t.f_to_device(Device::Cpu),
    }
}

/// Copies host tensor `t` to `device` without waiting for the work already queued there (CUDA:
/// pinned staging, on the current stream); elsewhere a plain `to_device`. For a step's batch
/// fields, so the host goes on to launch the forward while the previous step's update runs.
pub(crate) fn upload(t: &Tensor, device: Device) -> TchResult<Tensor> {
    match device {
        #[cfg(trainq_shim)]
        Device::Cuda(index) if t.device() == Device::Cpu => {
            let mut out = std::ptr::null_mut();
            // SAFETY: `t` is a live tch tensor for the call; the shim catches every C++ exception
            // and returns an error string or a new tensor.
            check(unsafe { trainq_upload(t.as_ptr().cast(), index as i64, &mut out) })?;
            // SAFETY: `out` is a `new at::Tensor` handed over to us; tch frees it on drop.
            Ok(unsafe { Tensor::from_ptr(out.cast()) })
        }
        _ => t.f_to_device(device),
    }
}

/// A layer input on its way back to the device; [`Prefetched::wait`] before using it.
#[derive(Debug)]
pub(crate) struct Prefetched {
    tensor: Tensor,
    /// The shim's event on the side stream, with the device index (CUDA only).
    ready: Option<(*mut c_void, i64)>,
}

// SAFETY: the event pointer is owned by this value alone and used from one thread at a time.
unsafe impl Send for Prefetched {}

/// Starts copying host tensor `host` (from [`to_host`]) back to `device`.
pub(crate) fn prefetch(host: &Tensor, device: Device) -> TchResult<Prefetched> {
    match device {
        #[cfg(trainq_shim)]
        Device::Cuda(index) => {
            let (mut out, mut ready) = (std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: as in `to_host`; on success the shim hands over a new tensor and an event.
            check(unsafe { trainq_offload_prefetch(host.as_ptr().cast(), index as i64, &mut out, &mut ready) })?;
            // SAFETY: `out` is a `new at::Tensor` handed over to us.
            let tensor = unsafe { Tensor::from_ptr(out.cast()) };
            Ok(Prefetched { tensor, ready: Some((ready, index as i64)) })
        }
        _ => Ok(Prefetched { tensor: host.f_to_device(device)?, ready: None }),
    }
}

impl Prefetched {
    /// Makes the device's current stream wait for the copy and returns the tensor.
    pub(crate) fn wait(mut self) -> TchResult<Tensor> {
        #[cfg(trainq_shim)]
        if let Some((ready, index)) = self.ready.take() {
            // SAFETY: `ready` came from trainq_offload_prefetch and is consumed here, once.
            check(unsafe { trainq_offload_wait(ready, index) })?;
        }
        Ok(self.tensor.shallow_clone())
    }
}

impl Drop for Prefetched {
    fn drop(&mut self) {
        #[cfg(trainq_shim)]
        if let Some((ready, _)) = self.ready.take() {
            // SAFETY: an event nothing waited for, freed once.
            unsafe { trainq_offload_forget(ready) };
        }
    }
}

#[cfg(trainq_shim)]
fn check(error: *mut c_char) -> TchResult<()> {
    crate::shim_error::check(error, "activation offloading")
}
