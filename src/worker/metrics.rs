//! The worker's Prometheus endpoint (`--metrics-addr`, off by default): steps committed, skipped
//! passes, step phase durations, tokens/s and GPU memory from this process, and — read from the
//! database at each scrape, the same numbers `trainq status` prints — groups by state and skip
//! reason, skipped passes of every worker, queue depth and the oldest pending group's age of
//! the model.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus::{Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use trainq_queue::db::skipped_passes::count_skipped_passes;
use trainq_queue::db::{queue_counts, StepRecord};

use crate::report::tokens_per_second;
use crate::{Error, Result};

/// Buckets of the step phase histogram, in seconds.
const PHASE_BUCKETS: [f64; 12] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

/// The worker's metrics: a registry and the series the worker updates.
pub struct WorkerMetrics {
    registry: Registry,
    model: String,
    devices: Vec<String>,
    steps: IntCounterVec,
    skipped_passes: IntCounterVec,
    groups_in_steps: IntCounterVec,
    phase_seconds: HistogramVec,
    tokens_per_second: GaugeVec,
    queue_groups: IntGaugeVec,
    skipped_groups: IntGaugeVec,
    oldest_pending: GaugeVec,
    current_step: IntGaugeVec,
    model_skipped_passes: IntGaugeVec,
    gpu_memory_used: IntGaugeVec,
    gpu_memory_total: IntGaugeVec,
}

fn registered<C: prometheus::core::Collector + Clone + 'static>(registry: &Registry, collector: C) -> C {
    registry.register(Box::new(collector.clone())).expect("metric names are unique");
    collector
}

