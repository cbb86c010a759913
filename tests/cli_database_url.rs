//! The real `trainq` binary never prints a database password: with a malformed `--database-url`
//! (where the URL parser gives up, so a naive redaction prints it whole) or a keyword/value
//! string, every command's error names the URL with `***`. (Well-formed URLs, redacted by the
//! URL parser, are covered with the rest in `trainq_queue::db::databases`'s unit test.)

use std::process::Command;

const SECRET: &str = "hunter2";

/// URLs that fail before connecting, each holding [`SECRET`].
fn bad_urls() -> Vec<String> {
    vec![
        format!("postgres://alice:{SECRET}@127.0.0.1:notaport/trainq"),
        format!("postgres://alice:{SECRET}@[::1/trainq"),
        format!("postgres://alice:{SECRET}/with/slash@127.0.0.1:1/trainq"),
        format!("postgres://127.0.0.1:notaport/trainq?user=alice&password={SECRET}"),
        format!("host=127.0.0.1 user=alice password={SECRET} dbname=trainq"),
    ]
}

fn run(args: &[&str], url: &str) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_trainq"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_BACKTRACE", "0")
        .env_remove("TRAINQ_STORE")
        .output()
        .expect("run trainq");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn no_command_prints_the_password_of_a_database_url_it_cannot_use() {
    let dir = tempfile::tempdir().unwrap();
    let to = dir.path().join("checkpoint");
    let weights = dir.path().join("weights");
    let commands: Vec<Vec<&str>> = vec![
        vec!["status"],
        vec!["migrate"],
        vec!["model", "list"],
        vec!["steps", "m1"],
        vec!["checkpoint", "fetch", "m1", "--to", to.to_str().unwrap()],
    ];
    for url in bad_urls() {
        for args in &commands {
            let (ok, text) = run(args, &url);
            assert!(!ok, "{args:?} with {url}: succeeded?\n{text}");
            assert!(!text.contains(SECRET), "{args:?} printed the password:\n{text}");
            assert!(text.contains("***"), "{args:?} does not say which URL (redacted):\n{text}");
        }
    }
    // `follow` waits for an unreachable database, but refuses an unparsable URL at once.
    let url = format!("postgres://alice:{SECRET}@127.0.0.1:notaport/trainq");
    let (ok, text) = run(&["follow", "--model", "m1", "--dir", weights.to_str().unwrap()], &url);
    assert!(!ok && !text.contains(SECRET) && text.contains("***"), "{text}");
}
