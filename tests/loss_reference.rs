//! The policy loss, its gradients and the optimizer step match PyTorch
//! (tests/reference/loss_ref.py run with $TRAINQ_PYTHON), on a linear log-softmax policy whose
//! weight W stands in for the LoRA weights. `TRAINQ_TEST_DEVICE=cuda` runs our side on the GPU.

use std::process::Command;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};
use trainq_engine::model::loss::{policy_loss, LossInputs};
use trainq_engine::tokenize::{pack, MicroBatch, PackItem, TokenizedTrajectory};
use trainq_engine::train::{PolicyModel, Trainer};
use trainq_engine::Result;
use trainq_queue::config::{LossConfig, LossKind, LossNormalization, RatioLevel, TrainConfig};

const VOCAB: i64 = 7;
const DIM: i64 = 5;

/// log_softmax(E[input]·W) gathered at the targets; with LoRA "disabled" it uses the initial W.
struct LinearPolicy {
    embed: Tensor,
    weight: Tensor,
    initial: Tensor,
    lora_enabled: bool,
}

impl LinearPolicy {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let embed = random(&mut rng, &[VOCAB, DIM], 1.5);
        let weight = random(&mut rng, &[DIM, VOCAB], 0.5).set_requires_grad(true);
        let initial = weight.detach().copy();
        Self { embed, weight, initial, lora_enabled: true }
    }

    fn logprobs_of(&self, ids: &[i64]) -> Vec<f32> {
        let input = on_device(Tensor::from_slice(&ids[..ids.len() - 1]).unsqueeze(0));
        let targets = on_device(Tensor::from_slice(&ids[1..]).unsqueeze(0));
        Vec::try_from(self.token_logprobs(&input, &input, &targets).unwrap().flatten(0, -1)).unwrap()
    }
}

impl PolicyModel for LinearPolicy {
    fn token_logprobs(&self, input_ids: &Tensor, _position_ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let w = if self.lora_enabled { &self.weight } else { &self.initial };
        let logits = self.embed.index_select(0, &input_ids.flatten(0, -1)).matmul(w);
        let lp = logits.log_softmax(-1, Kind::Float).gather(1, &targets.flatten(0, -1).unsqueeze(1), false);
        Ok(lp.reshape(input_ids.size()))
    }
    fn trainable_variables(&self) -> Vec<Tensor> {
        vec![self.weight.shallow_clone()]
    }
    fn set_lora_enabled(&mut self, enabled: bool) {
        self.lora_enabled = enabled;
    }
    fn set_logit_temperature(&mut self, temperature: f64) {
        assert_eq!(temperature, 1.0, "the reference scripts sample at temperature 1");
    }
}

/// Uniform in [−scale, scale], from a seeded generator (tch's global RNG is shared by the
/// tests running in parallel, so it would make the data differ between runs).
fn random(rng: &mut StdRng, shape: &[i64], scale: f32) -> Tensor {
    let n = shape.iter().product::<i64>() as usize;
    let values: Vec<f32> = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
    on_device(Tensor::from_slice(&values).reshape(shape))
}

/// The device under test: CPU, or `TRAINQ_TEST_DEVICE=cuda` to check the GPU path against the
/// same PyTorch (CPU) reference.
fn test_device() -> Device {
    match std::env::var("TRAINQ_TEST_DEVICE").as_deref() {
        Ok("cuda") => {
            assert!(tch::Cuda::is_available(), "TRAINQ_TEST_DEVICE=cuda but CUDA is not available");
            Device::Cuda(0)
        }
        _ => Device::Cpu,
    }
}

fn on_device(t: Tensor) -> Tensor {
    t.to_device(test_device())
}

fn floats(t: &Tensor) -> Vec<f32> {
    Vec::try_from(t.flatten(0, -1).to_kind(Kind::Float).to_device(Device::Cpu)).unwrap()
}

fn nan_as_null(values: &[f32]) -> Value {
    json!(values.iter().map(|v| if v.is_nan() { None } else { Some(*v) }).collect::<Vec<_>>())
}

fn run_reference(spec: &Value) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.json"), dir.path().join("out.json"));
    std::fs::write(&input, spec.to_string()).unwrap();
    let python = std::env::var("TRAINQ_PYTHON").expect("TRAINQ_PYTHON is set by ops/setup.sh's env file");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/reference/loss_ref.py");
    let status = Command::new(python).arg(script).arg(&input).arg(&output).status().unwrap();
    assert!(status.success(), "loss_ref.py failed");
    serde_json::from_str(&std::fs::read_to_string(output).unwrap()).unwrap()
}

