//! Table `trainq.models`: the policies being trained, their validated config and current step.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::ids::StepNumber;

/// Default largest number of trajectories in one group (column `max_group_trajectories`).
pub const DEFAULT_MAX_GROUP_TRAJECTORIES: i32 = 256;
/// Default largest jsonb size of one group's trajectories, in bytes (column `max_group_bytes`).
pub const DEFAULT_MAX_GROUP_BYTES: i32 = 16 * 1024 * 1024;

/// A registered model.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    /// Unique name that groups refer to.
    pub name: String,
    /// Base model directory or URL.
    pub base: String,
    /// Training config (validated).
    pub config: TrainConfig,
    /// Last committed step (0 before training).
    pub current_step: StepNumber,
    /// Largest number of trajectories accepted in one group.
    pub max_group_trajectories: i32,
    /// Largest uncompressed jsonb size of one group's trajectories, in bytes.
    pub max_group_bytes: i32,
    /// Token ids lie in `[0, vocab_size)`; larger ones are refused on insert (TQ022). `None`:
    /// unknown, not checked on insert.
    pub vocab_size: Option<i32>,
    /// When the model was registered.
    pub created_at: DateTime<Utc>,
}

/// What `create_model` needs.
#[derive(Debug, Clone, PartialEq)]
pub struct NewModel {
    /// Unique name (letters, digits, `.`, `_`, `-`).
    pub name: String,
    /// Base model directory or URL.
    pub base: String,
    /// Training config; validated before it is stored.
    pub config: TrainConfig,
    /// Largest number of trajectories in one group.
    pub max_group_trajectories: i32,
    /// Largest uncompressed jsonb size of one group's trajectories, in bytes.
    pub max_group_bytes: i32,
    /// The base model's vocabulary size (config.json `vocab_size`), if known: token ids at or
    /// beyond it are refused on insert.
    pub vocab_size: Option<i32>,
}

impl NewModel {
    /// A model with the default config and group limits.
    pub fn new(name: impl Into<String>, base: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            base: base.into(),
            config: TrainConfig::default(),
            max_group_trajectories: DEFAULT_MAX_GROUP_TRAJECTORIES,
            max_group_bytes: DEFAULT_MAX_GROUP_BYTES,
            vocab_size: None,
        }
    }
}

type ModelRow = (String, String, serde_json::Value, i64, i32, i32, Option<i32>, DateTime<Utc>);

const MODEL_COLUMNS: &str =
    "name, base, config, current_step, max_group_trajectories, max_group_bytes, vocab_size, created_at";

fn model_from_row(row: ModelRow) -> Result<Model> {
    let (name, base, config, current_step, max_group_trajectories, max_group_bytes, vocab_size, created_at) = row;
    let config = TrainConfig::from_json(&config)
        .map_err(|e| Error::config(format!("model {name:?} stored config"), e.to_string()))?;
    Ok(Model {
        name,
        base,
        config,
        current_step: StepNumber(current_step),
        max_group_trajectories,
        max_group_bytes,
        vocab_size,
        created_at,
    })
}

/// Registers a model after validating its config; the stored config has every default filled in.
pub async fn create_model(pool: &PgPool, model: &NewModel) -> Result<Model> {
    model.config.validate()?;
    let config = serde_json::to_value(&model.config).map_err(Error::json("model config"))?;
    let row: ModelRow = sqlx::query_as(&format!(
        "INSERT INTO trainq.models (name, base, config, max_group_trajectories, max_group_bytes, vocab_size) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING {MODEL_COLUMNS}"
    ))
    .bind(&model.name)
    .bind(&model.base)
    .bind(config)
    .bind(model.max_group_trajectories)
    .bind(model.max_group_bytes)
    .bind(model.vocab_size)
    .fetch_one(pool)
    .await
    .map_err(Error::db(format!("create model {:?}", model.name)))?;
    model_from_row(row)
}

/// One model by name; [`Error::UnknownModel`] when it is not registered.
pub async fn get_model(pool: &PgPool, name: &str) -> Result<Model> {
    let row: Option<ModelRow> = sqlx::query_as(&format!("SELECT {MODEL_COLUMNS} FROM trainq.models WHERE name = $1"))
        .bind(name)
        .fetch_optional(pool)
        .await
        .map_err(Error::db(format!("get model {name:?}")))?;
    model_from_row(row.ok_or_else(|| Error::UnknownModel(name.to_string()))?)
}

/// Every model, by name.
pub async fn list_models(pool: &PgPool) -> Result<Vec<Model>> {
    let rows: Vec<ModelRow> = sqlx::query_as(&format!("SELECT {MODEL_COLUMNS} FROM trainq.models ORDER BY name"))
        .fetch_all(pool)
        .await
        .map_err(Error::db("list models"))?;
    rows.into_iter().map(model_from_row).collect()
}
