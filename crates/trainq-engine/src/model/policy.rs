//! The trainable policy: a transformer loaded from an HF directory (or randomly initialized),
//! optional LoRA adapters, per-token log-probs, and access to its variables for the optimizer.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tch::{nn::VarStore, Device, Kind, Tensor};

use super::activation_checkpointing::{grad_mode_enabled, SavedActivations};
use super::hf_config::HfConfig;
use super::layers::{Init, LoraSpec, TchResult};
use super::logprobs::{chunked_logprobs, PendingLmHeadGrad};
use super::transformer::{segment_lengths, CausalLm, DocumentLayout, PackedAttention};
use super::weights::{fill_variables, weight_files};
use crate::error::{Error, Result};
use trainq_queue::config::{LoraConfig, TrainConfig};

/// A causal language model ready to score and train: bf16 on CUDA, f32 on CPU.
///
/// Variable names equal HF keys (`model.layers.0.self_attn.q_proj.weight`); LoRA variables add
/// `lora_A.weight` / `lora_B.weight` under the projection they adapt, as PEFT names them.
#[derive(Debug)]
pub struct Policy {
    vs: VarStore,
    cfg: HfConfig,
    lm: CausalLm,
    lora: Option<LoraConfig>,
    lora_enabled: Arc<AtomicBool>,
    kind: Kind,
    activation_checkpointing: bool,
    /// With activation checkpointing, the saved layer inputs live in pinned host memory.
    activation_offloading: bool,
    packed_attention: PackedAttention,
    /// Logits are divided by this before the softmax (the sampler's temperature; 1 = none).
    temperature: f64,
    /// The last activation-checkpointed forward's activations and whether LoRA was on, until
    /// [`Policy::finish_backward`].
    saved: Mutex<Option<(SavedActivations, bool)>>,
    /// The last forward's deferred `lm_head` gradient (full fine-tune), until
    /// [`Policy::finish_backward`].
    pending_head: Mutex<Option<PendingLmHeadGrad>>,
    /// The trainable variables with their names, sorted: fixed once the model is built (loads
    /// fill the same tensors) and read twice a step, so listed once rather than rebuilt from the
    /// var store's name map (every variable's name copied, then a sort) while the GPU waits at
    /// the start of each step.
    trainable: Vec<(String, Tensor)>,
}

/// Facts about a batch read on the host before it was copied to the device, so the forward
/// needs no device→host sync to validate ids or to choose between causal and masked attention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSummary {
    /// Smallest input id.
    pub min_input_id: i64,
    /// Largest input id or target.
    pub max_id: i64,
    /// Whether some row holds a second document (a position 0 after its first column).
    pub packed: bool,
    /// Lengths of the documents and padding runs, row by row (sum B·L): the segments packed
    /// attention runs over.
    pub segments: Vec<i64>,
}

impl BatchSummary {
    /// Summarizes row-major (rows × `cols`) input ids, position ids and targets.
    pub fn of(input_ids: &[i64], position_ids: &[i64], targets: &[i64], cols: usize) -> Self {
        let min_input_id = input_ids.iter().copied().min().unwrap_or(0);
        let max_id = input_ids.iter().chain(targets).copied().max().unwrap_or(0);
        let segments = segment_lengths(position_ids, cols);
        let rows = position_ids.len().checked_div(cols).unwrap_or(0);
        Self { min_input_id, max_id, packed: segments.len() > rows, segments }
    }
}

/// What a policy trades memory for: the train config's activation checkpointing, activation
/// offloading and kept MLP activations. They belong to the run, not to the weights, so a policy
/// reloaded from a checkpoint takes them over from the one it replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemorySettings {
    /// Keep only each layer's input in the forward and recompute the layer in the backward.
    pub activation_checkpointing: bool,
    /// With checkpointing, keep those layer inputs in pinned host memory.
    pub activation_offloading: bool,
    /// LoRA MLPs keep their SwiGLU product for the backward instead of recomputing it.
    pub keep_mlp_activations: bool,
}

