//! Per-token log-probs from final hidden states, a chunk of tokens at a time, so the
//! `[tokens, vocab]` logits never exist in f32 — not in the forward pass, and not kept for the
//! backward pass either.
//!
//! Per chunk, without autograd: logits `W h` in the model dtype, then their softmax `p` and each
//! token's log-prob in one pass (on CUDA with bf16 one kernel of ours, in place; elsewhere
//! `log_softmax` and `softmax`). From them:
//! - the gradient with respect to `h` (when the layers below train), `g = W[y] − p W`, attached
//!   to `h` through the surrogate `lp + ⟨h, g⟩ − stop_grad(⟨h, g⟩)`: its value is `lp`, its
//!   gradient with respect to `h` is `g` times the upstream gradient of each token;
//! - when `lm_head` itself trains (full fine-tune), `p` is kept and a zero "probe" added to the
//!   log-probs records each token's upstream gradient `c = dL/dlp` during the loss backward;
//!   `PendingLmHeadGrad::apply` (from `Policy::finish_backward`) then forms
//!   `dW = Σ_chunks (onehot(y) − p)ᵀ (c · h)` and accumulates it into `lm_head`'s gradient.
//!
//! Compared with autograd through `log_softmax`, nothing of size (tokens × vocab) is kept in
//! f32, and the vocabulary-wide work is two passes over bf16 per chunk (a full fine-tune's GEMM
//! reads the kept softmax once more).

use tch::{Kind, Tensor};

use super::activation_checkpointing::grad_mode_enabled;
use super::layers::TchResult;

/// Tokens per chunk through `lm_head` + log-softmax.
pub const LOGPROB_CHUNK_TOKENS: i64 = 1024;

/// What `lm_head`'s gradient still needs after the loss backward of a full fine-tune.
#[derive(Debug)]
pub(crate) struct PendingLmHeadGrad {
    /// (N,) f32 zeros added to the log-probs; its gradient is each token's dL/dlp.
    probe: Tensor,
    /// (N, H) hidden states, detached.
    hidden: Tensor,
    /// (N,) targets, clamped to valid ids (invalid ones have zero upstream gradient).
    targets: Tensor,
    /// Per chunk, the (C, vocab) softmax in the model dtype.
    probs: Vec<Tensor>,
}

/// log p(targets[n] | hidden[n]) for hidden (N, H) and targets (N,) i64 → (N,) f32, and, when
/// `lm_head` trains under autograd, what its gradient needs after the backward. A negative
/// target (e.g. -100 for "no target") yields 0 and no gradient.
pub(crate) fn chunked_logprobs(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
) -> TchResult<(Tensor, Option<PendingLmHeadGrad>)> {
    let n = hidden.size()[0];
    let valid = targets.f_ge(0)?;
    let safe = targets.f_clamp_min(0)?;
    let hidden_grad = hidden.requires_grad();
    let head_grad = lm_head.requires_grad() && grad_mode_enabled();
    let mut values = Vec::new();
    let mut grads = Vec::new();
    let mut kept = Vec::new();
    let mut start = 0;
    while start < n {
        let len = LOGPROB_CHUNK_TOKENS.min(n - start);
        let (h, t) = (hidden.f_narrow(0, start, len)?, safe.f_narrow(0, start, len)?);
        tch::no_grad(|| -> TchResult<()> {
            let (lp, probs) =
                softmax_and_logprobs(&h.f_linear::<Tensor>(lm_head, None)?, &t, hidden_grad || head_grad)?;
            values.push(lp);
            let Some(probs) = probs else { return Ok(()) };
            if hidden_grad {
                // W[y] − p W: (C, H)
                grads.push(Tensor::f_embedding(lm_head, &t, -1, false, false)?.f_sub(&probs.f_matmul(lm_head)?)?);
            }
            if head_grad {
                kept.push(probs);
            }
            Ok(())
        })?;
        start += len;
    }
    let mut lp = Tensor::f_cat(&values, 0)?;
    if hidden_grad {
        // (N, H) · (N, H) -> (N,): value 0, gradient g with respect to hidden
        let surrogate = hidden.f_mul(&Tensor::f_cat(&grads, 0)?)?.f_sum_dim_intlist(-1, false, Kind::Float)?;
        lp = lp.f_add(&surrogate.f_sub(&surrogate.f_detach()?)?)?;
    }
    let pending = if head_grad {
        let probe = Tensor::f_zeros([n], (Kind::Float, hidden.device()))?.set_requires_grad(true);
        lp = lp.f_add(&probe)?;
        Some(PendingLmHeadGrad { probe, hidden: hidden.f_detach()?, targets: safe, probs: kept })
    } else {
        None
    };
    Ok((lp.f_mul(&valid.f_to_kind(Kind::Float)?)?, pending))
}

