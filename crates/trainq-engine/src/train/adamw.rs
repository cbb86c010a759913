//! AdamW with decoupled weight decay over plain tensors, and global gradient-norm clipping.
//!
//! tch 0.24 does not generate bindings for libtorch's `_fused_adamw_` (its generator skips
//! `_fused_adam*` and `_foreach*`), so the update is written with in-place tensor ops under
//! `no_grad` as `torch.optim.AdamW` (single-tensor path) computes it:
//! `p ← p·(1 − lr·wd)`, `m ← lerp(m, g, 1−β1)`, `v ← lerp(v, g², 1−β2)`,
//! `p ← p − lr/(1−β1^t) · m / (√v/√(1−β2^t) + eps)` — but on flat buffers
//! (`flat_params`): the parameters are moved into one buffer per dtype/device group on
//! the first step, so one update is ~15 kernels per group rather than ~10 per tensor. Moments
//! are kept in f32 whatever the parameter's dtype, and are exposed per parameter for checkpoints.
//!
//! On CUDA each bucket's update is instead one fused kernel of our own
//! ([`crate::kernels::fused_adamw_step`]: every element read and written once), unless
//! [`AdamW::set_fused`] turned it off; if the kernels cannot be compiled (no NVRTC) the tensor-op
//! path runs, with one warning. A launch that fails once the kernels are there fails the step.

use tch::{Kind, Tensor};

use super::flat_params::FlatBucket;
use crate::error::{Error, Result};
use crate::kernels::{fused_adamw_step, AdamWScalars};
use trainq_queue::config::OptimizerConfig;

/// Name of the step-count entry in [`AdamW::named_state`].
pub const STEP_STATE_NAME: &str = "step";

/// AdamW state for an ordered list of parameters.
#[derive(Debug)]
pub struct AdamW {
    cfg: OptimizerConfig,
    steps: i64,
    /// The parameters' flat groups with their f32 first and second moments.
    groups: Vec<(FlatBucket, Tensor, Tensor)>,
    params: usize,
    /// Use the fused CUDA kernel for buckets on CUDA.
    fused: bool,
}

/// A step's gradients gathered into the optimizer's flat groups, and their global L2 norm (an
/// f32 scalar, still on the device) — between [`AdamW::prepare_update`] and
/// [`AdamW::apply_update`].
#[derive(Debug)]
pub struct PreparedUpdate {
    grads: Vec<Tensor>,
    /// The global gradient norm before clipping.
    pub norm: Tensor,
}

impl AdamW {
    /// A fresh optimizer; moments are created on the first step.
    pub fn new(cfg: OptimizerConfig) -> Self {
        Self { cfg, steps: 0, groups: Vec::new(), params: 0, fused: true }
    }

    /// Number of steps taken.
    pub fn steps(&self) -> i64 {
        self.steps
    }

