//! A fixed pool of worker threads running jobs from one queue: the FUSE session thread
//! hands every read to it (a reply can be sent from any thread), and fetches started ahead
//! of a streaming read run on it too.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    q: Mutex<Queue>,
    cv: Condvar,
}

pub struct Pool {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Pool {
    pub fn new(threads: usize, name: &str) -> std::io::Result<Pool> {
        let shared = Arc::new(Shared::default());
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads.max(1) {
            let s = shared.clone();
            handles.push(
                std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || work(&s))?,
            );
        }
        Ok(Pool { shared, threads: Mutex::new(handles) })
    }

    /// Queue a job (run at once if the pool is closed: nothing is ever dropped unanswered).
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) {
        let mut q = self.shared.q.lock().unwrap_or_else(|e| e.into_inner());
        if q.closed {
            drop(q);
            job();
            return;
        }
        q.jobs.push_back(Box::new(job));
        drop(q);
        self.shared.cv.notify_one();
    }

    /// Jobs waiting for a thread.
    pub fn queued(&self) -> usize {
        self.shared.q.lock().unwrap_or_else(|e| e.into_inner()).jobs.len()
    }

    /// Let the threads finish what is queued, then end them.
    pub fn close(&self) {
        self.shared.q.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        self.shared.cv.notify_all();
        let handles = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        let me = std::thread::current().id();
        for h in handles {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.close();
    }
}

fn work(s: &Shared) {
    loop {
        let job = {
            let mut q = s.q.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.closed {
                    return;
                }
                q = s.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        // A job that panics must not take its thread (and the pool's capacity) with it.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    #[test]
    fn jobs_run_in_parallel_and_all_finish() {
        let pool = Pool::new(8, "t").unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        let t0 = Instant::now();
        for _ in 0..16 {
            let d = done.clone();
            pool.submit(move || {
                std::thread::sleep(Duration::from_millis(50));
                d.fetch_add(1, Ordering::SeqCst);
            });
        }
        pool.submit(|| panic!("a bad job"));
        pool.close();
        assert_eq!(done.load(Ordering::SeqCst), 16);
        // 16 jobs of 50 ms on 8 threads: about 100 ms, far from 800.
        assert!(t0.elapsed() < Duration::from_millis(600), "{:?}", t0.elapsed());
        let d = done.clone();
        pool.submit(move || {
            d.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(done.load(Ordering::SeqCst), 17); // closed: run at once
    }
}
