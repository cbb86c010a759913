//! A real S3-compatible server for tests: moto (`$TRAINQ_MOTO`, moto 5.2.5) on a free local
//! port, with one bucket, stopped when dropped. It can be killed, restarted on the same port
//! (moto keeps no state across restarts: the bucket is created again), or paused and resumed
//! (SIGSTOP/SIGCONT: the server keeps its objects but answers nothing meanwhile).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use object_store::{BackoffConfig, RetryConfig};
use trainq_queue::storage::{Store, StoreOptions};

/// The bucket every test server holds.
pub const BUCKET: &str = "trainq-test";
/// How long a starting server may take to answer.
const START_DEADLINE: Duration = Duration::from_secs(60);

/// A running moto server.
pub struct MotoServer {
    child: Option<Child>,
    /// The TCP port it listens on (127.0.0.1).
    pub port: u16,
}

impl MotoServer {
    /// Starts moto on a free port and creates [`BUCKET`].
    pub fn start() -> MotoServer {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        MotoServer::start_on(port)
    }

    /// Starts moto on `port` and creates [`BUCKET`].
    pub fn start_on(port: u16) -> MotoServer {
        let moto = std::env::var("TRAINQ_MOTO")
            .expect("TRAINQ_MOTO must name moto_server (source ~/.cache/trainq/env.sh or run ops/test.sh)");
        let child = Command::new(&moto)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {moto}: {e}"));
        let mut server = MotoServer { child: Some(child), port };
        server.wait_until_answering();
        let status = server.http("PUT", &format!("/{BUCKET}")).expect("create bucket");
        assert!(status.starts_with("HTTP/1.1 200") || status.starts_with("HTTP/1.0 200"), "{status}");
        server
    }

    /// `http://127.0.0.1:{port}`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The store URL for `prefix` in [`BUCKET`].
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{BUCKET}/{prefix}")
    }

    /// The environment variables that point the AWS SDKs, awscli and `trainq` at this server.
    pub fn aws_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ALLOW_HTTP", "true".to_string()),
            ("AWS_ACCESS_KEY_ID", "test".to_string()),
            ("AWS_SECRET_ACCESS_KEY", "test".to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
        ]
    }

    /// Options that point a store at this server explicitly (the same settings as
    /// [`Self::aws_env`], no process environment), with short timeouts and per-request retries
    /// bounded by `retry_timeout`.
    pub fn store_options(&self, retry_timeout: Duration) -> StoreOptions {
        let mut config: Vec<(String, String)> =
            self.aws_env().into_iter().map(|(k, v)| (k.to_ascii_lowercase(), v)).collect();
        config.push(("timeout".into(), "2s".into()));
        config.push(("connect_timeout".into(), "1s".into()));
        let backoff = BackoffConfig {
            init_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(500),
            base: 2.0,
        };
        StoreOptions { config, retry: RetryConfig { backoff, max_retries: 50, retry_timeout }, from_env: false }
    }

    /// A store on this server under `prefix`, retrying requests for up to 30 s.
    pub fn store(&self, prefix: &str) -> Store {
        Store::open_with(&self.url(prefix), &self.store_options(Duration::from_secs(30))).unwrap()
    }

    /// Kills the server (its objects are lost).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server and starts a fresh one on the same port, with the bucket.
    pub fn restart(&mut self) {
        self.kill();
        *self = MotoServer::start_on(self.port);
    }

    /// Stops the server process without killing it: connections hang until [`Self::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused server run again.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        assert!(self.try_signal(signal), "kill {signal} moto on port {}", self.port);
    }

    fn try_signal(&self, signal: &str) -> bool {
        let Some(child) = self.child.as_ref() else { return false };
        let pid = child.id().to_string();
        Command::new("kill").args([signal, &pid]).status().is_ok_and(|s| s.success())
    }

    /// Polls until the server answers an HTTP request, or panics after [`START_DEADLINE`].
    fn wait_until_answering(&mut self) {
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            if self.http("GET", "/").is_ok() {
                return;
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!("moto on port {} exited at start: {status}", self.port);
            }
            assert!(Instant::now() < deadline, "moto on port {} did not answer", self.port);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends a bodiless request and returns the status line.
    fn http(&self, method: &str, path: &str) -> std::io::Result<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let host = format!("127.0.0.1:{}", self.port);
        let request =
            format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes())?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        match response.lines().next() {
            Some(line) if line.starts_with("HTTP/") => Ok(line.to_string()),
            _ => Err(std::io::Error::other(format!("not an HTTP answer: {response:?}"))),
        }
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        // A paused server is resumed first so that nothing is left stopped behind the test.
        self.try_signal("-CONT");
        self.kill();
    }
}
