//! Typed training configuration: serde, documented defaults as named constants, `validate()`.
//!
//! A model's config is stored as jsonb in `trainq.models.config`; every field has a default, so
//! `{}` is a valid config. The worker overlays its own command-line settings on top.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Default LoRA rank.
pub const DEFAULT_LORA_RANK: i64 = 8;
/// Default LoRA alpha (the update is scaled by alpha / rank).
pub const DEFAULT_LORA_ALPHA: f64 = 16.0;
/// Default LoRA target modules (Hugging Face module names).
pub const DEFAULT_LORA_TARGETS: [&str; 7] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
/// Default AdamW learning rate.
pub const DEFAULT_LEARNING_RATE: f64 = 1e-5;
/// Default AdamW betas.
pub const DEFAULT_BETAS: (f64, f64) = (0.9, 0.99);
/// Default AdamW decoupled weight decay.
pub const DEFAULT_WEIGHT_DECAY: f64 = 0.1;
/// Default AdamW epsilon.
pub const DEFAULT_ADAM_EPS: f64 = 1e-8;
/// Default gradient-norm clip (0 disables clipping).
pub const DEFAULT_MAX_GRAD_NORM: f64 = 1.0;
/// Default PPO clip range below 1.
pub const DEFAULT_CLIP_EPSILON: f64 = 0.2;
/// Default KL coefficient (0 disables the KL term and the reference forward pass).
pub const DEFAULT_KL_COEF: f64 = 0.0;
/// Default sampler temperature: log-probs are compared at the temperature the sampler used.
pub const DEFAULT_SAMPLER_TEMPERATURE: f64 = 1.0;
/// Default longest trajectory, in tokens; what happens to longer ones is `too_long`'s choice.
pub const DEFAULT_MAX_SEQ_LEN: usize = 4096;
/// Default token budget of one packed micro-batch.
pub const DEFAULT_MAX_TOKENS_PER_MICRO_BATCH: usize = 8192;
/// Default number of groups claimed per step.
pub const DEFAULT_GROUPS_PER_STEP: usize = 8;
/// Default largest accepted `current_step − policy_version` when async weight syncing is on.
pub const DEFAULT_MAX_STALENESS: i64 = 1;
/// Default lease length of a claim, in seconds.
pub const DEFAULT_LEASE_SECONDS: i64 = 600;
/// Default number of claims of one group before it is marked failed.
pub const DEFAULT_MAX_ATTEMPTS: i32 = 3;
/// Default wait, in seconds, before a group whose claim ended without a result can be claimed
/// again; it doubles with each attempt (at most 16 times this).
pub const DEFAULT_RETRY_BACKOFF_SECONDS: f64 = 10.0;
/// Largest `queue.retry_backoff_seconds` (a day): beyond it the database's interval arithmetic
/// in the rescuer, which serves every model at once, could overflow.
pub const MAX_RETRY_BACKOFF_SECONDS: f64 = 86_400.0;
/// Default tolerance under which a group's reward std counts as zero.
pub const DEFAULT_ZERO_VARIANCE_TOLERANCE: f64 = 1e-6;
/// Default longest wait, in seconds, for a full batch of `groups_per_step` eligible groups after
/// the first eligible one arrived; then the step trains the groups it has (a short batch).
pub const DEFAULT_MAX_BATCH_WAIT_SECONDS: f64 = 60.0;

