//! cuDNN's ragged (THD) attention for packed documents through the C shim in
//! csrc/cudnn_varlen.cpp: causal within each document, GQA native, q/k/v read where the q/k/v
//! kernel wrote them. Like flash varlen, but on cuDNN's Hopper kernels (2.2× flash varlen's
//! FLOP rate on an H200, ops/bench/RESULTS.md). cuDNN builds one graph per shape, so a batch's
//! document count, longest document and token count are rounded up to buckets ([`Buckets`]);
//! documents past the real ones have length 0. A shape cuDNN declines (an older GPU, an older
//! cuDNN) fails in the forward, and the caller takes flash varlen from then on. One of the few
//! `unsafe` modules.
#![allow(unsafe_code)]

#[cfg(trainq_cudnn_varlen)]
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};

use super::layers::TchResult;

#[cfg(trainq_cudnn_varlen)]
extern "C" {
    fn trainq_cudnn_varlen_forward(
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        seq: *const c_void,
        offsets: *const c_void,
        b: i64,
        s: i64,
        t: i64,
        out: *mut *mut c_void,
    ) -> *mut c_char;
}

/// Set once cuDNN declined a graph: packed attention takes flash varlen for the rest of the run.
static DECLINED: AtomicBool = AtomicBool::new(false);

/// The graph shape a packed batch runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Buckets {
    /// Documents, rounded up to a power of two (at least 8).
    pub(crate) docs: i64,
    /// The longest document, rounded up to a power of two (at least 128).
    pub(crate) longest: i64,
    /// Tokens, rounded up to a power of two (cuDNN sizes the backward's workspace by it).
    pub(crate) tokens: i64,
}

impl Buckets {
    pub(crate) fn of(lengths: &[i64]) -> Self {
        let round = |n: i64, min: i64| (n.max(min) as u64).next_power_of_two() as i64;
        Self {
            docs: round(lengths.len() as i64, 8),
            longest: round(lengths.iter().copied().max().unwrap_or(0), 128),
            tokens: round(lengths.iter().sum(), 1),
        }
    }
}

/// The shim's inputs on the host: the lengths padded with zeros to `docs` (int32), and the
/// documents' starts in elements for q, k, v and the softmax statistics, one row each of
/// `docs + 1` (int64). `strides` are the four tensors' elements per token.
pub(crate) fn ragged_inputs(lengths: &[i64], docs: i64, strides: [i64; 4]) -> (Vec<i32>, Vec<i64>) {
    let mut seq: Vec<i32> = lengths.iter().map(|&n| n as i32).collect();
    seq.resize(docs as usize, 0);
    let mut starts = Vec::with_capacity(docs as usize + 1);
    let mut at = 0i64;
    starts.push(0);
    for &n in &seq {
        at += n as i64;
        starts.push(at);
    }
    let offsets = strides.iter().flat_map(|&stride| starts.iter().map(move |&s| s * stride)).collect();
    (seq, offsets)
}

/// A packed batch's documents, for cuDNN: the lengths, and (built at the first layer, shared by
/// the rest) their device tensors.
#[derive(Debug)]
pub(crate) struct RaggedBatch {
    lengths: Vec<i64>,
    buckets: Buckets,
    device: Device,
    inputs: OnceLock<RaggedTensors>,
}

#[derive(Debug)]
struct RaggedTensors {
    /// Elements per token of q, k, v and the statistics the tensors were built for.
    strides: [i64; 4],
    /// int32 (docs,).
    seq: Tensor,
    /// int64 (4, docs + 1).
    offsets: Tensor,
}

impl RaggedBatch {
    /// From the segment lengths (read on the host), when the shim is built, `device` is CUDA,
    /// `kind` bf16/f16 and cuDNN has not declined a graph in this process; `None` otherwise.
    pub(crate) fn new(lengths: &[i64], device: Device, kind: Kind) -> Option<Self> {
        let usable =
            cfg!(trainq_cudnn_varlen) && device.is_cuda() && matches!(kind, Kind::BFloat16 | Kind::Half) && !declined();
        usable.then(|| Self {
            lengths: lengths.to_vec(),
            buckets: Buckets::of(lengths),
            device,
            inputs: OnceLock::new(),
        })
    }