fn assert_close(ours: f64, theirs: &Value, tol: f64, what: &str) {
    let theirs = theirs.as_f64().unwrap_or_else(|| panic!("{what}: reference has no number"));
    assert!((ours - theirs).abs() <= tol, "{what}: ours {ours}, PyTorch {theirs}");
}

fn assert_all_close(ours: &[f32], theirs: &Value, tol: f64, what: &str) {
    let theirs: Vec<f64> = serde_json::from_value(theirs.clone()).unwrap();
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    let worst = ours.iter().zip(&theirs).map(|(a, b)| (f64::from(*a) - b).abs()).fold(0.0, f64::max);
    assert!(worst <= tol, "{what}: max abs difference {worst:e} > {tol:e}");
}

fn loss_configs() -> Vec<(LossConfig, bool)> {
    let base = LossConfig::default();
    let seq_mean = LossNormalization::SequenceMean;
    vec![
        (base.clone(), false),
        (LossConfig { epsilon_high: Some(0.28), kl_coef: 0.1, ..base.clone() }, true),
        (LossConfig { kind: LossKind::Cispo, ..base.clone() }, false),
        (LossConfig { ratio_level: RatioLevel::Sequence, normalization: seq_mean, ..base.clone() }, false),
        (
            LossConfig {
                kind: LossKind::Cispo,
                ratio_level: RatioLevel::Sequence,
                kl_coef: 0.05,
                normalization: seq_mean,
                ..base.clone()
            },
            true,
        ),
        (LossConfig { kl_coef: 0.2, normalization: seq_mean, ..base }, true),
    ]
}

/// Per-token data of 4 sequences × 6 tokens (first two of each untrained, last sequence
/// half padding), with sampler log-probs perturbed from the model's and a few missing.
struct TokenData {
    x: Tensor,
    targets: Tensor,
    sampler: Vec<f32>,
    advantages: Vec<f32>,
    mask: Vec<bool>,
    sequence_index: Vec<i64>,
}

fn token_data(weight: &Tensor) -> TokenData {
    let mut rng = StdRng::seed_from_u64(7);
    let n = 24;
    let x = random(&mut rng, &[n, DIM], 1.5);
    let targets = on_device(Tensor::from_slice(&(0..n).map(|_| rng.gen_range(0..VOCAB)).collect::<Vec<i64>>()));
    let logp = x.matmul(weight).log_softmax(-1, Kind::Float).gather(1, &targets.unsqueeze(1), false).squeeze_dim(1);
    let mut sampler = floats(&(logp.detach() + random(&mut rng, &[n], 0.5)));
    for i in [3, 9, 16] {
        sampler[i] = f32::NAN;
    }
    let sequence_index: Vec<i64> = (0..n).map(|t| if t >= 21 { -1 } else { t / 6 }).collect();
    let mask = (0..n as usize).map(|t| t % 6 >= 2 && t < 21).collect();
    let advantages = sequence_index.iter().map(|&s| [1.0, -0.5, 2.0, -1.5][s.max(0) as usize]).collect();
    TokenData { x, targets, sampler, advantages, mask, sequence_index }
}