/// Everything that shapes a training step of one model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// LoRA settings; `None` trains every weight (full fine-tune).
    pub lora: Option<LoraConfig>,
    /// Optimizer settings.
    pub optimizer: OptimizerConfig,
    /// Policy-loss settings.
    pub loss: LossConfig,
    /// Advantage settings.
    pub advantages: AdvantageConfig,
    /// Queue and step settings.
    pub queue: QueueConfig,
    /// Longest trajectory in tokens; `too_long` says what happens to longer ones.
    pub max_seq_len: usize,
    /// What a trajectory longer than `max_seq_len` does: skip its whole group (the default),
    /// train its first `max_seq_len` tokens, or leave it out of the loss.
    pub too_long: TooLongPolicy,
    /// Token budget of one packed micro-batch (gradient accumulation runs over micro-batches).
    pub max_tokens_per_micro_batch: usize,
    /// Recompute each decoder layer in the backward pass instead of keeping its activations:
    /// memory for long rows and big models, at the cost of a second forward through the layers.
    pub activation_checkpointing: bool,
    /// With `activation_checkpointing`, keep the saved layer inputs in pinned host memory,
    /// copied out and back on a side stream that overlaps with compute (CUDA).
    pub activation_offloading: bool,
    /// With LoRA and without activation checkpointing, keep each MLP's SwiGLU product
    /// (tokens × intermediate size, in the model dtype, a layer) for the backward instead of
    /// computing it again there: one elementwise pass a layer less for that memory.
    pub keep_mlp_activations: bool,
    /// Extra chat-template variables, as the sampler passed them to `apply_chat_template`
    /// (e.g. Qwen3's `{"enable_thinking": false}`), so the training render equals the sampler's.
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            lora: Some(LoraConfig::default()),
            optimizer: OptimizerConfig::default(),
            loss: LossConfig::default(),
            advantages: AdvantageConfig::default(),
            queue: QueueConfig::default(),
            max_seq_len: DEFAULT_MAX_SEQ_LEN,
            too_long: TooLongPolicy::SkipGroup,
            max_tokens_per_micro_batch: DEFAULT_MAX_TOKENS_PER_MICRO_BATCH,
            activation_checkpointing: false,
            activation_offloading: false,
            keep_mlp_activations: false,
            chat_template_kwargs: serde_json::Map::new(),
        }
    }
}

/// What a trajectory longer than `max_seq_len` does to its step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TooLongPolicy {
    /// The whole group is skipped `too_long` (its advantages would be computed against a
    /// trajectory the step cannot train).
    #[default]
    SkipGroup,
    /// The trajectory is cut to its first `max_seq_len` tokens; trained tokens past the cut are
    /// not trained. Its reward and advantage stay those of the whole rollout.
    Truncate,
    /// The trajectory is left out of the loss (masked); its reward still counts in its group's
    /// mean and std, and the rest of the group trains.
    Mask,
}

/// LoRA adapter settings (PEFT's names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank `r` of the A (r × in) and B (out × r) matrices.
    pub rank: i64,
    /// `lora_alpha`; the update is scaled by alpha / rank.
    pub alpha: f64,
    /// Module names (e.g. `q_proj`) that get adapters.
    pub target_modules: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: DEFAULT_LORA_RANK,
            alpha: DEFAULT_LORA_ALPHA,
            target_modules: DEFAULT_LORA_TARGETS.iter().map(|s| s.to_string()).collect(),
        }
    }
}

/// AdamW and gradient clipping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Learning rate.
    pub learning_rate: f64,
    /// (β1, β2).
    pub betas: (f64, f64),
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Adam epsilon.
    pub eps: f64,
    /// Clip the global gradient norm to this (0 disables).
    pub max_grad_norm: f64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            learning_rate: DEFAULT_LEARNING_RATE,
            betas: DEFAULT_BETAS,
            weight_decay: DEFAULT_WEIGHT_DECAY,
            eps: DEFAULT_ADAM_EPS,
            max_grad_norm: DEFAULT_MAX_GRAD_NORM,
        }
    }
}

/// Which policy loss to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// PPO clipped surrogate.
    #[default]
    PpoClip,
    /// CISPO: clipped, stop-gradient importance weight times the log-prob.
    Cispo,
}

/// Where the importance ratio is formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RatioLevel {
    /// One ratio per token.
    #[default]
    Token,
    /// One ratio per sequence: the geometric mean of its token ratios (GSPO).
    Sequence,
}

/// How per-token losses are averaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LossNormalization {
    /// Mean over all trained tokens of the step.
    #[default]
    TokenMean,
    /// Mean over sequences of each sequence's token mean.
    SequenceMean,
}

