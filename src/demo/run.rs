//! The demo's driver: fresh database, tiny model, worker task and toy environment, then the
//! reward-per-step table and plot.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use serde_json::json;
use sqlx::PgPool;
use tch::Device;
use tokio_util::sync::CancellationToken;

use super::{assets, sample, task};
use crate::error::{Error, Result};
use crate::report::{line_chart, Chart, Series};
use crate::worker::Placement;
use crate::worker::{run_worker, WorkerOptions, WorkerSummary};
use trainq_engine::model::Policy;
use trainq_engine::tokenize::{ChatTokenizer, RenderRequest};
use trainq_engine::Error as EngineError;
use trainq_queue::config::{LoraConfig, TrainConfig};
use trainq_queue::db::groups::{queue_counts, submit_groups, NewGroup};
use trainq_queue::db::models::{create_model, get_model, NewModel};
use trainq_queue::storage::{fetch_checkpoint, FetchOptions, Store};
use trainq_queue::Error as QueueError;
use trainq_queue::StepNumber;

/// Name of the demo's model and database.
pub const DEMO_NAME: &str = "trainq_demo";

/// Sampling rounds in a row whose groups were all skipped (zero variance: the policy always
/// scores the same) after which the demo stops early.
const CONVERGED_AFTER_SKIPPED_ROUNDS: usize = 3;

/// Standard deviation of the tiny model's random weights.
const DEMO_INITIALIZER_RANGE: f64 = 0.2;
/// AdamW learning rate of the demo's LoRA adapters (high: the task is tiny and must move fast).
const DEMO_LEARNING_RATE: f64 = 4e-3;

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Server URL; the demo creates (and recreates) its own database `trainq_demo` there.
    pub database_url: String,
    /// Directory for the tiny model, the `file://` store and the outputs.
    pub work_dir: PathBuf,
    /// Training steps.
    pub steps: u64,
    /// Groups sampled per step.
    pub groups_per_step: usize,
    /// Completions per group.
    pub group_size: usize,
    /// Seed of the model's initialization and of sampling.
    pub seed: u64,
}

/// One row of the final table.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoRow {
    /// Checkpoint the groups were sampled from.
    pub policy_version: i64,
    /// Mean reward of everything sampled from it.
    pub reward_mean: f64,
    /// The step trained on those groups; None when every group was skipped (no step).
    pub step: Option<i64>,
}

/// Runs the demo; returns the reward per checkpoint and writes `reward.svg` into `work_dir`.
pub async fn run_demo(opts: &DemoOptions) -> Result<(Vec<DemoRow>, PathBuf)> {
    let url = trainq_queue::db::databases::recreate_database(&opts.database_url, DEMO_NAME).await?;
    let pool = PgPool::connect(&url).await.map_err(QueueError::db("connect to the demo database"))?;
    trainq_queue::migrate(&pool).await?;
    let _ = std::fs::remove_dir_all(&opts.work_dir);
    let model_dir = opts.work_dir.join("model");
    build_tiny_model(&model_dir, opts.seed as i64)?;
    create_model(
        &pool,
        &NewModel { config: demo_config(opts), ..NewModel::new(DEMO_NAME, model_dir.display().to_string()) },
    )
    .await?;
    let store_dir = opts.work_dir.join("store");
    std::fs::create_dir_all(&store_dir).map_err(EngineError::io(&store_dir))?;
    let store_url =
        format!("file://{}", std::fs::canonicalize(&store_dir).map_err(EngineError::io(&store_dir))?.display());

    let mut worker_opts = WorkerOptions::new(DEMO_NAME, &store_url, Placement::One(Device::Cpu));
    worker_opts.work_dir = opts.work_dir.join("worker");
    worker_opts.max_steps = Some(opts.steps);
    worker_opts.poll_interval = Duration::from_millis(200);
    let cancel = CancellationToken::new();
    let worker = {
        let (pool, cancel) = (pool.clone(), cancel.clone());
        tokio::spawn(async move { run_worker(&pool, &worker_opts, cancel).await })
    };
    let env = Environment::new(&model_dir, Store::open(&store_url)?, opts)?;
    let sampled = env.run(&pool, opts, &worker).await;
    cancel.cancel(); // the worker stops after its current step (or at once if it is waiting)
    worker.await.map_err(Error::task("the demo's worker task"))??;
    let rows = table_rows(&sampled?);
    let plot = opts.work_dir.join("reward.svg");
    let series = [Series::new("mean reward", rows.iter().map(|r| (r.policy_version, Some(r.reward_mean))))];
    let chart =
        Chart { y_from_zero: true, ..Chart::new("trainq demo: mean reward per checkpoint", "mean reward", &series) };
    let svg = line_chart(&chart);
    std::fs::write(&plot, svg).map_err(EngineError::io(&plot))?;
    Ok((rows, plot))
}

