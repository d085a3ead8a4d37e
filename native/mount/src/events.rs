//! What the mount tells its owner: log lines (handed to Python's logging, so levels, format
//! and log file are the Python mount's) and the end of the session, both behind one
//! condition variable so that a waiting owner wakes for either.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Python's logging levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Level {
    Debug = 10,
    Info = 20,
    Warning = 30,
    Error = 40,
}

/// Lines kept until taken; past this the oldest go (and are counted).
const LOGS_KEPT: usize = 10_000;

#[derive(Default)]
struct State {
    logs: VecDeque<(Level, String)>,
    dropped: u64,
    done: bool,
}

#[derive(Default)]
pub struct Events {
    state: Mutex<State>,
    cv: Condvar,
}

impl Events {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while holding this lock leaves plain data: keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn log(&self, level: Level, message: impl Into<String>) {
        let mut s = self.lock();
        if s.logs.len() >= LOGS_KEPT {
            s.logs.pop_front();
            s.dropped += 1;
        }
        s.logs.push_back((level, message.into()));
        drop(s);
        self.cv.notify_all();
    }

    /// The session ended (unmounted, or the kernel hung up).
    pub fn finish(&self) {
        self.lock().done = true;
        self.cv.notify_all();
    }

    pub fn done(&self) -> bool {
        self.lock().done
    }

    /// Wait until the session ends, a log line is waiting, or `timeout` passes; whether the
    /// session has ended.
    pub fn wait(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            if s.done || !s.logs.is_empty() {
                return s.done;
            }
            let now = Instant::now();
            if now >= end {
                return false;
            }
            s = self.cv.wait_timeout(s, end - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// The log lines waiting, oldest first (with a line saying how many were dropped).
    pub fn take_logs(&self) -> Vec<(Level, String)> {
        let mut s = self.lock();
        let mut out: Vec<(Level, String)> = s.logs.drain(..).collect();
        if s.dropped > 0 {
            out.insert(0, (Level::Warning, format!("{} log lines dropped (too many)", s.dropped)));
            s.dropped = 0;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn wait_wakes_for_logs_and_the_end() {
        let ev = Arc::new(Events::default());
        assert!(!ev.wait(Duration::from_millis(10)));
        let e2 = ev.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            e2.log(Level::Error, "read failed");
        });
        let t0 = Instant::now();
        assert!(!ev.wait(Duration::from_secs(5)));
        assert!(t0.elapsed() < Duration::from_secs(4));
        t.join().unwrap();
        assert_eq!(ev.take_logs(), [(Level::Error, "read failed".to_string())]);
        ev.finish();
        assert!(ev.wait(Duration::from_secs(5)));
        for i in 0..LOGS_KEPT + 5 {
            ev.log(Level::Info, format!("{i}"));
        }
        let logs = ev.take_logs();
        assert_eq!(logs.len(), LOGS_KEPT + 1);
        assert!(logs[0].1.contains("5 log lines dropped"));
    }
}