/// Policy-loss settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LossConfig {
    /// PPO clip or CISPO.
    pub kind: LossKind,
    /// Token- or sequence-level (GSPO) importance ratio.
    pub ratio_level: RatioLevel,
    /// Clip range below 1 (ratio ≥ 1 − epsilon).
    pub epsilon: f64,
    /// Clip range above 1; `None` uses `epsilon`.
    pub epsilon_high: Option<f64>,
    /// Coefficient of the k3 KL estimate to the base model (LoRA disabled); 0 turns it off.
    pub kl_coef: f64,
    /// Token-mean or sequence-mean normalization.
    pub normalization: LossNormalization,
    /// Train trajectories whose trained tokens carry no sampler log-prob at all (their ratio is
    /// then 1: no off-policy correction). Off by default, as in ART: such a group is skipped
    /// `invalid` with a detail naming this setting.
    pub allow_training_without_logprobs: bool,
    /// The temperature the sampler drew at: the trainer divides its logits by it, so its
    /// log-probs (importance ratio, KL) compare with the sampler's like with like.
    pub sampler_temperature: f64,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            kind: LossKind::PpoClip,
            ratio_level: RatioLevel::Token,
            epsilon: DEFAULT_CLIP_EPSILON,
            epsilon_high: None,
            kl_coef: DEFAULT_KL_COEF,
            normalization: LossNormalization::TokenMean,
            allow_training_without_logprobs: false,
            sampler_temperature: DEFAULT_SAMPLER_TEMPERATURE,
        }
    }
}

/// Group-relative advantage settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdvantageConfig {
    /// Divide `r_i − mean_g` by `std_g + 1e-6`.
    pub scale_rewards: bool,
    /// A group whose population reward std is below this is skipped as `zero_variance`.
    pub zero_variance_tolerance: f64,
    /// Leave out of the loss the trajectories of a group with variance whose own advantage is
    /// zero (reward within `zero_variance_tolerance` of the group mean): they add tokens to the
    /// token-mean normalization but no signal. Off by default (ART keeps them).
    pub drop_zero_advantage_trajectories: bool,
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        Self {
            scale_rewards: true,
            zero_variance_tolerance: DEFAULT_ZERO_VARIANCE_TOLERANCE,
            drop_zero_advantage_trajectories: false,
        }
    }
}

/// Queue and step settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// Groups claimed per step.
    pub groups_per_step: usize,
    /// Accept groups sampled from older checkpoints (bounded by `max_staleness`).
    pub async_weight_syncing: bool,
    /// Largest accepted `current_step − policy_version` when `async_weight_syncing` is on.
    pub max_staleness: i64,
    /// Lease length of a claim, in seconds; a heartbeat extends it.
    pub lease_seconds: i64,
    /// Claims of one group before it is marked failed.
    pub max_attempts: i32,
    /// Seconds a group whose claim ended without a result (lease expired, released after an
    /// error) waits before it can be claimed again, doubling with each attempt (at most 16×).
    pub retry_backoff_seconds: f64,
    /// Longest wait, in seconds, for `groups_per_step` eligible groups after the first eligible
    /// one arrived; then the step trains what it has and its row says so (`groups_wanted`).
    pub max_batch_wait_seconds: f64,
    /// What a group with NULL `policy_version` (sampled from an unknown checkpoint) is.
    pub unknown_policy_version: UnknownPolicyVersion,
}

/// What a group whose `policy_version` is NULL is: its lag is unknown, so it is not on-policy
/// by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum UnknownPolicyVersion {
    /// The database refuses the insert (SQLSTATE TQ030); groups already stored are skipped `stale`.
    Refuse,
    /// Accepted at insert, skipped `stale` by the worker (never trained).
    #[default]
    Stale,
    /// Trained as if on-policy (lag unknown; the step's lag columns leave it out).
    Accept,
}

impl UnknownPolicyVersion {
    /// The config and SQL label (`refuse`, `stale`, `accept`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Refuse => "refuse",
            Self::Stale => "stale",
            Self::Accept => "accept",
        }
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            groups_per_step: DEFAULT_GROUPS_PER_STEP,
            async_weight_syncing: false,
            max_staleness: DEFAULT_MAX_STALENESS,
            lease_seconds: DEFAULT_LEASE_SECONDS,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retry_backoff_seconds: DEFAULT_RETRY_BACKOFF_SECONDS,
            max_batch_wait_seconds: DEFAULT_MAX_BATCH_WAIT_SECONDS,
            unknown_policy_version: UnknownPolicyVersion::Stale,
        }
    }
}