fn demo_config(opts: &DemoOptions) -> TrainConfig {
    let mut cfg = TrainConfig {
        lora: Some(LoraConfig { rank: 8, alpha: 32.0, ..LoraConfig::default() }),
        max_seq_len: 64,
        max_tokens_per_micro_batch: 1024,
        ..TrainConfig::default()
    };
    cfg.optimizer.learning_rate = DEMO_LEARNING_RATE;
    cfg.optimizer.weight_decay = 0.0;
    cfg.queue.groups_per_step = opts.groups_per_step;
    cfg.queue.lease_seconds = 60;
    cfg
}

/// Writes config.json, tokenizer files and random weights of a tiny Qwen3-shaped model.
pub fn build_tiny_model(dir: &Path, seed: i64) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(EngineError::io(dir))?;
    assets::write_tokenizer(dir)?;
    let mut cfg = trainq_engine::model::tiny_qwen3_config(assets::VOCAB_SIZE);
    // Larger than HF's 0.02: with 64-wide tied embeddings, 0.02 leaves every logit near 0 and
    // LoRA (which does not touch the embeddings) cannot make any token much likelier.
    cfg.extra.insert("initializer_range".into(), serde_json::json!(DEMO_INITIALIZER_RANGE));
    let policy = Policy::from_config(&cfg, None, Device::Cpu, seed)?;
    Ok(trainq_engine::checkpoint::hf::save_full(&policy, dir)?)
}

/// The toy environment: samples from the latest checkpoint and submits groups over SQL.
struct Environment {
    model_dir: PathBuf,
    store: Store,
    tokenizer: ChatTokenizer,
    eos: i64,
    rng: rand::rngs::StdRng,
}

impl Environment {
    fn new(model_dir: &Path, store: Store, opts: &DemoOptions) -> Result<Self> {
        let tokenizer = ChatTokenizer::from_dir(model_dir)?;
        let eos = tokenizer
            .tokenizer()
            .token_to_id("<|im_end|>")
            .ok_or_else(|| EngineError::Tokenize("demo tokenizer has no <|im_end|>".into()))? as i64;
        let rng = rand::rngs::StdRng::seed_from_u64(opts.seed);
        Ok(Environment { model_dir: model_dir.to_path_buf(), store, tokenizer, eos, rng })
    }

    /// For each checkpoint 0..steps: sample, submit, wait for the next checkpoint. Returns the
    /// mean sampled reward per round and whether a step followed.
    async fn run(
        mut self,
        pool: &PgPool,
        opts: &DemoOptions,
        worker: &tokio::task::JoinHandle<Result<WorkerSummary>>,
    ) -> Result<Vec<(i64, f64, bool)>> {
        let started = Instant::now();
        let mut rewards_per_version = Vec::new();
        let mut version = 0;
        let mut skipped_rounds = 0;
        while (version as u64) < opts.steps {
            let policy = self.load_policy(pool, version).await?;
            let mut rewards = Vec::new();
            let mut groups = Vec::new();
            for g in 0..opts.groups_per_step {
                let prompt = task::PROMPTS[(version as usize + g) % task::PROMPTS.len()];
                let (trajectories, r) = self.sample_group(&policy, prompt, opts.group_size)?;
                rewards.extend(r);
                let group = NewGroup {
                    model: DEMO_NAME.into(),
                    trajectories,
                    policy_version: Some(StepNumber(version)),
                    metadata: json!({"env": "digits"}),
                };
                groups.push(group);
            }
            // One transaction: the worker sees the whole batch at once.
            submit_groups(pool, &groups).await?;
            let mean = rewards.iter().sum::<f64>() / rewards.len().max(1) as f64;
            eprintln!(
                "[demo] checkpoint {version:>3}: sampled {} groups, mean reward {mean:.3}  ({:.1}s)",
                opts.groups_per_step,
                started.elapsed().as_secs_f64()
            );
            let next = wait_for_next_checkpoint(pool, version, worker).await?;
            rewards_per_version.push((version, mean, next > version));
            skipped_rounds = if next == version { skipped_rounds + 1 } else { 0 };
            if skipped_rounds == CONVERGED_AFTER_SKIPPED_ROUNDS {
                eprintln!("[demo] every group had zero reward variance {skipped_rounds} times in a row: converged");
                break;
            }
            version = next;
        }
        Ok(rewards_per_version)
    }

