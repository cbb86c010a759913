//! Telling an inference server about a new checkpoint: vLLM's documented LoRA endpoints
//! (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`) or a command hook.

use std::path::Path;
use std::time::Duration;

use trainq_queue::StepNumber;

use crate::{Error, Result};

/// How long one request to the inference server may take (loading an adapter reads it from disk).
pub const VLLM_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// The versioned adapter name a step is loaded under: `{model}-step-{step:06}`. A new name per
/// step, because vLLM caches adapters by name.
pub fn adapter_name(model: &str, step: StepNumber) -> String {
    format!("{model}-step-{:06}", step.0)
}

/// A vLLM server's OpenAI-compatible base URL (e.g. `http://127.0.0.1:8000`), started with
/// `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`.
#[derive(Debug, Clone)]
pub struct VllmServer {
    base_url: String,
    client: reqwest::Client,
}

impl VllmServer {
    /// A client for the server at `base_url` (a trailing `/` or `/v1` is accepted).
    pub fn new(base_url: &str) -> Result<VllmServer> {
        let trimmed = base_url.trim_end_matches('/');
        let base_url = trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_string();
        let client = reqwest::Client::builder()
            .timeout(VLLM_REQUEST_TIMEOUT)
            .build()
            .map_err(|err| Error::Follow { what: format!("HTTP client for {base_url}"), message: err.to_string() })?;
        Ok(VllmServer { base_url, client })
    }

    /// `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`.
    pub async fn load(&self, lora_name: &str, lora_path: &Path) -> Result<()> {
        let body = serde_json::json!({"lora_name": lora_name, "lora_path": lora_path.to_string_lossy()});
        self.post("/v1/load_lora_adapter", body).await
    }

    /// `POST /v1/unload_lora_adapter {"lora_name"}`.
    pub async fn unload(&self, lora_name: &str) -> Result<()> {
        self.post("/v1/unload_lora_adapter", serde_json::json!({"lora_name": lora_name})).await
    }

    async fn post(&self, path: &str, body: serde_json::Value) -> Result<()> {
        let url = format!("{}{path}", self.base_url);
        let what = format!("POST {url} {body}");
        let failed = |message: String| Error::Follow { what: what.clone(), message };
        let response = self
            .client
            .post(&url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|err| failed(err.to_string()))?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let text = response.text().await.unwrap_or_default();
        Err(failed(format!("{status}: {}", text.chars().take(500).collect::<String>())))
    }
}

/// Runs `command` with `sh -c`, with `TRAINQ_MODEL`, `TRAINQ_STEP`, `TRAINQ_CHECKPOINT_DIR`
/// (the step's own directory) and `TRAINQ_ADAPTER_NAME` in its environment; a non-zero exit is
/// an error.
pub async fn run_hook(command: &str, model: &str, step: StepNumber, path: &Path) -> Result<()> {
    let status = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .env("TRAINQ_MODEL", model)
        .env("TRAINQ_STEP", step.0.to_string())
        .env("TRAINQ_CHECKPOINT_DIR", path)
        .env("TRAINQ_ADAPTER_NAME", adapter_name(model, step))
        .kill_on_drop(true)
        .status()
        .await
        .map_err(|err| Error::Follow { what: format!("run hook {command:?}"), message: err.to_string() })?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Follow {
            what: format!("hook {command:?} for step {step}"),
            message: format!("exited with {status}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_names_are_versioned_by_step() {
        assert_eq!(adapter_name("policy", StepNumber(12)), "policy-step-000012");
    }

    #[test]
    fn the_base_url_may_end_in_v1() {
        assert_eq!(VllmServer::new("http://h:8000/v1/").unwrap().base_url, "http://h:8000");
        assert_eq!(VllmServer::new("http://h:8000").unwrap().base_url, "http://h:8000");
    }
}
