//! `trainq model create|list|show`: register and inspect the policies being trained.

use anyhow::{Context, Result};
use clap::Subcommand;
use trainq_queue::config::TrainConfig;
use trainq_queue::db::{self, NewModel};

use crate::database::{block_on, DatabaseArgs};

/// Register and inspect models.
#[derive(Subcommand, Debug)]
pub(crate) enum ModelCommand {
    /// Register a model to train.
    Create(CreateArgs),
    /// List registered models.
    List {
        #[command(flatten)]
        db: DatabaseArgs,
    },
    /// Show one model with its full config as JSON.
    Show {
        /// Model name.
        name: String,
        #[command(flatten)]
        db: DatabaseArgs,
    },
}

/// `trainq model create NAME --base PATH_OR_URL [settings]`.
#[derive(clap::Args, Debug)]
pub(crate) struct CreateArgs {
    /// Unique model name (letters, digits, ".", "_", "-").
    name: String,
    /// Base model: a local Hugging Face directory or a URL.
    #[arg(long)]
    base: String,
    /// A JSON file with a full or partial training config (TrainConfig); flags below override it.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Train every weight instead of a LoRA adapter.
    #[arg(long)]
    full_fine_tune: bool,
    /// LoRA rank.
    #[arg(long)]
    lora_rank: Option<i64>,
    /// LoRA alpha.
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// AdamW learning rate.
    #[arg(long)]
    learning_rate: Option<f64>,
    /// Groups claimed per step.
    #[arg(long)]
    groups_per_step: Option<usize>,
    /// Accept groups sampled up to --max-staleness steps ago.
    #[arg(long)]
    async_weight_syncing: bool,
    /// Largest accepted current_step − policy_version with --async-weight-syncing.
    #[arg(long)]
    max_staleness: Option<i64>,
    /// Claims of one group before it is marked failed.
    #[arg(long)]
    max_attempts: Option<i32>,
    /// Lease length of a claim, in seconds.
    #[arg(long)]
    lease_seconds: Option<i64>,
    /// Largest number of trajectories accepted in one group.
    #[arg(long, default_value_t = db::models::DEFAULT_MAX_GROUP_TRAJECTORIES)]
    max_group_trajectories: i32,
    /// Largest uncompressed jsonb size of one group's trajectories, in bytes.
    #[arg(long, default_value_t = db::models::DEFAULT_MAX_GROUP_BYTES)]
    max_group_bytes: i32,
    /// Token ids of the model lie in [0, N): larger ones are refused on insert (TQ022).
    /// Default: `vocab_size` from the base's config.json (unknown, and unchecked, without one).
    #[arg(long)]
    vocab_size: Option<i32>,
    #[command(flatten)]
    db: DatabaseArgs,
}

impl CreateArgs {
    /// The config file (or defaults) with the flags applied, validated.
    fn train_config(&self) -> Result<TrainConfig> {
        let mut cfg = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
                let json: serde_json::Value =
                    serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
                TrainConfig::from_json(&json)?
            }
            None => TrainConfig::default(),
        };
        if self.full_fine_tune {
            cfg.lora = None;
        }
        if let Some(lora) = cfg.lora.as_mut() {
            lora.rank = self.lora_rank.unwrap_or(lora.rank);
            lora.alpha = self.lora_alpha.unwrap_or(lora.alpha);
        }
        let q = &mut cfg.queue;
        q.groups_per_step = self.groups_per_step.unwrap_or(q.groups_per_step);
        q.async_weight_syncing |= self.async_weight_syncing;
        q.max_staleness = self.max_staleness.unwrap_or(q.max_staleness);
        q.max_attempts = self.max_attempts.unwrap_or(q.max_attempts);
        q.lease_seconds = self.lease_seconds.unwrap_or(q.lease_seconds);
        cfg.optimizer.learning_rate = self.learning_rate.unwrap_or(cfg.optimizer.learning_rate);
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Runs one `trainq model …` command.
pub(crate) fn run(command: ModelCommand) -> Result<()> {
    block_on(async move {
        match command {
            ModelCommand::Create(args) => {
                let vocab_size = match args.vocab_size {
                    Some(n) => Some(n),
                    None => base_vocab_size(&args.base).await?,
                };
                let model = NewModel {
                    name: args.name.clone(),
                    base: args.base.clone(),
                    config: args.train_config()?,
                    max_group_trajectories: args.max_group_trajectories,
                    max_group_bytes: args.max_group_bytes,
                    vocab_size,
                };
                let pool = args.db.connect(2).await?;
                let created = db::create_model(&pool, &model).await?;
                let vocab =
                    created.vocab_size.map_or("unknown, token ids unchecked on insert".into(), |n| n.to_string());
                println!("created model {} (base {}, vocab_size {vocab})", created.name, created.base);
            }
            ModelCommand::List { db: args } => {
                let pool = args.connect(2).await?;
                println!("{:<24} {:>8}  {:<6} BASE", "MODEL", "STEP", "KIND");
                for m in db::list_models(&pool).await? {
                    let kind = if m.config.lora.is_some() { "lora" } else { "full" };
                    println!("{:<24} {:>8}  {:<6} {}", m.name, m.current_step, kind, m.base);
                }
            }
            ModelCommand::Show { name, db: args } => {
                let pool = args.connect(2).await?;
                let m = db::get_model(&pool, &name).await?;
                let shown = serde_json::json!({
                    "name": m.name, "base": m.base, "current_step": m.current_step,
                    "max_group_trajectories": m.max_group_trajectories, "max_group_bytes": m.max_group_bytes,
                    "vocab_size": m.vocab_size,
                    "created_at": m.created_at, "config": m.config,
                    "latest_checkpoint": db::latest_checkpoint(&pool, &name).await?,
                });
                println!("{}", serde_json::to_string_pretty(&shown)?);
            }
        }
        Ok(())
    })
}

/// The base model's vocabulary size from its config.json, when it has one we can read; a base
/// that is not reachable from here only leaves the size unknown (with a note).
async fn base_vocab_size(base: &str) -> Result<Option<i32>> {
    match trainq_queue::storage::read_vocab_size(base).await {
        Ok(Some(n)) => Ok(Some(i32::try_from(n).with_context(|| format!("{base}/config.json: vocab_size {n}"))?)),
        Ok(None) => {
            eprintln!("note: no vocab_size in {base}/config.json; pass --vocab-size to check token ids on insert");
            Ok(None)
        }
        Err(err) => {
            eprintln!(
                "note: could not read {base}/config.json ({err}); pass --vocab-size to check token ids on insert"
            );
            Ok(None)
        }
    }
}
