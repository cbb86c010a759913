//! `trainq score`: per-token log-probs of token sequences under a model (and adapter), as JSON
//! lines — for evaluation, debugging, and checking trainq's numbers against any other stack.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};
use trainq_engine::checkpoint::peft::{load_adapter, read_adapter_config};
use trainq_engine::model::Policy;

/// Arguments of `trainq score`.
#[derive(clap::Args)]
pub(crate) struct ScoreArgs {
    /// HF model directory (config.json + safetensors).
    #[arg(long)]
    model: PathBuf,
    /// PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to apply.
    /// Repeat it to score the same input under several adapters of one LoRA shape (e.g. every
    /// checkpoint of a run) with the base loaded once; each line then names its adapter.
    #[arg(long)]
    adapter: Vec<PathBuf>,
    /// JSON lines, one `{"ids": [..]}` object per sequence; `-` reads standard input.
    #[arg(long)]
    input: PathBuf,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weights' dtype: `bf16`, `f32`, or `auto` (bf16 on CUDA, f32 on the CPU, as training).
    #[arg(long, default_value = "auto", value_parser = ["auto", "bf16", "f32"])]
    dtype: String,
}

/// Prints `{"logprobs": [null, lp_1, …]}` per input line: entry t is log p(ids[t] | ids[..t]),
/// aligned with `ids`; the first token has no prefix and so no log-prob (null).
pub(crate) fn run(args: ScoreArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    let inputs = read_inputs(&args.input)?;
    let mut out = std::io::stdout().lock();
    let kind = match args.dtype.as_str() {
        "bf16" => Kind::BFloat16,
        "f32" => Kind::Float,
        _ => trainq_engine::model::default_kind(device),
    };
    let Some((first, rest)) = args.adapter.split_first() else {
        let policy = Policy::load_as(&args.model, None, device, kind)?;
        return write_scores(&policy, &inputs, None, &mut out);
    };
    let lora = read_adapter_config(first)?;
    let policy = Policy::load_as(&args.model, Some(&lora), device, kind)?;
    load_adapter(&policy, first).with_context(|| format!("adapter {}", first.display()))?;
    let named = (!rest.is_empty()).then_some(first.as_path());
    write_scores(&policy, &inputs, named, &mut out)?;
    for adapter in rest {
        load_adapter(&policy, adapter).with_context(|| format!("adapter {}", adapter.display()))?;
        write_scores(&policy, &inputs, Some(adapter), &mut out)?;
    }
    Ok(())
}

/// The `{"ids": [..]}` lines of `path` (`-`: standard input), blank lines left out.
fn read_inputs(path: &std::path::Path) -> Result<Vec<Vec<i64>>> {
    let reader: Box<dyn BufRead> = if path.as_os_str() == "-" {
        Box::new(BufReader::new(std::io::stdin()))
    } else {
        let file = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
        Box::new(BufReader::new(file))
    };
    let mut inputs = Vec::new();
    for (number, line) in reader.lines().enumerate() {
        let line = line?;
        if !line.trim().is_empty() {
            inputs.push(parse_ids(&line).with_context(|| format!("{} line {}", path.display(), number + 1))?);
        }
    }
    Ok(inputs)
}

/// One `{"logprobs": [null, …]}` line per input (with `"adapter"` when several are scored).
fn write_scores(
    policy: &Policy,
    inputs: &[Vec<i64>],
    adapter: Option<&std::path::Path>,
    out: &mut impl Write,
) -> Result<()> {
    for ids in inputs {
        let logprobs = tch::no_grad(|| score_ids(policy, ids))?;
        let mut values = vec![serde_json::Value::Null];
        values.extend(logprobs.into_iter().map(serde_json::Value::from));
        let line = match adapter {
            Some(dir) => serde_json::json!({ "adapter": dir.display().to_string(), "logprobs": values }),
            None => serde_json::json!({ "logprobs": values }),
        };
        writeln!(out, "{line}")?;
    }
    Ok(())
}

fn parse_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Device::Cuda(n)),
            _ => bail!("--device must be cpu, cuda or cuda:N, got {other:?}"),
        },
    }
}

fn parse_ids(line: &str) -> Result<Vec<i64>> {
    let value: serde_json::Value = serde_json::from_str(line).context("not JSON")?;
    if value.get("messages").is_some() && value.get("ids").is_none() {
        bail!("\"messages\" lines are not supported yet; give token ids as {{\"ids\": [...]}}");
    }
    let ids: Vec<i64> = serde_json::from_value(value["ids"].clone()).context("expected {\"ids\": [integers]}")?;
    if ids.is_empty() {
        bail!("\"ids\" is empty");
    }
    Ok(ids)
}

/// log p(ids[t+1] | ids[..=t]) for t in 0..len-1.
fn score_ids(policy: &Policy, ids: &[i64]) -> Result<Vec<f64>> {
    let n = ids.len() as i64;
    let device = policy.device();
    let input = Tensor::from_slice(ids).to(device).reshape([1, n]);
    let positions = Tensor::arange(n, (Kind::Int64, device)).reshape([1, n]);
    // targets[t] = ids[t+1]; the last position has none
    let mut shifted = ids[1..].to_vec();
    shifted.push(-100);
    let targets = Tensor::from_slice(&shifted).to(device).reshape([1, n]);
    let lp = policy.token_logprobs(&input, &positions, &targets)?;
    let lp: Vec<f64> = Vec::<f64>::try_from(lp.to_kind(Kind::Double).to(Device::Cpu).reshape([n]))?;
    Ok(lp[..ids.len() - 1].to_vec())
}