    /// Current learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.cfg.learning_rate
    }

    /// Whether buckets on CUDA are updated by the fused kernel (default) or by tensor ops (the
    /// portable path, also the reference the fused kernel is checked against).
    pub fn set_fused(&mut self, fused: bool) {
        self.fused = fused;
    }

    /// Whether the fused kernel is in use (false after [`AdamW::set_fused`]`(false)` or once it
    /// failed to load).
    pub fn fused(&self) -> bool {
        self.fused && self.groups.iter().all(|(bucket, _, _)| kernel_runs_on(bucket.values.device()))
    }

    /// Applies one update to `params` from their `.grad()`. A parameter without a gradient is
    /// updated as if its gradient were zero (PyTorch would skip it); the list must keep its order.
    /// On the first call the parameters' storage moves into the optimizer's flat buffers.
    pub fn step(&mut self, params: &[Tensor]) -> Result<()> {
        let grads = self.prepare(params)?;
        self.update(&grads, None)
    }

    /// Clips the gradients to the global L2 norm `max_norm` (0: no clipping; coefficient
    /// `max_norm / (norm + 1e-6)` capped at 1, as `clip_grad_norm_`) and applies one update.
    /// Returns the norm before clipping (one device→host read); when it is not finite nothing
    /// is updated and an error is returned. The `.grad()` tensors themselves are not rescaled.
    pub fn clip_and_step(&mut self, params: &[Tensor], max_norm: f64) -> Result<f64> {
        let update = self.prepare_update(params)?;
        let norm = update.norm.double_value(&[]);
        self.apply_update(update, norm, max_norm)?;
        Ok(norm)
    }

    /// The first half of [`AdamW::clip_and_step`], with no device→host read: gathers each
    /// group's gradient and launches the global norm's reduction. The caller reads
    /// [`PreparedUpdate::norm`] together with whatever else the step reports (one sync), then
    /// calls [`AdamW::apply_update`].
    pub fn prepare_update(&mut self, params: &[Tensor]) -> Result<PreparedUpdate> {
        let grads = self.prepare(params)?;
        let norm = tch::no_grad(|| -> tch::Result<Tensor> {
            let Some(first) = grads.first() else { return Tensor::f_zeros([], (Kind::Float, tch::Device::Cpu)) };
            // per bucket one reduction reading the gradient in its dtype, accumulating in f32
            let norms = grads
                .iter()
                .map(|g| g.f_norm_scalaropt_dtype(2, Kind::Float)?.f_to_device(first.device()))
                .collect::<tch::Result<Vec<_>>>()?;
            Tensor::f_stack(&norms, 0)?.f_square()?.f_sum(Kind::Float)?.f_sqrt()
        });
        Ok(PreparedUpdate { grads, norm: norm.map_err(Error::torch("gradient norm"))? })
    }

    /// The second half of [`AdamW::clip_and_step`]: `norm` is the value of `update.norm`. When
    /// it is not finite nothing is updated and an error is returned.
    pub fn apply_update(&mut self, update: PreparedUpdate, norm: f64, max_norm: f64) -> Result<()> {
        if update.grads.is_empty() {
            self.steps += 1;
            return Ok(());
        }
        if !norm.is_finite() {
            return Err(Error::Torch {
                what: "optimizer step".into(),
                source: tch::TchError::Kind(format!("gradient norm is {norm}; the update was not applied")),
            });
        }
        let coef = (max_norm > 0.0).then(|| (max_norm / (norm + 1e-6)).min(1.0));
        self.update(&update.grads, coef)
    }

    /// Creates the flat groups and moments on first use, re-attaches moved parameters, and
    /// gathers each group's gradient as one vector in the parameters' dtype.
    fn prepare(&mut self, params: &[Tensor]) -> Result<Vec<Tensor>> {
        if self.groups.is_empty() {
            self.groups = FlatBucket::group(params)?.into_iter().map(with_zero_moments).collect();
            self.params = params.len();
        }
        if self.params != params.len() {
            return Err(Error::config(
                "optimizer",
                format!("state holds {} tensors, got {} parameters", self.params, params.len()),
            ));
        }
        self.groups
            .iter()
            .map(|(bucket, _, _)| {
                bucket.attach(params)?;
                bucket.gradient(params)
            })
            .collect()
    }

    /// One AdamW update of every group from its flat gradient, scaled by `coef` if given.
    fn update(&mut self, grads: &[Tensor], coef: Option<f64>) -> Result<()> {
        self.steps += 1;
        let (b1, b2) = self.cfg.betas;
        let (lr, wd, eps) = (self.cfg.learning_rate, self.cfg.weight_decay, self.cfg.eps);
        let bias1 = 1.0 - b1.powi(self.steps as i32);
        let bias2_sqrt = (1.0 - b2.powi(self.steps as i32)).sqrt();
        let scalars = AdamWScalars {
            decay: 1.0 - lr * wd,
            w1: 1.0 - b1,
            w2: 1.0 - b2,
            step_size: lr / bias1,
            bias2_sqrt,
            eps,
            coef: coef.unwrap_or(1.0),
        };
        let mut unfused = Vec::new();
        for (index, ((bucket, m, v), grad)) in self.groups.iter().zip(grads).enumerate() {
            if self.fused && kernel_runs_on(bucket.values.device()) {
                fused_adamw_step(&bucket.values, grad, m, v, &scalars)?;
            } else {
                unfused.push(index);
            }
        }
        let run = || -> tch::Result<()> {
            for index in unfused {
                let ((bucket, m, v), grad) = (&mut self.groups[index], &grads[index]);
                let mut grad = grad.f_to_kind(Kind::Float)?;
                if let Some(coef) = coef {
                    let _ = grad.f_mul_scalar_(coef)?;
                }
                let f32_values = bucket.values.kind() == Kind::Float;
                let mut p32 =
                    if f32_values { bucket.values.shallow_clone() } else { bucket.values.f_to_kind(Kind::Float)? };
                let _ = p32.f_mul_scalar_(1.0 - lr * wd)?;
                let _ = m.f_lerp_(&grad, 1.0 - b1)?;
                let _ = v.f_lerp_(&grad.f_square()?, 1.0 - b2)?;
                let mut denom = v.f_sqrt()?;
                let _ = denom.f_div_scalar_(bias2_sqrt)?.f_add_scalar_(eps)?;
                let _ = p32.f_addcdiv_(&m.f_mul_scalar(-lr / bias1)?, &denom)?;
                if !f32_values {
                    bucket.values.f_copy_(&p32)?;
                }
            }
            Ok(())
        };
        tch::no_grad(run).map_err(Error::torch(format!("AdamW step {}", self.steps)))
    }

    /// The state as named tensors: `step` (a scalar), `exp_avg.{i}` and `exp_avg_sq.{i}` for
    /// parameter `i` of the list given to [`AdamW::step`] (views of the flat moments).
    pub fn named_state(&self) -> Vec<(String, Tensor)> {
        let mut per_param: Vec<(usize, Tensor, Tensor)> = Vec::with_capacity(self.params);
        for (bucket, m, v) in &self.groups {
            for (j, &i) in bucket.members.iter().enumerate() {
                per_param.push((i, bucket.view(m, j), bucket.view(v, j)));
            }
        }
        per_param.sort_by_key(|(i, _, _)| *i);
        let mut state = vec![(STEP_STATE_NAME.to_string(), Tensor::from(self.steps))];
        for (i, m, v) in per_param {
            state.push((format!("exp_avg.{i}"), m));
            state.push((format!("exp_avg_sq.{i}"), v));
        }
        state
    }

    /// Restores state saved by [`AdamW::named_state`] for `params` (moments move to each
    /// parameter's device; shapes must match). The parameters move into flat buffers.
    pub fn load_named_state(&mut self, state: &[(String, Tensor)], params: &[Tensor]) -> Result<()> {
        let find = |name: &str| {
            state
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t)
                .ok_or_else(|| Error::model("optimizer state", format!("missing {name}")))
        };
        let steps = find(STEP_STATE_NAME)?.int64_value(&[]);
        let groups: Vec<_> = FlatBucket::group(params)?.into_iter().map(with_zero_moments).collect();
        for (bucket, m, v) in &groups {
            for (j, &i) in bucket.members.iter().enumerate() {
                for (prefix, moments) in [("exp_avg", m), ("exp_avg_sq", v)] {
                    let name = format!("{prefix}.{i}");
                    let (saved, mut slot) = (find(&name)?, bucket.view(moments, j));
                    if saved.size() != slot.size() {
                        let message = format!("{name} has shape {:?}, parameter has {:?}", saved.size(), slot.size());
                        return Err(Error::model("optimizer state", message));
                    }
                    tch::no_grad(|| slot.f_copy_(saved)).map_err(Error::torch(format!("restore {name}")))?;
                }
            }
        }
        *self = Self { cfg: self.cfg.clone(), steps, groups, params: params.len(), fused: self.fused };
        Ok(())
    }
}

