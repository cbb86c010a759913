//! Projections that read the same input, run as one: q/k/v (and gate/up) become one GEMM over
//! their stacked weights, and their LoRA adapters one low-rank GEMM pair, so the input is read
//! once and its gradient comes back from one GEMM instead of being summed from six.
//!
//! Each member keeps its own HF-named variables. When the base weights are frozen (LoRA) they are
//! views into one stacked tensor made once at construction, so loading a checkpoint into them
//! fills the stack; when they train (full fine-tune) the stack is concatenated per forward (a
//! copy of the weights, small next to the GEMM) and the gradient flows back to each member.

use std::sync::atomic::Ordering;

use tch::Tensor;

use super::layers::{project, Linear, LoraAdapter, LowRank, TchResult};

/// Several [`Linear`]s of the same input width, computed as one.
#[derive(Debug)]
pub(crate) struct FusedLinear {
    members: Vec<Linear>,
    /// (Σ out, in): the members' frozen weights, which are views into it; `None` when they train.
    stacked_weight: Option<Tensor>,
    /// (Σ out,): likewise for their biases.
    stacked_bias: Option<Tensor>,
}

impl FusedLinear {
    /// Joins `members` (same input width, all with or all without bias); with `frozen` the
    /// members' weights and biases are moved into one stacked tensor each.
    pub(crate) fn new(members: Vec<Linear>, frozen: bool) -> TchResult<Self> {
        if !frozen {
            return Ok(Self { members, stacked_weight: None, stacked_bias: None });
        }
        let stacked_weight = stack_in_place(members.iter().map(|m| m.weight.shallow_clone()).collect())?;
        let biases: Option<Vec<Tensor>> = members.iter().map(|m| m.bias.as_ref().map(Tensor::shallow_clone)).collect();
        let stacked_bias = biases.map(stack_in_place).transpose()?;
        Ok(Self { members, stacked_weight: Some(stacked_weight), stacked_bias })
    }

    /// (…, in) -> (…, Σ out), the members' outputs side by side in their order; with `fused`
    /// through the projection op of `model::fused_ops` (CUDA, bf16).
    pub(crate) fn forward(&self, x: &Tensor, fused: bool) -> TchResult<Tensor> {
        let cat = |parts: Vec<&Tensor>| Tensor::f_cat(&parts, 0);
        let weight = match &self.stacked_weight {
            Some(w) => w.shallow_clone(),
            None => cat(self.members.iter().map(|m| &m.weight).collect())?,
        };
        let bias = match &self.stacked_bias {
            Some(b) => Some(b.shallow_clone()),
            None if self.members.iter().all(|m| m.bias.is_some()) => {
                Some(cat(self.members.iter().filter_map(|m| m.bias.as_ref()).collect())?)
            }
            None => None,
        };
        project(x, &weight, bias.as_ref(), self.stacked_adapter()?.as_ref(), fused)
    }

    /// The enabled adapters as one: their A stacked (k·r, in) and the block-diagonal (Σ out, k·r)
    /// of their B (zero rows for members without an adapter), so that `s · (x Aᵀ) Bᵀ` is every
    /// member's LoRA term side by side. `None` when no adapter is enabled.
    fn stacked_adapter(&self) -> TchResult<Option<LowRank>> {
        let adapters: Vec<Option<&LoraAdapter>> =
            self.members.iter().map(|m| m.lora.as_ref().filter(|l| l.enabled.load(Ordering::Relaxed))).collect();
        let active: Vec<&LoraAdapter> = adapters.iter().flatten().copied().collect();
        let Some(first) = active.first() else { return Ok(None) };
        let a = Tensor::f_cat(&active.iter().map(|l| &l.lora_a).collect::<Vec<_>>(), 0)?;
        // (out, r) per adapter, (out, 0) for a member without one: one block_diag op (a zero fill
        // and a copy per block) instead of a padded copy per member and a concatenation.
        let blocks = self
            .members
            .iter()
            .zip(&adapters)
            .map(|(member, adapter)| match adapter {
                Some(l) => Ok(l.lora_b.shallow_clone()),
                None => Tensor::f_zeros([member.weight.size()[0], 0], (a.kind(), a.device())),
            })
            .collect::<TchResult<Vec<_>>>()?;
        Ok(Some(LowRank { a, b: Tensor::f_block_diag(&blocks)?, scale: first.scale }))
    }
}

/// Concatenates `parts` along their first dim into one new tensor and re-points each part at its
/// rows of it (`set_data`): the parts keep their identity (and their names in the var store),
/// their storage becomes the stack.
fn stack_in_place(parts: Vec<Tensor>) -> TchResult<Tensor> {
    let stacked = tch::no_grad(|| Tensor::f_cat(&parts, 0))?;
    let mut start = 0;
    for mut part in parts {
        let rows = part.size()[0];
        part.f_set_data(&stacked.f_narrow(0, start, rows)?)?;
        start += rows;
    }
    Ok(stacked)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    use tch::nn::VarStore;
    use tch::{Device, Kind, Tensor};

    use super::FusedLinear;
    use crate::model::layers::{Init, Linear, LoraSpec};

    #[test]
    fn a_stacked_projection_with_adapters_on_some_members_equals_its_members_one_by_one() {
        let vs = VarStore::new(Device::Cpu);
        let init = Init { kind: Kind::Float, base_trainable: false, random: true, std: 0.5 };
        let targets = vec!["q_proj".to_string(), "v_proj".to_string()];
        let spec = LoraSpec { rank: 2, scale: 2.0, targets, enabled: Arc::new(AtomicBool::new(true)) };
        let member = |name: &str, out: i64| Linear::new(&vs.root() / name, 8, out, true, &init, Some(&spec)).unwrap();
        let members = vec![member("q_proj", 6), member("k_proj", 4), member("v_proj", 4)];
        for adapter in members.iter().filter_map(|m| m.lora.as_ref()) {
            let _ = tch::no_grad(|| adapter.lora_b.shallow_clone().uniform_(-0.5, 0.5));
        }
        let fused = FusedLinear::new(members, true).unwrap();
        let x = Tensor::randn([3, 5, 8], (Kind::Float, Device::Cpu));
        let expected =
            Tensor::cat(&fused.members.iter().map(|m| m.forward(&x, false).unwrap()).collect::<Vec<_>>(), -1);
        let y = fused.forward(&x, false).unwrap();
        assert_eq!(y.size(), [3, 5, 14]);
        assert!(y.allclose(&expected, 1e-5, 1e-5, false), "stacked {y} vs members {expected}");
        // The members' frozen weights are views into the stack: filling one fills the stack.
        let k_weight = fused.members[1].weight.shallow_clone();
        let _ = tch::no_grad(|| k_weight.shallow_clone().fill_(3.0));
        let stacked = fused.stacked_weight.as_ref().unwrap();
        assert_eq!(stacked.narrow(0, 6, 4).min().double_value(&[]), 3.0);
        assert!(stacked.narrow(0, 0, 6).abs().max().double_value(&[]) < 3.0);
    }
}