#[test]
fn loss_gradients_match_pytorch_for_ppo_cispo_gspo_kl_and_sequence_mean() {
    let mut rng = StdRng::seed_from_u64(3);
    let weight = random(&mut rng, &[DIM, VOCAB], 0.8).set_requires_grad(true);
    let reference_w = weight.detach() + random(&mut rng, &[DIM, VOCAB], 0.3);
    let d = token_data(&weight);
    let mut ours = Vec::new();
    let mut cases = Vec::new();
    for (cfg, with_kl) in loss_configs() {
        let normalizer = match cfg.normalization {
            LossNormalization::TokenMean => 17.0 + 5.0, // more than this batch's 17 tokens: a global count
            LossNormalization::SequenceMean => 4.0 + 2.0,
        };
        let mut w = weight.detach().copy().set_requires_grad(true);
        let logp = d.x.matmul(&w).log_softmax(-1, Kind::Float).gather(1, &d.targets.unsqueeze(1), false).squeeze_dim(1);
        let reference = with_kl.then(|| {
            d.x.matmul(&reference_w)
                .log_softmax(-1, Kind::Float)
                .gather(1, &d.targets.unsqueeze(1), false)
                .squeeze_dim(1)
        });
        let (sampler, advantages) =
            (on_device(Tensor::from_slice(&d.sampler)), on_device(Tensor::from_slice(&d.advantages)));
        let (mask, seq) = (on_device(Tensor::from_slice(&d.mask)), on_device(Tensor::from_slice(&d.sequence_index)));
        let inputs = LossInputs {
            logprobs: &logp,
            sampler_logprobs: &sampler,
            advantages: &advantages,
            mask: &mask,
            sequence_index: &seq,
            num_sequences: 4,
            reference_logprobs: reference.as_ref(),
        };
        let out = policy_loss(&inputs, &cfg, normalizer).unwrap();
        out.loss.backward();
        let parts = [&out.loss, &out.policy_loss, &out.kl, &out.clipped_tokens, &out.ratio_sum, &out.tokens]
            .map(|t| t.double_value(&[]));
        ours.push((cfg.clone(), parts, floats(&w.grad())));
        w.zero_grad();
        cases.push(json!({
            "config": serde_json::to_value(&cfg).unwrap(), "normalizer": normalizer,
            "x": floats(&d.x), "w": floats(&weight), "targets": Vec::<i64>::try_from(&d.targets.to_device(Device::Cpu)).unwrap(),
            "reference_w": with_kl.then(|| floats(&reference_w)),
            "sampler_logprobs": nan_as_null(&d.sampler), "advantages": d.advantages, "mask": d.mask, "sequence_index": d.sequence_index,
        }));
    }
    for c in &mut cases {
        let (x, w) = (c["x"].clone(), c["w"].clone());
        c["x"] = json!(x.as_array().unwrap().chunks(DIM as usize).map(|r| r.to_vec()).collect::<Vec<_>>());
        c["w"] = json!(w.as_array().unwrap().chunks(VOCAB as usize).map(|r| r.to_vec()).collect::<Vec<_>>());
        if let Some(r) = c["reference_w"].as_array().cloned() {
            c["reference_w"] = json!(r.chunks(VOCAB as usize).map(|r| r.to_vec()).collect::<Vec<_>>());
        }
    }
    let reference = run_reference(&json!({"loss_cases": cases, "trainers": []}));
    let mut clipped_somewhere = false;
    for ((cfg, parts, grad), theirs) in ours.iter().zip(reference["loss_cases"].as_array().unwrap()) {
        let what = format!("{cfg:?}");
        for (value, key) in parts.iter().zip(["loss", "policy_loss", "kl", "clipped_tokens", "ratio_sum", "tokens"]) {
            assert_close(*value, &theirs[key], 1e-4, &format!("{what} {key}"));
        }
        assert_all_close(grad, &theirs["grad_w"], 1e-4, &format!("{what} grad W"));
        assert!(grad.iter().any(|g| g.abs() > 1e-3), "{what}: gradient is not trivially zero");
        clipped_somewhere |= parts[3] > 0.0;
    }
    assert!(clipped_somewhere, "the data exercises clipping");
}

fn trajectories(model: &LinearPolicy) -> Vec<(TokenizedTrajectory, f32)> {
    let specs: [(&[i64], usize, f32); 5] = [
        (&[0, 1, 2, 3, 4], 2, 1.0),
        (&[0, 5, 6, 6, 1, 2, 3], 3, -1.0),
        (&[1, 2, 2, 4, 4, 4, 0, 1, 6], 4, 0.5),
        (&[3, 3, 1, 0], 1, -0.5),
        (&[6, 5, 4, 3, 2, 1], 2, 1.5),
    ];
    specs
        .iter()
        .enumerate()
        .map(|(k, (ids, prompt, advantage))| {
            let lp = model.logprobs_of(ids);
            let sampler_logprobs = (0..ids.len())
                .map(|p| (p >= *prompt && (p + k) % 4 != 0).then(|| lp[p - 1] + 0.2 * ((p * 7 + k) % 5) as f32 - 0.4))
                .collect();
            let trained = (0..ids.len()).map(|p| p >= *prompt).collect();
            (TokenizedTrajectory { ids: ids.to_vec(), trained, sampler_logprobs }, *advantage)
        })
        .collect()
}

fn batch_json(b: &MicroBatch) -> Value {
    json!({
        "input_ids": b.input_ids, "targets": b.targets, "loss_mask": b.loss_mask,
        "sampler_logprobs": nan_as_null(&b.sampler_logprobs), "advantages": b.advantages, "sequence_index": b.sequence_index,
    })
}

fn train_config(loss: LossConfig) -> TrainConfig {
    let mut cfg = TrainConfig { loss, ..TrainConfig::default() };
    cfg.optimizer.learning_rate = 0.05;
    cfg.optimizer.max_grad_norm = 0.3;
    cfg
}