impl WorkerMetrics {
    /// Metrics of a worker training `model` on `devices` (e.g. `["cuda:0"]`).
    pub fn new(model: &str, devices: Vec<String>) -> WorkerMetrics {
        let r = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            registered(&r, IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
        };
        let int_gauge = |name: &str, help: &str, labels: &[&str]| {
            registered(&r, IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            registered(&r, GaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
        };
        let phase_opts = HistogramOpts::new("trainq_step_phase_seconds", "Seconds per step phase (this worker)")
            .buckets(PHASE_BUCKETS.to_vec());
        WorkerMetrics {
            model: model.to_string(),
            devices,
            steps: counter("trainq_steps_total", "Steps committed by this worker", &["model"]),
            skipped_passes: counter(
                "trainq_skipped_passes_total",
                "Passes of this worker whose claimed groups were all skipped, so no step was taken",
                &["model"],
            ),
            groups_in_steps: counter(
                "trainq_step_groups_total",
                "Groups in this worker's committed steps, by outcome (trained, or skipped with its reason)",
                &["model", "outcome"],
            ),
            phase_seconds: registered(&r, HistogramVec::new(phase_opts, &["model", "phase"]).expect("valid metric")),
            tokens_per_second: gauge(
                "trainq_tokens_per_second",
                "Trained tokens per second of the last step's train phase",
                &["model"],
            ),
            queue_groups: int_gauge("trainq_groups", "Groups of the model by state (database)", &["model", "state"]),
            skipped_groups: int_gauge(
                "trainq_groups_skipped",
                "Skipped groups of the model by reason (database)",
                &["model", "reason"],
            ),
            oldest_pending: gauge(
                "trainq_oldest_pending_seconds",
                "Age of the model's oldest pending group, 0 when none (database)",
                &["model"],
            ),
            current_step: int_gauge("trainq_model_step", "The model's current step (database)", &["model"]),
            model_skipped_passes: int_gauge(
                "trainq_model_skipped_passes",
                "Skipped passes of the model, every worker (database: trainq.skipped_passes)",
                &["model"],
            ),
            gpu_memory_used: int_gauge(
                "trainq_gpu_memory_used_bytes",
                "GPU memory in use on the device (driver view)",
                &["device"],
            ),
            gpu_memory_total: int_gauge("trainq_gpu_memory_total_bytes", "GPU memory of the device", &["device"]),
            registry: r,
        }
    }

    /// Counts a committed step: its groups by outcome, its phase durations and tokens/s.
    pub fn observe_step(&self, record: &StepRecord) {
        let model = self.model.as_str();
        self.steps.with_label_values(&[model]).inc();
        self.groups_in_steps.with_label_values(&[model, "trained"]).inc_by(record.groups_trained.max(0) as u64);
        for (reason, count) in record.groups_skipped.as_object().into_iter().flatten() {
            let outcome = format!("skipped_{reason}");
            self.groups_in_steps.with_label_values(&[model, &outcome]).inc_by(count.as_u64().unwrap_or(0));
        }
        for (phase, seconds) in record.timings.as_object().into_iter().flatten() {
            if let Some(seconds) = seconds.as_f64() {
                self.phase_seconds.with_label_values(&[model, phase]).observe(seconds);
            }
        }
        if let Some(rate) = tokens_per_second(record) {
            self.tokens_per_second.with_label_values(&[model]).set(rate);
        }
    }

    /// Counts a pass whose claimed groups were all skipped (no step; a `trainq.skipped_passes` row).
    pub fn observe_skipped_pass(&self) {
        self.skipped_passes.with_label_values(&[self.model.as_str()]).inc();
    }

    /// Re-reads the model's queue from the database (what `trainq status` shows).
    pub async fn refresh_queue(&self, pool: &PgPool) -> Result<()> {
        let model = self.model.as_str();
        self.model_skipped_passes.with_label_values(&[model]).set(count_skipped_passes(pool, model).await?);
        for counts in queue_counts(pool, Some(model)).await? {
            for (state, n) in [
                ("pending", counts.pending),
                ("claimed", counts.claimed),
                ("trained", counts.trained),
                ("failed", counts.failed),
            ] {
                self.queue_groups.with_label_values(&[model, state]).set(n);
            }
            for (reason, n) in &counts.skipped {
                self.skipped_groups.with_label_values(&[model, reason]).set(*n);
            }
            self.oldest_pending.with_label_values(&[model]).set(counts.oldest_pending_seconds.unwrap_or(0.0));
            self.current_step.with_label_values(&[model]).set(counts.current_step.0);
        }
        Ok(())
    }

    /// Reads each CUDA device's memory from the driver; devices it cannot read stay absent.
    pub fn refresh_gpu_memory(&self) {
        for device in &self.devices {
            if let Some((used, total)) = device_memory(device) {
                self.gpu_memory_used.with_label_values(&[device]).set(used as i64);
                self.gpu_memory_total.with_label_values(&[device]).set(total as i64);
            }
        }
    }

    /// Every metric in Prometheus' text format.
    pub fn encode(&self) -> String {
        let mut out = Vec::new();
        let _ = prometheus::TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

/// (used, total) bytes of `cuda:N` from the driver (`cuMemGetInfo` in the device's primary
/// context: the caching allocator's reserve counts as used); `None` off CUDA or on any error.
fn device_memory(device: &str) -> Option<(u64, u64)> {
    let ordinal: usize = device.strip_prefix("cuda:")?.parse().ok()?;
    let context = cudarc::driver::CudaContext::new(ordinal).ok()?;
    context.bind_to_thread().ok()?;
    let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
    Some(((total - free) as u64, total as u64))
}

/// Starts the endpoint when `opts.metrics_addr` is set; the worker feeds what it returns.
pub async fn start(
    pool: &PgPool,
    opts: &super::WorkerOptions,
    cancel: &CancellationToken,
) -> Result<Option<Arc<WorkerMetrics>>> {
    let Some(addr) = opts.metrics_addr else { return Ok(None) };
    let metrics = Arc::new(WorkerMetrics::new(&opts.model, opts.placement.device_names()));
    serve_metrics(addr, metrics.clone(), pool.clone(), cancel.clone()).await?;
    Ok(Some(metrics))
}

/// Serves `GET /metrics` on `addr` until `cancel` fires; returns the bound address (port 0
/// picks a free one). Each scrape re-reads the queue and GPU memory first.
pub async fn serve_metrics(
    addr: SocketAddr,
    metrics: Arc<WorkerMetrics>,
    pool: PgPool,
    cancel: CancellationToken,
) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|err| Error::Task { what: "metrics endpoint", message: format!("bind {addr}: {err}") })?;
    let bound =
        listener.local_addr().map_err(|err| Error::Task { what: "metrics endpoint", message: err.to_string() })?;
    tracing::info!("Prometheus metrics on http://{bound}/metrics");
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = tokio::select! {
                _ = cancel.cancelled() => return,
                accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
            };
            let (metrics, pool) = (metrics.clone(), pool.clone());
            tokio::spawn(async move {
                let mut request = [0u8; 2048];
                let n = socket.read(&mut request).await.unwrap_or(0);
                let line = String::from_utf8_lossy(&request[..n]);
                let (status, body) = if line.starts_with("GET /metrics") {
                    if let Err(err) = metrics.refresh_queue(&pool).await {
                        tracing::warn!("metrics: queue counts: {err}");
                    }
                    let gpu = metrics.clone();
                    let _ = tokio::task::spawn_blocking(move || gpu.refresh_gpu_memory()).await;
                    ("200 OK", metrics.encode())
                } else {
                    ("404 Not Found", "try GET /metrics\n".to_string())
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(body.as_bytes()).await;
            });
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use serde_json::json;
    use trainq_queue::StepNumber;

    #[test]
    fn a_committed_step_counts_its_groups_phases_and_throughput() {
        let metrics = WorkerMetrics::new("m", vec!["cpu".into()]);
        let now = Utc::now();
        let record = StepRecord {
            model: "m".into(),
            step: StepNumber(3),
            worker_id: "w".into(),
            async_weight_syncing: false,
            started_at: now,
            finished_at: now,
            groups_claimed: 8,
            groups_trained: 5,
            groups_skipped: json!({"zero_variance": 2, "stale": 1}),
            trajectories: 40,
            tokens: 3000,
            loss: None,
            loss_parts: json!({}),
            grad_norm: None,
            learning_rate: None,
            reward_mean: None,
            reward_std_mean: None,
            policy_lag_min: None,
            policy_lag_max: None,
            timings: json!({"train": 1.5, "upload": 0.2}),
            devices: json!(["cpu"]),
            checkpoint_uri: None,
            checkpoint_sha256: None,
            groups_wanted: None,
            reward_mean_claimed: None,
            reward_mean_skipped: None,
            logprob_coverage: None,
            importance_ratio_mean: None,
        };
        metrics.observe_step(&record);
        metrics.observe_skipped_pass();
        metrics.refresh_gpu_memory();
        let text = metrics.encode();
        assert!(text.contains("trainq_steps_total{model=\"m\"} 1"), "{text}");
        assert!(text.contains("trainq_skipped_passes_total{model=\"m\"} 1"), "{text}");
        assert!(text.contains("trainq_step_groups_total{model=\"m\",outcome=\"skipped_zero_variance\"} 2"));
        assert!(text.contains("trainq_step_groups_total{model=\"m\",outcome=\"trained\"} 5"));
        assert!(text.contains("trainq_step_phase_seconds_count{model=\"m\",phase=\"train\"} 1"));
        assert!(text.contains("trainq_tokens_per_second{model=\"m\"} 2000"));
        assert!(!text.contains("trainq_gpu_memory_used_bytes{"), "no CUDA device: absent, not zero");
    }
}