impl MemorySettings {
    /// The settings `cfg` asks for.
    pub fn of(cfg: &TrainConfig) -> Self {
        Self {
            activation_checkpointing: cfg.activation_checkpointing,
            activation_offloading: cfg.activation_offloading,
            keep_mlp_activations: cfg.keep_mlp_activations,
        }
    }
}

/// The dtype a policy uses on `device`: bf16 on CUDA, f32 elsewhere.
pub fn default_kind(device: Device) -> Kind {
    if device.is_cuda() {
        Kind::BFloat16
    } else {
        Kind::Float
    }
}

impl Policy {
    /// Loads `dir` (config.json + model.safetensors or sharded with its index) onto `device`.
    /// With `lora`, base weights are frozen and adapters start as PEFT's (A random, B zero);
    /// without, every weight trains.
    pub fn load(dir: &Path, lora: Option<&LoraConfig>, device: Device) -> Result<Policy> {
        Self::load_as(dir, lora, device, default_kind(device))
    }

    /// [`Policy::load`] with `cfg`'s LoRA and memory settings (activation checkpointing and
    /// offloading, kept MLP activations): the policy a worker trains.
    pub fn load_for_training(dir: &Path, cfg: &TrainConfig, device: Device) -> Result<Policy> {
        let mut policy = Self::load(dir, cfg.lora.as_ref(), device)?;
        policy.set_memory_settings(MemorySettings::of(cfg));
        Ok(policy)
    }

    /// The memory settings this policy trains with.
    pub fn memory_settings(&self) -> MemorySettings {
        MemorySettings {
            activation_checkpointing: self.activation_checkpointing,
            activation_offloading: self.activation_offloading,
            keep_mlp_activations: self.keep_mlp_activations(),
        }
    }

    /// Sets all three memory settings at once (e.g. on a policy that replaces this one).
    pub fn set_memory_settings(&mut self, settings: MemorySettings) {
        self.set_activation_checkpointing(settings.activation_checkpointing);
        self.set_activation_offloading(settings.activation_offloading);
        self.set_keep_mlp_activations(settings.keep_mlp_activations);
    }

    /// Whether activation offloading is on.
    pub fn activation_offloading(&self) -> bool {
        self.activation_offloading
    }

    /// [`Policy::load`] with an explicit dtype (e.g. f32 on CUDA for parity checks).
    pub fn load_as(dir: &Path, lora: Option<&LoraConfig>, device: Device, kind: Kind) -> Result<Policy> {
        let cfg = HfConfig::from_dir(dir)?;
        check_lora_targets(lora)?;
        let policy = Self::build(&cfg, lora, device, kind, false)
            .map_err(Error::torch(format!("build model from {}", dir.display())))?;
        let tied = cfg.tie_word_embeddings;
        let base: HashMap<String, Tensor> =
            policy.vs.variables().into_iter().filter(|(name, _)| !is_lora_name(name)).collect();
        fill_variables(&base, &weight_files(dir)?, |key| {
            let skip = (tied && key == "lm_head.weight") || key.ends_with("rotary_emb.inv_freq");
            (!skip).then(|| key.to_string())
        })?;
        Ok(policy)
    }

    /// A randomly initialized model of `cfg` (normal(0, initializer_range) weights, unit norms),
    /// seeded by `seed`, for tests and the demo.
    pub fn from_config(cfg: &HfConfig, lora: Option<&LoraConfig>, device: Device, seed: i64) -> Result<Policy> {
        cfg.check().map_err(|message| Error::config("model config", message))?;
        check_lora_targets(lora)?;
        tch::manual_seed(seed);
        Self::build(cfg, lora, device, default_kind(device), true).map_err(Error::torch("random init"))
    }