#[test]
fn optimizer_steps_match_pytorch_adamw_with_clipping_and_accumulation() {
    const STEPS: usize = 3;
    let configs = [
        train_config(LossConfig { kl_coef: 0.05, ..LossConfig::default() }),
        train_config(LossConfig {
            kind: LossKind::Cispo,
            ratio_level: RatioLevel::Sequence,
            normalization: LossNormalization::SequenceMean,
            ..LossConfig::default()
        }),
    ];
    let mut specs = Vec::new();
    let mut ours = Vec::new();
    for cfg in &configs {
        let mut model = LinearPolicy::new(11);
        let data = trajectories(&model);
        let items: Vec<PackItem<'_>> = data.iter().map(|(t, a)| PackItem { trajectory: t, advantage: *a }).collect();
        let batches = pack(&items, 14, 10).unwrap();
        assert!(batches.len() >= 2, "gradient accumulation over several micro-batches");
        let embed = floats(&model.embed).chunks(DIM as usize).map(|r| r.to_vec()).collect::<Vec<_>>();
        let w = floats(&model.weight).chunks(VOCAB as usize).map(|r| r.to_vec()).collect::<Vec<_>>();
        specs.push(json!({
            "embed": embed, "w": w, "config": serde_json::to_value(cfg).unwrap(), "steps": STEPS,
            "batches": batches.iter().map(batch_json).collect::<Vec<_>>(),
        }));
        let mut trainer = Trainer::new(cfg, test_device());
        let steps: Vec<_> =
            (0..STEPS).map(|_| (trainer.step(&mut model, &batches).unwrap(), floats(&model.weight))).collect();
        ours.push(steps);
    }
    let reference = run_reference(&json!({"loss_cases": [], "trainers": specs}));
    for (k, (steps, theirs)) in ours.iter().zip(reference["trainers"].as_array().unwrap()).enumerate() {
        for (i, ((metrics, w), t)) in steps.iter().zip(theirs.as_array().unwrap()).enumerate() {
            assert_close(metrics.loss, &t["loss"], 1e-5, &format!("config {k} step {i} loss"));
            assert_close(metrics.grad_norm, &t["grad_norm"], 1e-5, &format!("config {k} step {i} grad norm"));
            assert_all_close(w, &t["w"], 1e-5, &format!("config {k} step {i} W"));
        }
        assert!(
            steps[0].0.grad_norm > configs[k].optimizer.max_grad_norm,
            "config {k}: clipping is exercised ({:?})",
            steps[0].0
        );
    }
}

#[test]
fn training_steps_raise_the_logprob_of_positively_rewarded_tokens() {
    let mut model = LinearPolicy::new(5);
    let good_ids = [0i64, 1, 2, 3];
    let sampled = |ids: &[i64], m: &LinearPolicy| {
        let lp = m.logprobs_of(ids);
        let sampler_logprobs = std::iter::once(None).chain(lp.into_iter().map(Some)).collect();
        TokenizedTrajectory { ids: ids.to_vec(), trained: vec![false, true, true, true], sampler_logprobs }
    };
    let (good, bad) = (sampled(&good_ids, &model), sampled(&[0, 4, 5, 5], &model));
    let items = [PackItem { trajectory: &good, advantage: 1.0 }, PackItem { trajectory: &bad, advantage: -1.0 }];
    let batches = pack(&items, 4, 4).unwrap();
    assert_eq!(batches.len(), 2, "a budget of 4 tokens puts each trajectory in its own micro-batch");
    let mut cfg = train_config(LossConfig { kl_coef: 0.01, ..LossConfig::default() });
    cfg.optimizer.max_grad_norm = 1.0;
    let mut trainer = Trainer::new(&cfg, test_device());
    let before: f32 = model.logprobs_of(&good_ids).iter().sum();
    let first = trainer.step(&mut model, &batches).unwrap();
    let mut last = first.clone();
    for _ in 0..15 {
        last = trainer.step(&mut model, &batches).unwrap();
    }
    let after: f32 = model.logprobs_of(&good_ids).iter().sum();
    assert_eq!((first.tokens, first.sequences, first.micro_batches), (6, 2, 2));
    assert!(last.loss < first.loss - 0.1, "loss {} → {}", first.loss, last.loss);
    assert!(after > before + 0.3, "log-prob of the rewarded completion {before} → {after}");
    assert!(last.kl > 0.0 && last.mean_ratio > 0.0 && first.grad_norm > 0.0);
}
