//! Plain HTTP to the spoke (or hub): ranged GETs of object bytes into the caller's buffers
//! and the short circuit's small JSON POSTs, on kept-alive connections (ureq's pool).
//!
//! Answers map as the Python mount's clients map them (`spokefs.wire.http1`): 5xx but 501,
//! a refused, reset or cut connection and a silent upstream are transient (retried with
//! backoff until the mount's deadline); 416 is the end of the object; other 4xx are final.

use std::io::Read;
use std::time::{Duration, Instant};

use serde_json::Value;
use ureq::Agent;

/// Why one exchange gave no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HttpError {
    /// Worth retrying: the upstream may answer later.
    Transient(String),
    /// No answer within the time allowed.
    Timeout,
    /// The range starts past the end of the object (416).
    NotSatisfiable,
    /// The upstream's final answer (404, 410, 400, 401, 403, ...).
    Final(u16, String),
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HttpError::Transient(why) => f.write_str(why),
            HttpError::Timeout => f.write_str("no answer in time"),
            HttpError::NotSatisfiable => f.write_str("range not satisfiable"),
            HttpError::Final(code, why) => write!(f, "upstream answered {code}: {why}"),
        }
    }
}

/// Where the bytes come from, and how to ask.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// http://HOST:PORT (maybe with a path prefix), no trailing slash.
    pub base: String,
    pub dataset: String,
    pub snapshot: String,
    /// The bearer token, if any.
    pub token: Option<String>,
    /// A read that cannot be answered for this long fails.
    pub deadline: Duration,
    /// Connections kept alive to the upstream.
    pub connections: usize,
}

pub struct Upstream {
    agent: Agent,
    cfg: UpstreamConfig,
    auth: Option<String>,
    objects: String,
}

/// The message of an upstream's JSON error body, else the body's start.
fn error_message(body: &[u8]) -> String {
    if let Ok(doc) = serde_json::from_slice::<Value>(body) {
        if let Some(m) = doc.pointer("/error/message").and_then(Value::as_str) {
            return m.to_owned();
        }
    }
    String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned()
}

fn map_ureq(e: ureq::Error) -> HttpError {
    match e {
        ureq::Error::Timeout(_) => HttpError::Timeout,
        ureq::Error::Io(io) => map_io(&io),
        ureq::Error::HostNotFound => HttpError::Transient("host not found".into()),
        ureq::Error::ConnectionFailed => HttpError::Transient("cannot connect".into()),
        other => HttpError::Transient(other.to_string()),
    }
}

fn map_io(io: &std::io::Error) -> HttpError {
    use std::io::ErrorKind as K;
    match io.kind() {
        K::TimedOut | K::WouldBlock => HttpError::Timeout,
        K::ConnectionRefused => HttpError::Transient("connection refused".into()),
        K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe => {
            HttpError::Transient("connection reset".into())
        }
        K::UnexpectedEof => HttpError::Transient("connection closed mid-answer".into()),
        _ => HttpError::Transient(io.to_string()),
    }
}

/// The first byte a 206 answer holds, from its `Content-Range: bytes A-B/N`.
fn range_start(content_range: Option<&str>) -> Option<u64> {
    let first = content_range?.strip_prefix("bytes ")?.split('-').next()?;
    if first.is_empty() || first.len() > 20 || !first.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    first.parse().ok()
}

fn status_error(status: u16, body: &[u8]) -> HttpError {
    if status >= 500 && status != 501 {
        HttpError::Transient(format!("upstream answered {status}"))
    } else if status == 416 {
        HttpError::NotSatisfiable
    } else {
        HttpError::Final(status, error_message(body))
    }
}

/// Read the rest of a (small) error body, at most 64 KiB.
fn small_body(body: &mut ureq::Body) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = body.as_reader().take(64 * 1024).read_to_end(&mut out);
    out
}