    fn inputs(&self, strides: [i64; 4]) -> TchResult<&RaggedTensors> {
        if let Some(inputs) = self.inputs.get() {
            if inputs.strides == strides {
                return Ok(inputs);
            }
            return Err(tch::TchError::Torch("cuDNN varlen attention: layers of one batch differ in shape".into()));
        }
        let (seq, offsets) = ragged_inputs(&self.lengths, self.buckets.docs, strides);
        let seq = Tensor::from_slice(&seq).f_to_device(self.device)?;
        let offsets = Tensor::from_slice(&offsets).f_view([4, self.buckets.docs + 1])?.f_to_device(self.device)?;
        Ok(self.inputs.get_or_init(|| RaggedTensors { strides, seq, offsets }))
    }
}

/// Whether cuDNN declined a graph in this process.
pub(crate) fn declined() -> bool {
    DECLINED.load(Ordering::Relaxed)
}

/// Sends the rest of the run to flash varlen after an error from [`cudnn_varlen`], and says so
/// once.
pub(crate) fn decline(error: &tch::TchError) {
    if !DECLINED.swap(true, Ordering::Relaxed) {
        tracing::warn!("cuDNN ragged attention unavailable, packed attention uses flash varlen: {error}");
    }
}

/// q (T, H, D) and k (T, KV, D) contiguous, v (T, KV, D) with contiguous heads (any row
/// stride); returns (T, H, D), each document of `batch` attending causally within itself.
pub(crate) fn cudnn_varlen(q: &Tensor, k: &Tensor, v: &Tensor, batch: &RaggedBatch) -> TchResult<Tensor> {
    let (heads, kv_heads, dim) = (q.size()[1], k.size()[1], q.size()[2]);
    let inputs = batch.inputs([heads * dim, kv_heads * dim, v.stride()[0], heads])?;
    call(q, k, v, inputs, batch.buckets)
}

#[cfg(trainq_cudnn_varlen)]
fn call(q: &Tensor, k: &Tensor, v: &Tensor, inputs: &RaggedTensors, buckets: Buckets) -> TchResult<Tensor> {
    let mut out = std::ptr::null_mut();
    // SAFETY: the pointers are live tch tensors (at::Tensor*) for the duration of the call; the
    // shim catches every C++ exception and returns either an error string or a new tensor.
    let error = unsafe {
        trainq_cudnn_varlen_forward(
            q.as_ptr().cast(),
            k.as_ptr().cast(),
            v.as_ptr().cast(),
            inputs.seq.as_ptr().cast(),
            inputs.offsets.as_ptr().cast(),
            buckets.docs,
            buckets.longest,
            buckets.tokens,
            &mut out,
        )
    };
    crate::shim_error::check(error, "cuDNN varlen attention")?;
    // SAFETY: `out` is a `new at::Tensor` the shim handed over; tch frees it on drop.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

#[cfg(not(trainq_cudnn_varlen))]
fn call(_q: &Tensor, _k: &Tensor, _v: &Tensor, _inputs: &RaggedTensors, _buckets: Buckets) -> TchResult<Tensor> {
    Err(tch::TchError::Torch("cuDNN varlen attention was not built (no cudnn frontend headers)".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up_to_powers_of_two_with_floors() {
        let b = Buckets::of(&[700, 2100, 1296]);
        assert_eq!(b, Buckets { docs: 8, longest: 4096, tokens: 4096 });
        let b = Buckets::of(&[100; 9]);
        assert_eq!(b, Buckets { docs: 16, longest: 128, tokens: 1024 });
        let b = Buckets::of(&[4096, 4096, 4096, 4096, 1]);
        assert_eq!(b, Buckets { docs: 8, longest: 4096, tokens: 32768 });
    }

    #[test]
    fn ragged_inputs_pad_with_empty_documents_and_scale_starts_per_tensor() {
        let (seq, offsets) = ragged_inputs(&[3, 5], 4, [32, 16, 64, 2]);
        assert_eq!(seq, vec![3, 5, 0, 0]);
        // starts 0, 3, 8, 8, 8 times each stride, row by row
        let starts = [0i64, 3, 8, 8, 8];
        let expected: Vec<i64> = [32i64, 16, 64, 2].iter().flat_map(|&s| starts.iter().map(move |&x| x * s)).collect();
        assert_eq!(offsets, expected);
    }
}
