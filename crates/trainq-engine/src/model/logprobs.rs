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
//!   `dW = Σ_chunks (c · (onehot(y) − p))ᵀ h` and accumulates it into `lm_head`'s gradient.
//!
//! Compared with autograd through `log_softmax`, nothing of size (tokens × vocab) is kept in
//! f32, and the vocabulary-wide work is two or three passes over bf16 per chunk.

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
    /// After the loss backward: accumulates `Σ (c · (onehot(y) − p))ᵀ h` into `lm_head`'s
    /// gradient (nothing if the backward did not reach the log-probs).
    pub(crate) fn apply(self, lm_head: &Tensor) -> TchResult<()> {
        let upstream = self.probe.grad();
        if !upstream.defined() {
            return Ok(());
        }
        let total = tch::no_grad(|| -> TchResult<Option<Tensor>> {
            let mut total: Option<Tensor> = None;
            let mut start = 0;
            for probs in self.probs {
                let len = probs.size()[0];
                let (t, c) = (self.targets.f_narrow(0, start, len)?, upstream.f_narrow(0, start, len)?);
                let d = onehot_minus_scaled(probs, &t, &c)?.f_transpose(0, 1)?;
                let h = self.hidden.f_narrow(0, start, len)?;
                total = Some(match total {
                    None => d.f_matmul(&h)?,
                    Some(mut acc) => acc.f_addmm_(&d, &h)?,
                });
                start += len;
            }
            Ok(total)
        })?;
        match total {
            // d⟨W, G⟩/dW = G, accumulated into W's gradient like any other contribution
            Some(g) => lm_head.f_mul(&g)?.f_sum(Kind::Float)?.f_backward(),
            None => Ok(()),
        }
    }
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

/// `c · (onehot(targets) − probs)` row by row, (C, V) in the probabilities' dtype (in place on
/// CUDA with bf16).
fn onehot_minus_scaled(probs: Tensor, targets: &Tensor, coef: &Tensor) -> TchResult<Tensor> {
    if kernels_run_on(&probs) {
        crate::kernels::onehot_minus_scaled_in_place(&probs, &targets.f_contiguous()?, &coef.f_contiguous()?)
            .map_err(kernel_failed)?;
        return Ok(probs);
    }
    let c = coef.f_unsqueeze(-1)?;
    let mut d = probs.f_mul(&c.f_neg()?.f_to_kind(probs.kind())?)?;
    d.f_scatter_add_(-1, &targets.f_unsqueeze(-1)?, &c.f_to_kind(probs.kind())?)
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
}