impl Upstream {
    pub fn new(cfg: UpstreamConfig) -> Upstream {
        let agent: Agent = Agent::config_builder()
            .http_status_as_error(false)
            .max_idle_connections(cfg.connections.max(4))
            .max_idle_connections_per_host(cfg.connections.max(4))
            .max_idle_age(Duration::from_secs(30))
            .max_redirects(0)
            .user_agent(format!("spokefs-mount/{}", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        let base = cfg.base.trim_end_matches('/').to_owned();
        let objects = format!("{base}/v1/datasets/{}/objects/", cfg.dataset);
        let auth = cfg.token.as_ref().map(|t| format!("Bearer {t}"));
        Upstream { agent, cfg: UpstreamConfig { base, ..cfg }, auth, objects }
    }

    pub fn config(&self) -> &UpstreamConfig {
        &self.cfg
    }

    /// One ranged GET of bytes `[start, start + buf.len())` of `version` into `buf`: the
    /// count received (less than asked only at the end of the object; 0 past it).
    pub fn get_range_once(
        &self,
        version: &str,
        start: u64,
        buf: &mut [u8],
        timeout: Duration,
    ) -> Result<usize, HttpError> {
        if buf.is_empty() {
            return Ok(0);
        }
        let last = start + buf.len() as u64 - 1;
        let mut req = self
            .agent
            .get(format!("{}{version}", self.objects))
            .header("Range", format!("bytes={start}-{last}"))
            .header("X-Spokefs-Snapshot", &self.cfg.snapshot)
            .header("Accept-Encoding", "identity");
        if let Some(a) = &self.auth {
            req = req.header("Authorization", a);
        }
        let mut resp =
            req.config().timeout_global(Some(timeout)).build().call().map_err(map_ureq)?;
        let status = resp.status().as_u16();
        if !(200..300).contains(&status) {
            let body = small_body(resp.body_mut());
            return match status_error(status, &body) {
                HttpError::NotSatisfiable => Ok(0),
                e => Err(e),
            };
        }
        if status == 200 && start != 0 {
            return Err(HttpError::Transient("upstream ignored the Range header".into()));
        }
        if status == 206 {
            // Bytes of another range are other bytes: never taken as these.
            let cr = resp.headers().get("content-range").and_then(|v| v.to_str().ok());
            if range_start(cr) != Some(start) {
                return Err(HttpError::Transient(format!(
                    "upstream answered {cr:?} for a read at {start}"
                )));
            }
        }
        let mut reader = resp.body_mut().as_reader();
        let mut got = 0;
        while got < buf.len() {
            match reader.read(&mut buf[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(map_io(&e)),
            }
        }
        // The body must end here (then the connection goes back to the pool).
        let mut probe = [0u8; 1];
        loop {
            match reader.read(&mut probe) {
                Ok(0) => break,
                Ok(_) => {
                    return Err(HttpError::Transient(format!(
                        "upstream sent more than the {} bytes asked",
                        buf.len()
                    )));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(map_io(&e)),
            }
        }
        Ok(got)
    }

    /// Bytes of `version` from `start` into `buf`, retried with backoff until the deadline:
    /// the count (short at the end of the object), or why it failed (the message the EIO's
    /// log line carries).
    pub fn get_range(&self, version: &str, start: u64, buf: &mut [u8]) -> Result<usize, String> {
        let what = format!("{} {version} [{start},{})", self.cfg.dataset, start + buf.len() as u64);
        retry_until(self.cfg.deadline, &what, |left| self.get_range_once(version, start, buf, left))
    }

    /// POST a JSON body to `/v1/datasets/{ds}/{what}` with extra headers; the JSON answer.
    pub fn post_json(
        &self,
        what: &str,
        body: &Value,
        headers: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<Value, HttpError> {
        let url = format!("{}/v1/datasets/{}/{what}", self.cfg.base, self.cfg.dataset);
        let mut req = self
            .agent
            .post(url)
            .header("Content-Type", "application/json")
            .header("Accept-Encoding", "identity");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(a) = &self.auth {
            req = req.header("Authorization", a);
        }
        let data = serde_json::to_vec(body).map_err(|e| HttpError::Transient(e.to_string()))?;
        let mut resp =
            req.config().timeout_global(Some(timeout)).build().send(&data[..]).map_err(map_ureq)?;
        let status = resp.status().as_u16();
        let mut out = Vec::new();
        resp.body_mut().as_reader().take(64 << 20).read_to_end(&mut out).map_err(|e| map_io(&e))?;
        if !(200..300).contains(&status) {
            return Err(status_error(status, &out));
        }
        serde_json::from_slice(&out)
            .map_err(|e| HttpError::Transient(format!("bad JSON answer: {e}")))
    }
}

/// A small, good-enough random source for jitter (no dependency).
fn jitter(n: u64) -> f64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ std::process::id() as u64;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    0.5 + 0.5 * ((x % 10_000) as f64 / 10_000.0)
}

/// The pauses between attempts: 20 ms doubling to 0.5 s, each jittered to 50-100%.
pub fn backoff(attempt: u32) -> Duration {
    let ceiling = (0.02 * 2f64.powi(attempt.min(10) as i32)).min(0.5);
    Duration::from_secs_f64(ceiling * jitter(attempt as u64))
}

/// Run `attempt(time_left)` until it succeeds, retrying transient failures and timeouts
/// with backoff; each attempt and the whole run are bounded by `deadline`. A final answer
/// fails at once. The error names the cause as the Python mount's does.
pub fn retry_until<T>(
    deadline: Duration,
    what: &str,
    mut attempt: impl FnMut(Duration) -> Result<T, HttpError>,
) -> Result<T, String> {
    let end = Instant::now() + deadline;
    let secs = deadline.as_secs_f64();
    let mut cause = String::from("no attempt made");
    for k in 0.. {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match attempt(left) {
            Ok(v) => return Ok(v),
            Err(HttpError::Final(_, why)) => return Err(format!("{what}: {why}")),
            Err(HttpError::NotSatisfiable) => return Err(format!("{what}: range not satisfiable")),
            Err(HttpError::Timeout) => cause = format!("no answer within {secs}s"),
            Err(HttpError::Transient(why)) => cause = why,
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        std::thread::sleep(backoff(k).min(left));
    }
    Err(format!("{what}: upstream unavailable for {}s ({cause})", fmt_secs(secs)))
}

/// Seconds as Python's `%g` shows them ("2", "0.5", "30").
pub fn fmt_secs(s: f64) -> String {
    let t = format!("{s:.3}");
    t.trim_end_matches('0').trim_end_matches('.').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_half_a_second() {
        assert!(backoff(0) <= Duration::from_millis(20) && backoff(0) >= Duration::from_millis(10));
        assert!(
            backoff(10) <= Duration::from_millis(500) && backoff(10) >= Duration::from_millis(250)
        );
    }

    #[test]
    fn retries_until_the_deadline_then_names_the_cause() {
        let t0 = Instant::now();
        let mut calls = 0;
        let r: Result<(), String> = retry_until(Duration::from_millis(300), "block 0", |_| {
            calls += 1;
            Err(HttpError::Transient("connection refused".into()))
        });
        let e = r.unwrap_err();
        assert_eq!(e, "block 0: upstream unavailable for 0.3s (connection refused)");
        assert!(calls > 3, "{calls}");
        assert!(
            t0.elapsed() >= Duration::from_millis(290) && t0.elapsed() < Duration::from_secs(2)
        );
        let r: Result<(), String> = retry_until(Duration::from_secs(5), "x", |_| {
            Err(HttpError::Final(404, "no such".into()))
        });
        assert_eq!(r.unwrap_err(), "x: no such");
        let mut n = 0;
        assert_eq!(
            retry_until(Duration::from_secs(5), "x", |_| {
                n += 1;
                if n < 3 { Err(HttpError::Timeout) } else { Ok(n) }
            }),
            Ok(3)
        );
    }

    #[test]
    fn a_range_answer_names_where_it_starts() {
        assert_eq!(range_start(Some("bytes 100-199/1000")), Some(100));
        assert_eq!(range_start(Some("bytes 0-0/1")), Some(0));
        for bad in ["", "bytes -5/10", "items 1-2/3", "bytes \u{b2}-3/4", "bytes x-1/2"] {
            assert_eq!(range_start(Some(bad)), None, "{bad}");
        }
        assert_eq!(range_start(None), None);
    }

    #[test]
    fn statuses_map_as_the_python_clients_do() {
        assert!(matches!(status_error(503, b""), HttpError::Transient(_)));
        assert!(matches!(status_error(500, b""), HttpError::Transient(_)));
        assert!(matches!(status_error(501, b""), HttpError::Final(501, _)));
        assert_eq!(status_error(416, b""), HttpError::NotSatisfiable);
        assert_eq!(
            status_error(404, br#"{"error": {"code": "not_found", "message": "no such version"}}"#),
            HttpError::Final(404, "no such version".into())
        );
        assert_eq!(fmt_secs(2.0), "2");
        assert_eq!(fmt_secs(0.25), "0.25");
        assert_eq!(fmt_secs(30.0), "30");
    }

    #[test]
    fn a_refused_connection_is_transient() {
        // A port nothing listens on (bound, then closed).
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let up = Upstream::new(UpstreamConfig {
            base: format!("http://127.0.0.1:{port}"),
            dataset: "ds".into(),
            snapshot: "s".into(),
            token: None,
            deadline: Duration::from_millis(200),
            connections: 4,
        });
        let mut buf = [0u8; 10];
        match up.get_range_once("v", 0, &mut buf, Duration::from_secs(1)) {
            Err(HttpError::Transient(_)) => {}
            other => panic!("{other:?}"),
        }
        let e = up.get_range("v", 0, &mut buf).unwrap_err();
        assert!(e.contains("upstream unavailable for 0.2s"), "{e}");
    }
}