impl TrainConfig {
    /// Parses a config from JSON (missing fields take their defaults) and validates it.
    pub fn from_json(value: &serde_json::Value) -> Result<Self> {
        let cfg: TrainConfig =
            serde_json::from_value(value.clone()).map_err(|e| Error::config("config", e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The largest policy lag a step accepts: 0 when on-policy, `max_staleness` when async.
    pub fn accepted_staleness(&self) -> i64 {
        if self.queue.async_weight_syncing {
            self.queue.max_staleness
        } else {
            0
        }
    }

    /// Checks ranges and consistency; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if let Some(lora) = &self.lora {
            check(lora.rank > 0, "lora.rank", "must be positive")?;
            check(lora.alpha > 0.0, "lora.alpha", "must be positive")?;
            check(!lora.target_modules.is_empty(), "lora.target_modules", "must not be empty")?;
        }
        let o = &self.optimizer;
        check(o.learning_rate > 0.0 && o.learning_rate.is_finite(), "optimizer.learning_rate", "must be positive")?;
        check(
            (0.0..1.0).contains(&o.betas.0) && (0.0..1.0).contains(&o.betas.1),
            "optimizer.betas",
            "must lie in [0, 1)",
        )?;
        check(o.weight_decay >= 0.0, "optimizer.weight_decay", "must not be negative")?;
        check(o.eps > 0.0, "optimizer.eps", "must be positive")?;
        check(o.max_grad_norm >= 0.0, "optimizer.max_grad_norm", "must not be negative")?;
        let l = &self.loss;
        match l.kind {
            // PPO's lower clip 1 − ε must stay above 0.
            LossKind::PpoClip => check(l.epsilon > 0.0 && l.epsilon < 1.0, "loss.epsilon", "must lie in (0, 1)")?,
            // CISPO clips a stop-gradient weight; ε ≥ 1 (no lower clip) is ART's default.
            LossKind::Cispo => check(l.epsilon > 0.0 && l.epsilon.is_finite(), "loss.epsilon", "must be positive")?,
        }
        check(l.epsilon_high.is_none_or(|e| e > 0.0 && e.is_finite()), "loss.epsilon_high", "must be positive")?;
        check(l.kl_coef >= 0.0, "loss.kl_coef", "must not be negative")?;
        check(
            l.sampler_temperature > 0.0 && l.sampler_temperature.is_finite(),
            "loss.sampler_temperature",
            "must be a positive number (the temperature the sampler drew at; 1 when it did not scale logits)",
        )?;
        check(
            l.kl_coef == 0.0 || self.lora.is_some(),
            "loss.kl_coef",
            "a KL term needs a reference model, and a full fine-tune (lora: null) keeps none: the \
             reference is the base model with LoRA disabled. Set loss.kl_coef to 0 or train a LoRA",
        )?;
        check(
            self.advantages.zero_variance_tolerance >= 0.0,
            "advantages.zero_variance_tolerance",
            "must not be negative",
        )?;
        let q = &self.queue;
        check(q.groups_per_step > 0, "queue.groups_per_step", "must be positive")?;
        check(q.max_staleness >= 0, "queue.max_staleness", "must not be negative")?;
        check(q.lease_seconds > 0, "queue.lease_seconds", "must be positive")?;
        check(q.max_attempts > 0, "queue.max_attempts", "must be positive")?;
        check(
            (0.0..=MAX_RETRY_BACKOFF_SECONDS).contains(&q.retry_backoff_seconds),
            "queue.retry_backoff_seconds",
            "must be a number of seconds from 0 to 86400 (16× of it is the longest wait)",
        )?;
        check(
            q.max_batch_wait_seconds >= 0.0 && q.max_batch_wait_seconds.is_finite(),
            "queue.max_batch_wait_seconds",
            "must be a finite number of seconds, 0 or more",
        )?;
        check(self.max_seq_len > 1, "max_seq_len", "must be at least 2")?;
        check(
            !self.activation_offloading || self.activation_checkpointing,
            "activation_offloading",
            "offloads the layer inputs that activation checkpointing keeps: set activation_checkpointing too",
        )?;
        check(
            self.max_tokens_per_micro_batch >= self.max_seq_len,
            "max_tokens_per_micro_batch",
            "must be at least max_seq_len, so any accepted trajectory fits",
        )?;
        Ok(())
    }
}

fn check(ok: bool, field: &str, message: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::config(field, message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_json_gives_the_documented_defaults() {
        let cfg = TrainConfig::from_json(&serde_json::json!({})).unwrap();
        assert_eq!(cfg, TrainConfig::default());
        assert_eq!(cfg.lora.as_ref().unwrap().rank, DEFAULT_LORA_RANK);
        assert_eq!(cfg.optimizer.betas, (0.9, 0.99));
    }

    #[test]
    fn null_lora_means_full_fine_tune() {
        let cfg = TrainConfig::from_json(&serde_json::json!({"lora": null})).unwrap();
        assert!(cfg.lora.is_none());
    }

    #[test]
    fn bad_values_are_refused_with_the_field_name() {
        let err = TrainConfig::from_json(&serde_json::json!({"lora": {"rank": 0}})).unwrap_err();
        assert!(err.to_string().contains("lora.rank"), "{err}");
        let err = TrainConfig::from_json(&serde_json::json!({"loss": {"epsilon": 1.5}})).unwrap_err();
        assert!(err.to_string().contains("loss.epsilon"), "{err}");
    }

    #[test]
    fn unknown_fields_are_refused() {
        assert!(TrainConfig::from_json(&serde_json::json!({"lora_rank": 4})).is_err());
    }

    #[test]
    fn kl_on_a_full_fine_tune_is_refused_naming_the_setting() {
        let err = TrainConfig::from_json(&serde_json::json!({"lora": null, "loss": {"kl_coef": 0.1}})).unwrap_err();
        assert!(err.to_string().contains("loss.kl_coef") && err.to_string().contains("full fine-tune"), "{err}");
        assert!(TrainConfig::from_json(&serde_json::json!({"loss": {"kl_coef": 0.1}})).is_ok());
    }

    #[test]
    fn cispo_takes_arts_epsilons_and_ppo_keeps_its_lower_clip_positive() {
        let cispo = serde_json::json!({"loss": {"kind": "cispo", "epsilon": 1.0, "epsilon_high": 4.0}});
        assert!(TrainConfig::from_json(&cispo).is_ok());
        let ppo = serde_json::json!({"loss": {"kind": "ppo_clip", "epsilon": 1.0}});
        assert!(TrainConfig::from_json(&ppo).unwrap_err().to_string().contains("loss.epsilon"));
    }

    #[test]
    fn unknown_policy_versions_are_stale_by_default() {
        assert_eq!(TrainConfig::default().queue.unknown_policy_version, UnknownPolicyVersion::Stale);
        let cfg = TrainConfig::from_json(&serde_json::json!({"queue": {"unknown_policy_version": "refuse"}})).unwrap();
        assert_eq!(cfg.queue.unknown_policy_version, UnknownPolicyVersion::Refuse);
    }

    #[test]
    fn loss_knobs_take_their_documented_defaults_and_refuse_nonsense() {
        let cfg = TrainConfig::default();
        assert_eq!(
            (cfg.too_long, cfg.advantages.drop_zero_advantage_trajectories, cfg.loss.sampler_temperature),
            (TooLongPolicy::SkipGroup, false, 1.0)
        );
        let set = serde_json::json!({"too_long": "truncate", "loss": {"sampler_temperature": 0.7},
            "advantages": {"drop_zero_advantage_trajectories": true}});
        let cfg = TrainConfig::from_json(&set).unwrap();
        assert_eq!((cfg.too_long, cfg.loss.sampler_temperature), (TooLongPolicy::Truncate, 0.7));
        let err = TrainConfig::from_json(&serde_json::json!({"loss": {"sampler_temperature": 0.0}})).unwrap_err();
        assert!(err.to_string().contains("loss.sampler_temperature"), "{err}");
        assert!(TrainConfig::from_json(&serde_json::json!({"too_long": "cut"})).is_err());
        let err = TrainConfig::from_json(&serde_json::json!({"activation_offloading": true})).unwrap_err();
        assert!(err.to_string().contains("activation_checkpointing"), "{err}");
        let both = serde_json::json!({"activation_offloading": true, "activation_checkpointing": true});
        assert!(TrainConfig::from_json(&both).is_ok());
        assert!(!TrainConfig::default().keep_mlp_activations);
        let keep = TrainConfig::from_json(&serde_json::json!({"keep_mlp_activations": true})).unwrap();
        assert!(keep.keep_mlp_activations);
    }

    #[test]
    fn on_policy_accepts_no_staleness() {
        let mut cfg = TrainConfig::default();
        cfg.queue.max_staleness = 3;
        assert_eq!(cfg.accepted_staleness(), 0);
        cfg.queue.async_weight_syncing = true;
        assert_eq!(cfg.accepted_staleness(), 3);
    }
}