impl PendingLmHeadGrad {
    /// After the loss backward: accumulates `Σ (onehot(y) − p)ᵀ (c · h)` into `lm_head`'s
    /// gradient (nothing if the backward did not reach the log-probs). The `− pᵀ (c · h)` part
    /// is one GEMM per chunk over the kept softmax (no pass that rewrites it); the one-hot part
    /// adds each token's rows of `c · h` to its row of the gradient — summed per chunk by a
    /// small GEMM first, so a token seen many times is rounded once, not once per occurrence.
    pub(crate) fn apply(self, lm_head: &Tensor) -> TchResult<()> {
        let Self { probe, hidden, targets, probs } = self;
        let upstream = probe.grad();
        if !upstream.defined() {
            return Ok(());
        }
        let total = tch::no_grad(|| -> TchResult<Option<Tensor>> {
            // −c · h, (N, H) in the model dtype: the GEMMs below then add, never subtract
            let scaled = hidden.f_mul(&upstream.f_neg()?.f_unsqueeze(-1)?)?.f_to_kind(hidden.kind())?;
            let mut total: Option<Tensor> = None;
            let mut start = 0;
            // each chunk's softmax is freed as soon as its GEMM is queued
            for p in probs {
                let len = p.size()[0];
                let (p, v) = (p.f_transpose(0, 1)?, scaled.f_narrow(0, start, len)?);
                total = Some(match total {
                    None => p.f_matmul(&v)?,
                    Some(mut acc) => acc.f_addmm_(&p, &v)?,
                });
                start += len;
            }
            let Some(mut total) = total else { return Ok(None) };
            let rows = per_token_sums(&scaled, &targets, LOGPROB_CHUNK_TOKENS)?;
            let _ = total.f_index_add_(0, &targets, &rows.f_neg()?)?;
            Ok(Some(total))
        })?;
        let Some(g) = total else { return Ok(()) };
        let mut grad = lm_head.grad();
        if grad.defined() {
            // tied to the embedding, whose gradient the backward already set: add in place
            tch::no_grad(|| grad.f_add_(&g)).map(|_| ())
        } else {
            // d⟨W, G⟩/dW = G: autograd sets W's gradient as it would any other
            lm_head.f_mul(&g)?.f_sum(Kind::Float)?.f_backward()
        }
    }
}

/// Rows (N, H) of `values` summed per target within each chunk of `chunk` tokens: the row of a
/// target's first occurrence in its chunk holds the sum over the chunk's occurrences (one GEMM
/// accumulating in f32), every other row is zero — so `index_add_` of the result by `targets`
/// adds each (chunk, target) once.
fn per_token_sums(values: &Tensor, targets: &Tensor, chunk: i64) -> TchResult<Tensor> {
    let (n, width) = (values.size()[0], values.size()[1]);
    let chunks = (n + chunk - 1) / chunk;
    let pad = chunks * chunk - n;
    // padding: target −1 (equal only to other padding) with zero values
    let device = values.device();
    let t = Tensor::f_cat(&[targets.shallow_clone(), Tensor::f_full([pad], -1, (Kind::Int64, device))?], 0)?;
    let t = t.f_reshape([chunks, chunk])?;
    let v = Tensor::f_cat(&[values.shallow_clone(), Tensor::f_zeros([pad, width], (values.kind(), device))?], 0)?;
    let v = v.f_reshape([chunks, chunk, width])?;
    let same = t.f_unsqueeze(2)?.f_eq_tensor(&t.f_unsqueeze(1)?)?; // (B, C, C)
    let seen_before = same.f_tril(-1)?.f_any_dim(2, false)?; // (B, C)
    let pick = same.f_logical_and(&seen_before.f_logical_not()?.f_unsqueeze(2)?)?.f_to_kind(values.kind())?;
    pick.f_bmm(&v)?.f_reshape([chunks * chunk, width])?.f_narrow(0, 0, n)
}

/// Each row's log-prob of its target (C,) f32 and, if `need_probs`, the softmax (C, V) in the
/// logits' dtype. On CUDA with bf16 logits: our kernel, in place of the logits; otherwise
/// tensor ops.
fn softmax_and_logprobs(logits: &Tensor, targets: &Tensor, need_probs: bool) -> TchResult<(Tensor, Option<Tensor>)> {
    if kernels_run_on(logits) {
        let lp = Tensor::f_empty([logits.size()[0]], (Kind::Float, logits.device()))?;
        crate::kernels::softmax_rows_in_place(logits, &targets.f_contiguous()?, &lp).map_err(kernel_failed)?;
        return Ok((lp, need_probs.then(|| logits.shallow_clone())));
    }
    let lp =
        logits.f_log_softmax(-1, Kind::Float)?.f_gather(-1, &targets.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?;
    let probs = if need_probs { Some(logits.f_softmax(-1, logits.kind())?) } else { None };
    Ok((lp, probs))
}

/// Whether our kernels run on `device` (bf16 on CUDA, compiled there); when they cannot, says
/// so once per process and the tensor-op path runs.
fn kernels_run_on(logits: &Tensor) -> bool {
    if !(logits.device().is_cuda() && logits.kind() == Kind::BFloat16) {
        return false;
    }
    let Some(reason) = crate::kernels::unavailable(logits.device()) else { return true };
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| tracing::warn!("softmax kernels unavailable, using tensor ops: {reason}"));
    false
}

