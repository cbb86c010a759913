//! Activation checkpointing by staged recomputation (tch has no custom autograd functions).
//!
//! The checkpointed forward runs the decoder layers without autograd, keeping only each layer's
//! input (detached), and hands the final norm a leaf copy of the last layer's output that
//! requires grad: the loss backward stops there. [`CausalLm::finish_checkpointed_backward`] then
//! walks the layers in reverse, recomputing layer `l` from its saved input (as a leaf that
//! requires grad) and backpropagating `⟨out, grad_out⟩`, which accumulates the layer's parameter
//! gradients and yields the gradient of its input, the upstream gradient of layer `l − 1`; last
//! comes the embedding when it trains. Peak activation memory is one layer's graph plus one
//! (B, L, hidden) tensor per layer, at the cost of a second forward through the layers. With
//! offloading ([`super::offload`]) even those live in pinned host memory, one or two on the
//! device at a time.

use tch::{Kind, Tensor};

use super::layers::{RopeTables, TchResult};
use super::offload::{prefetch, to_host, Prefetched};
use super::transformer::{CausalLm, DocumentLayout};

/// What the checkpointed forward keeps for the backward walk.
#[derive(Debug)]
pub(crate) struct SavedActivations {
    input_ids: Tensor,
    rope: RopeTables,
    layout: DocumentLayout,
    /// Input of each decoder layer (the embeddings first), detached; in host memory when
    /// `offloaded_from` names the device they came from.
    layer_inputs: Vec<Tensor>,
    offloaded_from: Option<tch::Device>,
    /// The last layer's output as the leaf the loss backward stops at.
    last_output: Tensor,
}

/// Whether autograd records operations here (false inside `tch::no_grad`). A tiny CPU probe: no
/// device work, no sync.
pub(crate) fn grad_mode_enabled() -> bool {
    let probe = Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    (&probe * 2.0).requires_grad()
}

impl CausalLm {
    /// [`CausalLm::hidden_states`] with the decoder layers run without autograd; returns the
    /// final hidden states (differentiable with respect to the final norm and the leaf) and what
    /// [`CausalLm::finish_checkpointed_backward`] needs. With `offload` the saved layer inputs go
    /// to host memory.
    pub(crate) fn hidden_states_checkpointed(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        layout: DocumentLayout,
        offload: bool,
    ) -> TchResult<(Tensor, SavedActivations)> {
        let (rope, layer_inputs, last) = tch::no_grad(|| -> TchResult<_> {
            let mut x = Tensor::f_embedding(&self.embed_tokens, input_ids, -1, false, false)?;
            let rope = self.rope_tables(position_ids, x.kind())?;
            let mut layer_inputs = Vec::with_capacity(self.layers.len());
            for layer in &self.layers {
                let next = layer.forward(&x, &rope, &layout)?;
                layer_inputs.push(if offload { to_host(&x)? } else { x });
                x = next;
            }
            Ok((rope, layer_inputs, x))
        })?;
        let last_output = last.f_detach()?.set_requires_grad(true);
        let hidden = self.norm.forward(&last_output)?;
        let offloaded_from = offload.then(|| input_ids.device());
        let saved = SavedActivations {
            input_ids: input_ids.shallow_clone(),
            rope,
            layout,
            layer_inputs,
            offloaded_from,
            last_output,
        };
        Ok((hidden, saved))
    }

    /// Completes the backward pass after the loss backward reached `saved.last_output`:
    /// recomputes each layer in reverse and accumulates every trainable gradient below it. Does
    /// nothing when the loss backward did not reach the leaf.
    pub(crate) fn finish_checkpointed_backward(&self, saved: SavedActivations) -> TchResult<()> {
        let mut grad_out = saved.last_output.grad();
        if !grad_out.defined() {
            return Ok(());
        }
        let embed_trains = self.embed_tokens.requires_grad();
        let mut inputs = LayerInputs::new(&saved)?;
        for (l, layer) in self.layers.iter().enumerate().rev() {
            // Layer 0's input gradient only matters for a trainable embedding.
            let needs_input_grad = l > 0 || embed_trains;
            let x = inputs.take(l)?.f_detach()?.set_requires_grad(needs_input_grad);
            let out = layer.forward(&x, &saved.rope, &saved.layout)?;
            if !out.requires_grad() {
                return Ok(()); // nothing below trains
            }
            out.f_mul(&grad_out)?.f_sum(out.kind())?.f_backward()?;
            if !needs_input_grad {
                return Ok(());
            }
            grad_out = x.grad();
        }
        let embeddings = Tensor::f_embedding(&self.embed_tokens, &saved.input_ids, -1, false, false)?;
        embeddings.f_mul(&grad_out)?.f_sum(embeddings.kind())?.f_backward()
    }
}

/// The saved layer inputs in the backward walk's order: read in place, or, when offloaded,
/// waited for and the next one (layer `l − 1`) prefetched while layer `l` recomputes.
struct LayerInputs<'a> {
    saved: &'a SavedActivations,
    /// The prefetch in flight and the layer it is for.
    next: Option<(usize, Prefetched)>,
}

impl<'a> LayerInputs<'a> {
    fn new(saved: &'a SavedActivations) -> TchResult<Self> {
        let last = saved.layer_inputs.len().checked_sub(1);
        let next = match (saved.offloaded_from, last) {
            (Some(device), Some(l)) => Some((l, prefetch(&saved.layer_inputs[l], device)?)),
            _ => None,
        };
        Ok(Self { saved, next })
    }

    /// Layer `l`'s input on the device; called for l = last, last − 1, …, 0.
    fn take(&mut self, l: usize) -> TchResult<Tensor> {
        let Some(device) = self.saved.offloaded_from else { return Ok(self.saved.layer_inputs[l].shallow_clone()) };
        let input = match self.next.take() {
            Some((at, pending)) if at == l => pending.wait()?,
            _ => prefetch(&self.saved.layer_inputs[l], device)?.wait()?,
        };
        if l > 0 {
            self.next = Some((l - 1, prefetch(&self.saved.layer_inputs[l - 1], device)?));
        }
        Ok(input)
    }
}
