//! Per-token log-probs from final hidden states, a chunk of tokens at a time, so the
//! `[tokens, vocab]` logits never exist in f32 all at once — not in the forward pass, and (while
//! `lm_head` is frozen, as with LoRA) not kept for the backward pass either.
//!
//! With a frozen `lm_head` W, `d log p(y | h) / d h = Wᵀ (onehot(y) − softmax(W h))
//! = W[y] − Wᵀ softmax(W h)`, which is computed per chunk without autograd and attached to `h`
//! through the surrogate `lp + ⟨h, g⟩ − stop_grad(⟨h, g⟩)`: its value is `lp`, its gradient with
//! respect to `h` is `g`. Only `g` (tokens × hidden) is kept. When `lm_head` trains (full
//! fine-tune), each chunk goes through plain autograd instead.
//!
//! Per chunk the (C, vocab) work is three passes: the logits GEMM in the model dtype, one fused
//! `log_softmax` to f32 (the log-probs are read from it), and one fused `softmax` in the model
//! dtype feeding the gradient GEMM — no f32 copy of the logits, no separate max/exp/sum/sub.

use tch::{Kind, Tensor};

use super::layers::TchResult;

/// Tokens per chunk through `lm_head` + log-softmax.
pub const LOGPROB_CHUNK_TOKENS: i64 = 1024;

/// log p(targets[n] | hidden[n]) for hidden (N, H) and targets (N,) i64 → (N,) f32.
/// A negative target (e.g. -100 for "no target") yields 0 and no gradient.
pub(crate) fn chunked_logprobs(hidden: &Tensor, lm_head: &Tensor, targets: &Tensor) -> TchResult<Tensor> {
    let n = hidden.size()[0];
    let valid = targets.f_ge(0)?;
    let safe = targets.f_clamp_min(0)?;
    let manual_grad = hidden.requires_grad() && !lm_head.requires_grad();
    let mut values = Vec::new();
    let mut grads = Vec::new();
    let mut start = 0;
    while start < n {
        let len = LOGPROB_CHUNK_TOKENS.min(n - start);
        let h = hidden.f_narrow(0, start, len)?;
        let t = safe.f_narrow(0, start, len)?;
        if manual_grad {
            let (lp, g) = tch::no_grad(|| logprobs_and_hidden_grad(&h, lm_head, &t))?;
            values.push(lp);
            grads.push(g);
        } else {
            values.push(logprobs_of_chunk(&h, lm_head, &t)?);
        }
        start += len;
    }
    let mut lp = Tensor::f_cat(&values, 0)?;
    if manual_grad {
        // (N, H) · (N, H) -> (N,): value 0, gradient g with respect to hidden
        let g = Tensor::f_cat(&grads, 0)?;
        let surrogate = hidden.f_mul(&g)?.f_sum_dim_intlist(-1, false, Kind::Float)?;
        lp = lp.f_add(&surrogate.f_sub(&surrogate.f_detach()?)?)?;
    }
    lp.f_mul(&valid.f_to_kind(Kind::Float)?)
}

/// (C, H), (V, H), (C,) -> (C,) f32 log-probs, differentiable by autograd.
fn logprobs_of_chunk(h: &Tensor, lm_head: &Tensor, targets: &Tensor) -> TchResult<Tensor> {
    // (C, H) -> (C, V) in the model dtype -> log-softmax in f32 (one fused kernel each way)
    let log_probs = h.f_linear::<Tensor>(lm_head, None)?.f_log_softmax(-1, Kind::Float)?;
    log_probs.f_gather(-1, &targets.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)
}

/// Log-probs (C,) f32 and their gradient with respect to `h`, `W[y] − softmax(W h) W` (C, H), for
/// one chunk; no autograd graph.
fn logprobs_and_hidden_grad(h: &Tensor, lm_head: &Tensor, targets: &Tensor) -> TchResult<(Tensor, Tensor)> {
    let logits = h.f_linear::<Tensor>(lm_head, None)?;
    let lp = logits.f_log_softmax(-1, Kind::Float)?.f_gather(-1, &targets.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?;
    // (C, V) @ (V, H) -> (C, H), subtracted from the targets' rows of W
    let expected = logits.f_softmax(-1, logits.kind())?.f_matmul(lm_head)?;
    let g = Tensor::f_embedding(lm_head, targets, -1, false, false)?.f_sub(&expected)?;
    Ok((lp, g))
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

        let ours = chunked_logprobs(&(&leaf * 1.0), &w, &t).unwrap();
        let ours_grad = Tensor::run_backward(&[(&ours * &upstream).sum(Kind::Float)], &[&leaf], false, false);
        let reference = plain(&(&leaf * 1.0), &w, &t);
        let ref_grad = Tensor::run_backward(&[(&reference * &upstream).sum(Kind::Float)], &[&leaf], false, false);

        assert!(ours.allclose(&reference, 1e-5, 1e-5, false));
        assert_eq!(ours.double_value(&[5]), 0.0);
        assert!(ours_grad[0].allclose(&ref_grad[0], 1e-5, 1e-5, false));
    }
}