/// A kernel launch that failed although the kernels are available: an error of the step.
fn kernel_failed(err: crate::error::Error) -> tch::TchError {
    tch::TchError::Kind(err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn plain(hidden: &Tensor, w: &Tensor, t: &Tensor) -> Tensor {
        let lp = hidden.linear::<Tensor>(w, None).log_softmax(-1, Kind::Float);
        let valid = t.ge(0).to_kind(Kind::Float);
        lp.gather(-1, &t.clamp_min(0).unsqueeze(-1), false).squeeze_dim(-1) * valid
    }

    #[test]
    fn chunked_log_probs_and_their_gradient_equal_the_plain_computation() {
        tch::manual_seed(3);
        let (n, h, v) = (LOGPROB_CHUNK_TOKENS + 37, 8, 50);
        let w = Tensor::randn([v, h], (Kind::Float, Device::Cpu));
        let leaf = Tensor::randn([n, h], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let t = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
        let _ = t.get(5).fill_(-100);
        let upstream = Tensor::randn([n], (Kind::Float, Device::Cpu));

        let (ours, pending) = chunked_logprobs(&(&leaf * 1.0), &w, &t).unwrap();
        assert!(pending.is_none(), "a frozen lm_head needs no deferred gradient");
        let ours_grad = Tensor::run_backward(&[(&ours * &upstream).sum(Kind::Float)], &[&leaf], false, false);
        let reference = plain(&(&leaf * 1.0), &w, &t);
        let ref_grad = Tensor::run_backward(&[(&reference * &upstream).sum(Kind::Float)], &[&leaf], false, false);

        assert!(ours.allclose(&reference, 1e-5, 1e-5, false));
        assert_eq!(ours.double_value(&[5]), 0.0);
        assert!(ours_grad[0].allclose(&ref_grad[0], 1e-5, 1e-5, false));
    }

    #[test]
    fn a_trained_lm_head_gets_the_plain_gradient_after_apply() {
        tch::manual_seed(4);
        let (n, h, v) = (LOGPROB_CHUNK_TOKENS + 21, 8, 40);
        let w = Tensor::randn([v, h], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let leaf = Tensor::randn([n, h], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let t = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
        let _ = t.get(7).fill_(-100);
        let upstream = Tensor::randn([n], (Kind::Float, Device::Cpu));

        let (ours, pending) = chunked_logprobs(&(&leaf * 1.0), &w, &t).unwrap();
        (&ours * &upstream).sum(Kind::Float).backward();
        pending.expect("a trained lm_head defers its gradient").apply(&w).unwrap();
        let (ours_h, ours_w) = (leaf.grad().copy(), w.grad().copy());

        let (w2, leaf2) = (w.detach().copy().set_requires_grad(true), leaf.detach().copy().set_requires_grad(true));
        let reference = plain(&(&leaf2 * 1.0), &w2, &t);
        (&reference * &upstream).sum(Kind::Float).backward();
        assert!(ours.allclose(&reference, 1e-5, 1e-5, false));
        assert!(ours_h.allclose(&leaf2.grad(), 1e-5, 1e-5, false));
        assert!(
            ours_w.allclose(&w2.grad(), 1e-4, 1e-5, false),
            "max diff {}",
            (&ours_w - w2.grad()).abs().max().double_value(&[])
        );
    }

    #[test]
    fn a_tied_lm_head_adds_its_part_to_the_embedding_gradient() {
        tch::manual_seed(5);
        let (n, h, v) = (LOGPROB_CHUNK_TOKENS + 9, 8, 30);
        let w = Tensor::randn([v, h], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let ids = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
        let t = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
        let upstream = Tensor::randn([n], (Kind::Float, Device::Cpu));

        // the hidden states come from the same matrix, as with tied embeddings
        let (ours, pending) = chunked_logprobs(&Tensor::embedding(&w, &ids, -1, false, false), &w, &t).unwrap();
        (&ours * &upstream).sum(Kind::Float).backward();
        assert!(w.grad().defined(), "the embedding's part is there before apply");
        pending.expect("a trained lm_head defers its gradient").apply(&w).unwrap();

        let w2 = w.detach().copy().set_requires_grad(true);
        let reference = plain(&Tensor::embedding(&w2, &ids, -1, false, false), &w2, &t);
        (&reference * &upstream).sum(Kind::Float).backward();
        assert!(
            w.grad().allclose(&w2.grad(), 1e-4, 1e-5, false),
            "max diff {}",
            (w.grad() - w2.grad()).abs().max().double_value(&[])
        );
    }
}