    async fn load_policy(&self, pool: &PgPool, version: i64) -> Result<Policy> {
        let lora = get_model(pool, DEMO_NAME).await?.config.lora;
        let policy = Policy::load(&self.model_dir, lora.as_ref(), Device::Cpu)?;
        if version > 0 {
            let dir = self.model_dir.with_file_name("env").join(format!("{version:06}"));
            let options = FetchOptions { replace_existing: true, ..FetchOptions::default() };
            fetch_checkpoint(&self.store, DEMO_NAME, StepNumber(version), &dir, &options, &|_| {}).await?;
            trainq_engine::checkpoint::peft::load_adapter(&policy, &dir)?;
        }
        Ok(policy)
    }

    fn sample_group(&mut self, policy: &Policy, prompt: &str, n: usize) -> Result<(serde_json::Value, Vec<f64>)> {
        let messages = vec![json!({"role": "user", "content": prompt})];
        let text =
            self.tokenizer.render(RenderRequest { messages: &messages, tools: None, add_generation_prompt: true })?;
        let encoding =
            self.tokenizer.tokenizer().encode(text, false).map_err(|e| EngineError::Tokenize(e.to_string()))?;
        let prompt_ids: Vec<i64> = encoding.get_ids().iter().map(|&i| i as i64).collect();
        let last_logits = |ids: &tch::Tensor| {
            let (b, l) = ids.size2().map_err(EngineError::torch("sample batch shape"))?;
            let positions = tch::Tensor::arange(l, (tch::Kind::Int64, Device::Cpu)).unsqueeze(0).repeat([b, 1]);
            let logits = tch::no_grad(|| policy.logits(ids, &positions))?;
            Ok(logits.select(1, l - 1))
        };
        let completions =
            sample::sample_completions(last_logits, &prompt_ids, n, task::SCORED_CHARS + 1, self.eos, &mut self.rng)?;
        let mut trajectories = Vec::new();
        let mut rewards = Vec::new();
        for c in completions {
            let visible: Vec<u32> = c.ids.iter().filter(|&&t| t != self.eos).map(|&t| t as u32).collect();
            let content =
                self.tokenizer.tokenizer().decode(&visible, true).map_err(|e| EngineError::Tokenize(e.to_string()))?;
            let reward = task::reward(&content);
            rewards.push(reward);
            trajectories.push(json!({
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": content, "token_ids": c.ids, "logprobs": c.logprobs},
                ],
                "reward": reward,
            }));
        }
        Ok((serde_json::Value::Array(trajectories), rewards))
    }
}

/// Waits until the worker commits checkpoint `version + 1` (returns it), or until every group of
/// this version was skipped without a step (returns `version`: sample again).
async fn wait_for_next_checkpoint(
    pool: &PgPool,
    version: i64,
    worker: &tokio::task::JoinHandle<Result<WorkerSummary>>,
) -> Result<i64> {
    loop {
        // Counts first: if the batch is gone and the step still has not moved, it was skipped.
        let counts = queue_counts(pool, Some(DEMO_NAME)).await?;
        let current = get_model(pool, DEMO_NAME).await?.current_step.get();
        if current > version {
            return Ok(current);
        }
        if counts.iter().all(|c| c.pending + c.claimed == 0) {
            return Ok(version);
        }
        if worker.is_finished() {
            return Err(Error::Task {
                what: "the demo's worker",
                message: "it stopped before the demo finished".into(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn table_rows(sampled: &[(i64, f64, bool)]) -> Vec<DemoRow> {
    sampled
        .iter()
        .map(|&(version, reward_mean, advanced)| DemoRow {
            policy_version: version,
            reward_mean,
            step: advanced.then_some(version + 1),
        })
        .collect()
}
