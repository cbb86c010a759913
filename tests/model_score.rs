//! `trainq score` prints transformers' per-token log-probs, aligned with the input ids.

mod reference;

use std::process::Command;

use reference::{tensor, TOLERANCE};

#[test]
fn score_prints_null_then_the_log_prob_of_each_next_token() {
    let dir = reference::dir();
    let file = dir.join("qwen3_reference.safetensors");
    let ids = tensor(&file, "input_ids");
    let expected = tensor(&file, "logprobs");
    let rows: Vec<Vec<i64>> = (0..2).map(|b| Vec::<i64>::try_from(ids.get(b)).unwrap()).collect();
    let input = tempfile::NamedTempFile::new().unwrap();
    let lines: Vec<String> = rows.iter().map(|r| serde_json::json!({ "ids": r }).to_string()).collect();
    std::fs::write(input.path(), lines.join("\n")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_trainq"))
        .args(["score", "--model", dir.join("qwen3").to_str().unwrap(), "--input", input.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let printed: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(printed.len(), 2);
    for (b, line) in printed.iter().enumerate() {
        let lps = line["logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), rows[b].len());
        assert!(lps[0].is_null());
        for (t, lp) in lps.iter().enumerate().skip(1) {
            let want = expected.double_value(&[b as i64, t as i64 - 1]);
            let got = lp.as_f64().unwrap();
            assert!((got - want).abs() < TOLERANCE, "row {b} token {t}: {got} vs {want}");
        }
    }
}