/// Whether the fused kernel can run on `device` (CUDA, and our kernels compiled there). When
/// they cannot, says so once per process; the tensor-op path runs instead. Every rank of a
/// data-parallel group runs the same binary on the same kind of host, so all take the same path.
fn kernel_runs_on(device: tch::Device) -> bool {
    if !device.is_cuda() {
        return false;
    }
    let Some(reason) = crate::kernels::unavailable(device) else { return true };
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| tracing::warn!("fused AdamW unavailable, using tensor ops: {reason}"));
    false
}

/// A bucket with zero f32 first and second moments of its size.
fn with_zero_moments(bucket: FlatBucket) -> (FlatBucket, Tensor, Tensor) {
    let options = (Kind::Float, bucket.values.device());
    let (m, v) = (Tensor::zeros([bucket.numel()], options), Tensor::zeros([bucket.numel()], options));
    (bucket, m, v)
}

/// Scales all gradients so their global L2 norm is at most `max_norm` (0 disables), as
/// `torch.nn.utils.clip_grad_norm_` does (coefficient `max_norm / (norm + 1e-6)`, capped at 1).
/// Returns the norm before clipping as a scalar tensor (no host sync).
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Tensor {
    tch::no_grad(|| {
        let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).filter(|g| g.defined()).collect();
        let Some(first) = grads.first() else { return Tensor::from(0.0f32) };
        let squares: Vec<Tensor> = grads.iter().map(|g| g.to_kind(Kind::Float).square().sum(Kind::Float)).collect();
        let total = Tensor::stack(&squares, 0).to_device(first.device()).sum(Kind::Float).sqrt();
        if max_norm > 0.0 {
            let coef = (max_norm / (&total + 1e-6)).clamp_max(1.0);
            for g in &grads {
                let _ = g.shallow_clone().g_mul_(&coef.to_kind(g.kind()));
            }
        }
        total
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_step_moves_each_weight_by_about_the_learning_rate() {
        let p = Tensor::from_slice(&[1.0f32, -1.0]).set_requires_grad(true);
        (&p * Tensor::from_slice(&[2.0f32, -3.0])).sum(Kind::Float).backward();
        let cfg = OptimizerConfig { learning_rate: 0.1, weight_decay: 0.0, ..OptimizerConfig::default() };
        let mut opt = AdamW::new(cfg);
        opt.step(std::slice::from_ref(&p)).unwrap();
        let after: Vec<f32> = Vec::try_from(p.detach()).unwrap();
        assert!((after[0] - 0.9).abs() < 1e-5 && (after[1] + 0.9).abs() < 1e-5, "{after:?}");
        assert_eq!(opt.steps(), 1);
    }

    #[test]
    fn parameters_stepped_together_move_as_if_stepped_alone() {
        let make = || {
            let a = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 3.0]).reshape([2, 2]).set_requires_grad(true);
            let b = Tensor::from_slice(&[0.25f32, 4.0]).set_requires_grad(true);
            (a, b)
        };
        let backward = |a: &Tensor, b: &Tensor| {
            a.shallow_clone().zero_grad();
            b.shallow_clone().zero_grad();
            ((a * a).sum(Kind::Float) * 0.3 + (b * a.narrow(0, 0, 1).squeeze()).sum(Kind::Float)).backward();
        };
        let cfg = OptimizerConfig { learning_rate: 0.05, weight_decay: 0.1, ..OptimizerConfig::default() };
        let (a1, b1) = make();
        let (a2, b2) = make();
        let mut together = AdamW::new(cfg.clone());
        let (mut alone_a, mut alone_b) = (AdamW::new(cfg.clone()), AdamW::new(cfg));
        for _ in 0..3 {
            backward(&a1, &b1);
            together.step(&[a1.shallow_clone(), b1.shallow_clone()]).unwrap();
            backward(&a2, &b2);
            alone_a.step(std::slice::from_ref(&a2)).unwrap();
            alone_b.step(std::slice::from_ref(&b2)).unwrap();
        }
        assert!(a1.allclose(&a2, 1e-6, 1e-7, false) && b1.allclose(&b2, 1e-6, 1e-7, false), "{a1} {a2} {b1} {b2}");
        assert!((a1.double_value(&[0, 0]) - 1.0).abs() > 0.1, "the weights moved");
    }

    #[test]
    fn named_state_round_trips() {
        let p = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        p.sum(Kind::Float).backward();
        let mut opt = AdamW::new(OptimizerConfig::default());
        opt.step(std::slice::from_ref(&p)).unwrap();
        let mut restored = AdamW::new(OptimizerConfig::default());
        restored.load_named_state(&opt.named_state(), std::slice::from_ref(&p)).unwrap();
        assert_eq!(restored.steps(), 1);
        let names: Vec<String> = restored.named_state().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, vec!["step", "exp_avg.0", "exp_avg_sq.0"]);
        let (ours, theirs) = (opt.named_state(), restored.named_state());
        assert!(ours.iter().zip(&theirs).all(|((_, a), (_, b))| a.equal(b)));
        assert!(ours[1].1.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    }

    #[test]
    fn gradients_are_clipped_to_the_global_norm() {
        let a = Tensor::from_slice(&[0.0f32]).set_requires_grad(true);
        let b = Tensor::from_slice(&[0.0f32]).set_requires_grad(true);
        (&a * 3.0 + &b * 4.0).sum(Kind::Float).backward();
        let norm = clip_grad_norm(&[a.shallow_clone(), b.shallow_clone()], 1.0);
        assert!((norm.double_value(&[]) - 5.0).abs() < 1e-6);
        assert!((a.grad().double_value(&[0]) - 0.6).abs() < 1e-5);
        assert!((b.grad().double_value(&[0]) - 0.8).abs() < 1e-5);
    }
}