    fn build(cfg: &HfConfig, lora: Option<&LoraConfig>, device: Device, kind: Kind, random: bool) -> TchResult<Policy> {
        let vs = VarStore::new(device);
        let std = cfg.extra.get("initializer_range").and_then(|v| v.as_f64()).unwrap_or(0.02);
        let init = Init { kind, base_trainable: lora.is_none(), random, std };
        let lora_enabled = Arc::new(AtomicBool::new(true));
        let spec = lora.map(|l| LoraSpec {
            rank: l.rank,
            scale: l.alpha / l.rank as f64,
            targets: l.target_modules.clone(),
            enabled: lora_enabled.clone(),
        });
        let lm = CausalLm::new(&vs.root(), cfg, &init, spec.as_ref())?;
        let (saved, pending_head) = (Mutex::new(None), Mutex::new(None));
        let mut trainable: Vec<(String, Tensor)> =
            vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        trainable.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Policy {
            vs,
            cfg: cfg.clone(),
            lm,
            lora: lora.cloned(),
            lora_enabled,
            kind,
            activation_checkpointing: false,
            activation_offloading: false,
            packed_attention: PackedAttention::default(),
            temperature: 1.0,
            saved,
            pending_head,
            trainable,
        })
    }

    /// log p(targets[b, t] | input_ids[b, ..=t]) as (B, L) f32, differentiable with respect to
    /// the trainable variables. All arguments are (B, L) i64; `position_ids` restart at 0 at each
    /// packed document (no attention across documents); a negative target gives 0.
    pub fn token_logprobs(&self, input_ids: &Tensor, position_ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.check_batch(input_ids, position_ids, Some(targets))?;
        let (lo, hi) =
            (input_ids.min().int64_value(&[]), input_ids.max().int64_value(&[]).max(targets.max().int64_value(&[])));
        self.check_id_range(lo, hi)?;
        self.logprobs_of_checked(input_ids, position_ids, targets, None)
    }

    /// [`Policy::token_logprobs`] for a batch summarized on the host ([`BatchSummary::of`]):
    /// the same result without device→host syncs.
    pub fn token_logprobs_summarized(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        targets: &Tensor,
        summary: &BatchSummary,
    ) -> Result<Tensor> {
        self.check_batch(input_ids, position_ids, Some(targets))?;
        self.check_id_range(summary.min_input_id, summary.max_id)?;
        self.logprobs_of_checked(input_ids, position_ids, targets, Some(&summary.segments))
    }

    fn logprobs_of_checked(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        targets: &Tensor,
        segments: Option<&[i64]>,
    ) -> Result<Tensor> {
        if grad_mode_enabled() {
            // A forward whose backward never ran (an error in between) leaves nothing behind.
            self.pending_head.lock().unwrap_or_else(|e| e.into_inner()).take();
            self.saved.lock().unwrap_or_else(|e| e.into_inner()).take();
        }
        let run = || -> TchResult<Tensor> {
            let layout = DocumentLayout::of(position_ids, segments, self.packed_attention, self.kind)?;
            let hidden = if self.activation_checkpointing && grad_mode_enabled() {
                let (hidden, saved) =
                    self.lm.hidden_states_checkpointed(input_ids, position_ids, layout, self.activation_offloading)?;
                *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some((saved, self.lora_enabled()));
                hidden
            } else {
                self.lm.hidden_states(input_ids, position_ids, &layout)?
            };
            let (b, l, h) = hidden.size3()?;
            // (B, L, H) -> (B*L, H); W (h / T) = (W h) / T, so the temperature scales the
            // hidden states once instead of every vocabulary-wide chunk of logits.
            let mut flat = hidden.f_reshape([b * l, h])?;
            if self.temperature != 1.0 {
                flat = flat.f_mul_scalar(1.0 / self.temperature)?;
            }
            let (lp, pending) = chunked_logprobs(&flat, &self.lm.lm_head, &targets.f_reshape([b * l])?)?;
            if pending.is_some() {
                *self.pending_head.lock().unwrap_or_else(|e| e.into_inner()) = pending;
            }
            lp.f_reshape([b, l])
        };
        run().map_err(Error::torch("token log-probs"))
    }

    /// Sets the temperature log-probs are taken at: logits are divided by it before the softmax,
    /// as the sampler did when it drew at that temperature.
    pub fn set_logit_temperature(&mut self, temperature: f64) {
        self.temperature = temperature;
    }

    /// Full logits (B, L, vocab) in the model's dtype, before any temperature; for parity tests
    /// and small inputs only.
    pub fn logits(&self, input_ids: &Tensor, position_ids: &Tensor) -> Result<Tensor> {
        self.check_batch(input_ids, position_ids, None)?;
        let run = || {
            let layout = DocumentLayout::of(position_ids, None, self.packed_attention, self.kind)?;
            self.lm.hidden_states(input_ids, position_ids, &layout)?.f_linear::<Tensor>(&self.lm.lm_head, None)
        };
        run().map_err(Error::torch("logits"))
    }

    fn check_batch(&self, input_ids: &Tensor, position_ids: &Tensor, targets: Option<&Tensor>) -> Result<()> {
        let fail = |m: String| Err(Error::config("batch", m));
        let size = input_ids.size();
        if size.len() != 2 || size[1] == 0 {
            return fail(format!("input_ids must be (B, L) with L > 0, got {size:?}"));
        }
        for (name, t) in [("input_ids", Some(input_ids)), ("position_ids", Some(position_ids)), ("targets", targets)] {
            let Some(t) = t else { continue };
            if t.size() != size || t.kind() != Kind::Int64 {
                return fail(format!("{name} must be i64 of shape {size:?}, got {:?} {:?}", t.kind(), t.size()));
            }
        }
        Ok(())
    }

    fn check_id_range(&self, lo: i64, hi: i64) -> Result<()> {
        if lo < 0 || hi >= self.cfg.vocab_size {
            let message = format!("token ids must lie in [0, {}), got [{lo}, {hi}]", self.cfg.vocab_size);
            return Err(Error::config("batch", message));
        }
        Ok(())
    }

    /// Turns activation checkpointing on or off: when on, a forward with autograd enabled keeps
    /// only each decoder layer's input, and [`Policy::finish_backward`] must follow the loss
    /// backward to recompute the layers and complete the gradients.
    pub fn set_activation_checkpointing(&mut self, enabled: bool) {
        self.activation_checkpointing = enabled;
        if !enabled {
            *self.saved.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// Turns activation offloading on or off: with checkpointing on, the layer inputs it keeps go
    /// to pinned host memory during the forward and come back a layer ahead of the backward
    /// walk, on a side stream (see `model::offload`). No effect without checkpointing.
    pub fn set_activation_offloading(&mut self, enabled: bool) {
        self.activation_offloading = enabled;
    }

    /// Whether LoRA layers keep each MLP's SwiGLU product for the backward
    /// ([`Policy::set_keep_mlp_activations`]).
    pub fn keep_mlp_activations(&self) -> bool {
        self.lm.keep_mlp_activations
    }

    /// With the fused ops, LoRA and no activation checkpointing: on, each layer's MLP keeps its
    /// SwiGLU product `silu(gate) · up` (tokens × intermediate size, a layer) for the backward;
    /// off (the default), only the gate/up output is kept and the backward computes the product
    /// again, one elementwise pass a layer. Full fine-tunes keep it either way (the down
    /// projection's weight gradient reads it), and checkpointed layers keep it for the one layer
    /// being recomputed.
    pub fn set_keep_mlp_activations(&mut self, enabled: bool) {
        self.lm.keep_mlp_activations = enabled;
    }

    /// How rows holding several documents attend: per document segment (the default) or through
    /// the dense document mask (the reference path; `bench check` compares the two).
    pub fn set_packed_attention(&mut self, packed: PackedAttention) {
        self.packed_attention = packed;
    }

    /// Turns the fused decoder-layer ops on or off (on by default): on CUDA in bf16 the q/k
    /// norms with RoPE, SwiGLU and the projections with their adapters run as ops of ours with
    /// their own backward (`model::fused_ops`); off, or elsewhere, as libtorch tensor ops (the
    /// reference `bench check` compares with).
    pub fn set_fused_ops(&mut self, enabled: bool) {
        self.lm.fused_ops = enabled;
    }

    /// Whether forwards run the fused ops: switched on and able to run on this device and dtype.
    pub fn fused_ops_active(&self) -> bool {
        self.lm.fused_ops_active(self.device(), self.kind)
    }

    /// Whether activation checkpointing is on.
    pub fn activation_checkpointing(&self) -> bool {
        self.activation_checkpointing
    }

    /// Must follow `loss.backward()` of every forward with autograd: adds `lm_head`'s gradient
    /// when it trains (full fine-tune; it is formed from the kept softmax and each token's
    /// upstream gradient, see `model::logprobs`), and, after a checkpointed forward, recomputes
    /// the decoder layers in reverse and accumulates the gradients of everything below the last
    /// layer's output. A no-op when nothing is pending.
    pub fn finish_backward(&self) -> Result<()> {
        let head = self.pending_head.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(head) = head {
            head.apply(&self.lm.lm_head).map_err(Error::torch("lm_head gradient"))?;
        }
        let pending = self.saved.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some((saved, lora_enabled)) = pending else { return Ok(()) };
        self.with_lora_set(lora_enabled, |p| p.lm.finish_checkpointed_backward(saved))
            .map_err(Error::torch("checkpointed backward (layer recomputation)"))
    }

    /// Turns the LoRA adapters on or off (off = the base model, e.g. for the KL reference pass).
    pub fn set_lora_enabled(&self, enabled: bool) {
        self.lora_enabled.store(enabled, Ordering::Relaxed);
    }

    /// Whether the LoRA adapters take part in the forward pass.
    pub fn lora_enabled(&self) -> bool {
        self.lora_enabled.load(Ordering::Relaxed)
    }

    /// Runs `f` with the adapters off, restoring the previous setting afterwards (even on panic).
    pub fn with_lora_disabled<T>(&self, f: impl FnOnce(&Self) -> T) -> T {
        self.with_lora_set(false, f)
    }

    fn with_lora_set<T>(&self, enabled: bool, f: impl FnOnce(&Self) -> T) -> T {
        struct Restore<'a>(&'a AtomicBool, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.store(self.1, Ordering::Relaxed);
            }
        }
        let _restore = Restore(&self.lora_enabled, self.lora_enabled.swap(enabled, Ordering::Relaxed));
        f(self)
    }

    /// The variables the optimizer updates (LoRA A/B, or every weight for a full fine-tune).
    pub fn trainable_variables(&self) -> Vec<Tensor> {
        self.trainable.iter().map(|(_, t)| t.shallow_clone()).collect()
    }

    /// The trainable variables with their names (HF/PEFT keys without PEFT's prefix), sorted.
    pub fn named_trainable_variables(&self) -> Vec<(String, Tensor)> {
        self.trainable.iter().map(|(name, t)| (name.clone(), t.shallow_clone())).collect()
    }

    /// Every variable with its name (HF/PEFT keys), sorted.
    pub fn named_variables(&self) -> Vec<(String, Tensor)> {
        let mut vars: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars
    }

    /// The LoRA variables (`…q_proj.lora_A.weight`), sorted; empty for a full fine-tune.
    pub fn lora_variables(&self) -> Vec<(String, Tensor)> {
        self.named_variables().into_iter().filter(|(name, _)| is_lora_name(name)).collect()
    }

    /// The model's HF config.
    pub fn hf_config(&self) -> &HfConfig {
        &self.cfg
    }

    /// The LoRA settings, `None` for a full fine-tune.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// The dtype of the weights.
    pub fn kind(&self) -> Kind {
        self.kind
    }
}

