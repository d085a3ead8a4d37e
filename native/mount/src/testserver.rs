//! A tiny HTTP/1.1 server for the unit tests: ranged GETs of in-memory objects on
//! kept-alive connections, recording each request's headers. (The end-to-end tests run
//! the real hub and spoke: tests/test_native_mount.py.)

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

type Objects = Arc<HashMap<String, Vec<u8>>>;

pub struct TestServer {
    port: u16,
    log: Arc<Mutex<Vec<HashMap<String, String>>>>,
    failing: Arc<AtomicBool>,
}

impl TestServer {
    pub fn start(objects: Vec<(String, Vec<u8>)>) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let objects: Objects = Arc::new(objects.into_iter().collect());
        let log = Arc::new(Mutex::new(Vec::new()));
        let failing = Arc::new(AtomicBool::new(false));
        let (l2, f2) = (log.clone(), failing.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (o, l, f) = (objects.clone(), l2.clone(), f2.clone());
                std::thread::spawn(move || serve(conn, &o, &l, &f));
            }
        });
        TestServer { port, log, failing }
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn requests(&self) -> Vec<HashMap<String, String>> {
        self.log.lock().unwrap().clone()
    }

    pub fn clear(&self) {
        self.log.lock().unwrap().clear();
    }

    pub fn all_had(&self, header: &str, value: &str) -> bool {
        self.requests().iter().all(|r| r.get(header).map(String::as_str) == Some(value))
    }

    pub fn set_failing(&self, on: bool) {
        self.failing.store(on, Ordering::SeqCst);
    }
}

fn serve(
    conn: TcpStream,
    objects: &Objects,
    log: &Mutex<Vec<HashMap<String, String>>>,
    failing: &AtomicBool,
) {
    let mut out = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
        let mut headers = HashMap::new();
        headers.insert(":path".to_owned(), path.clone());
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
            }
        }
        log.lock().unwrap().push(headers.clone());
        let name = path.rsplit('/').next().unwrap_or("");
        let reply = if failing.load(Ordering::SeqCst) {
            json(503, r#"{"error": {"code": "upstream_unavailable", "message": "later"}}"#)
        } else if let Some(obj) = objects.get(name) {
            let range = headers
                .get("range")
                .and_then(|v| v.strip_prefix("bytes="))
                .and_then(|v| v.split_once('-'));
            let (lo, hi) = match range {
                Some((a, b)) => (a.parse::<usize>().unwrap(), b.parse::<usize>().unwrap()),
                None => (0, obj.len().saturating_sub(1)),
            };
            if lo >= obj.len() {
                json(
                    416,
                    r#"{"error": {"code": "range_not_satisfiable", "message": "past the end"}}"#,
                )
            } else {
                let hi = hi.min(obj.len() - 1);
                let body = &obj[lo..=hi];
                let mut head = format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {lo}-{hi}/{}\r\n\r\n",
                    body.len(),
                    obj.len()
                )
                .into_bytes();
                head.extend_from_slice(body);
                head
            }
        } else {
            json(404, r#"{"error": {"code": "not_found", "message": "no such version"}}"#)
        };
        if out.write_all(&reply).is_err() {
            return;
        }
    }
}

fn json(status: u16, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}