/// The projections LoRA can adapt, by HF module name.
pub const LORA_TARGETABLE: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

fn check_lora_targets(lora: Option<&LoraConfig>) -> Result<()> {
    let Some(lora) = lora else { return Ok(()) };
    if lora.rank <= 0 || lora.target_modules.is_empty() {
        return Err(Error::config("lora", "rank must be positive and target_modules non-empty"));
    }
    match lora.target_modules.iter().find(|t| !LORA_TARGETABLE.contains(&t.as_str())) {
        Some(t) => Err(Error::config("lora.target_modules", format!("{t:?} is not one of {LORA_TARGETABLE:?}"))),
        None => Ok(()),
    }
}

/// Whether a variable name belongs to a LoRA adapter.
pub fn is_lora_name(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tiny_qwen3_config;

    #[test]
    fn a_policy_can_move_to_its_own_training_thread() {
        fn assert_send<T: Send>() {}
        assert_send::<Policy>();
    }

    #[test]
    fn token_logprobs_refuses_ids_outside_the_vocabulary() {
        let policy = Policy::from_config(&tiny_qwen3_config(10), None, Device::Cpu, 0).unwrap();
        let ids = Tensor::from_slice(&[1i64, 2, 10]).reshape([1, 3]);
        let pos = Tensor::from_slice(&[0i64, 1, 2]).reshape([1, 3]);
        let err = policy.token_logprobs(&ids, &pos, &ids).unwrap_err().to_string();
        assert!(err.contains("[0, 10)"), "{err}");
    }

    #[test]
    fn log_probs_at_a_temperature_and_their_gradient_are_those_of_the_scaled_logits() {
        let lora = LoraConfig { rank: 2, ..LoraConfig::default() };
        let mut policy = Policy::from_config(&tiny_qwen3_config(32), Some(&lora), Device::Cpu, 3).unwrap();
        for (name, v) in policy.lora_variables() {
            if name.contains("lora_B") {
                let _ = tch::no_grad(|| v.shallow_clone().uniform_(-0.1, 0.1));
            }
        }
        let ids = Tensor::from_slice(&[3i64, 7, 1, 30, 12, 5]).reshape([1, 6]);
        let pos = Tensor::from_slice(&[0i64, 1, 2, 3, 4, 5]).reshape([1, 6]);
        let targets = Tensor::from_slice(&[7i64, 1, 30, 12, 5, 9]).reshape([1, 6]);
        let weights = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 0.25, 1.5, -0.75]).reshape([1, 6]);
        let temperature = 0.7;
        let grads = |policy: &Policy, lp: Tensor| {
            for mut v in policy.trainable_variables() {
                v.zero_grad();
            }
            (lp * &weights).sum(Kind::Float).backward();
            policy.trainable_variables().iter().map(|v| v.grad().copy()).collect::<Vec<_>>()
        };
        let expected_lp = (policy.logits(&ids, &pos).unwrap() / temperature)
            .log_softmax(-1, Kind::Float)
            .gather(2, &targets.unsqueeze(-1), false)
            .squeeze_dim(-1);
        let expected_grads = grads(&policy, expected_lp.shallow_clone());
        policy.set_logit_temperature(temperature);
        let lp = policy.token_logprobs(&ids, &pos, &targets).unwrap();
        assert!(lp.allclose(&expected_lp, 1e-5, 1e-5, false), "{lp} vs {expected_lp}");
        for (g, e) in grads(&policy, lp).iter().zip(&expected_grads) {
            assert!(g.allclose(e, 1e-4, 1e-6, false), "gradient differs at temperature {temperature}");
        }
        assert!(expected_grads.iter().any(|g| g.abs().max().double_value(&[]) > 0.0));
    }
}
