//! Reads over HTTP: whole fetch units for streaming reads, exact ranges for random ones
//! (what `spokefs.mount.coalesce` does for the Python mount, measured there).
//!
//! The kernel streams a file as 1 MiB requests (readahead raised); sent one for one, each
//! would pay an HTTP request's fixed cost. So a streaming read (one that starts where the
//! last read of that version ended, or a large first read at offset 0) fetches the whole
//! aligned unit it falls in (`blocks::unit_at`) once, serves the kernel's requests from
//! it, and starts the next units before they are asked for. A random read fetches exactly
//! what was asked: a whole unit would only add latency.
//!
//! Memory is bounded: at most `capacity` bytes of units, least recently used dropped first,
//! and a unit is dropped as soon as all its bytes were served (the kernel's page cache has
//! them then). Concurrent readers of one unit share one fetch (in-flight de-duplication);
//! a unit queued for prefetch that a reader needs now is fetched by that reader, so a
//! reader never waits on a job stuck behind others in the pool. Unit buffers are reused.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::blocks::{unit_at, unit_size, units_after, units_spanned};
use crate::http::Upstream;
use crate::pool::Pool;

/// A first read this large at offset 0 is the kernel's readahead: a stream.
pub const STREAM_MIN: u64 = 512 * 1024;
pub const DEFAULT_CAPACITY: u64 = 64 * 1024 * 1024;
pub const PREFETCH: usize = 2;

/// Which reads are streams: the end of the last read of each version (the session thread
/// sees requests in the order the kernel sent them, so it decides).
#[derive(Default)]
pub struct Streams {
    last_end: HashMap<u32, u64>,
}

impl Streams {
    pub fn observe(&mut self, vid: u32, start: u64, end: u64) -> bool {
        let streaming =
            self.last_end.get(&vid) == Some(&start) || (start == 0 && end - start >= STREAM_MIN);
        if self.last_end.len() >= 4096 && !self.last_end.contains_key(&vid) {
            self.last_end.clear(); // rare: thousands of files open at once
        }
        self.last_end.insert(vid, end);
        streaming
    }
}

#[derive(Default)]
pub struct UnitStats {
    pub unit_fetches: AtomicU64,
    pub unit_bytes: AtomicU64,
    pub exact_fetches: AtomicU64,
    pub exact_bytes: AtomicU64,
    pub prefetches: AtomicU64,
    pub shared_waits: AtomicU64,
}

enum Slot {
    Queued,
    Fetching,
    Ready(Arc<Vec<u8>>),
    Failed(String),
}

struct Unit {
    vid: u32,
    version: String,
    start: u64,
    len: usize,
    slot: Mutex<Slot>,
    cv: Condvar,
    served: AtomicU64,
    last_use: AtomicU64,
    buffers: Arc<Mutex<Vec<Vec<u8>>>>,
    keep_buffers: usize,
}

impl Unit {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Unit {
    fn drop(&mut self) {
        let slot =
            std::mem::replace(self.slot.get_mut().unwrap_or_else(|e| e.into_inner()), Slot::Queued);
        if let Slot::Ready(buf) = slot {
            if let Ok(buf) = Arc::try_unwrap(buf) {
                let mut pool = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
                if pool.len() < self.keep_buffers {
                    pool.push(buf);
                }
            }
        }
    }
}

#[derive(Default)]
struct State {
    units: HashMap<(u32, u64), Arc<Unit>>,
    held: u64,
    tick: u64,
}

pub struct UnitReader {
    up: Arc<Upstream>,
    bs: u64,
    unit: u64,
    capacity: u64,
    prefetch: usize,
    state: Mutex<State>,
    buffers: Arc<Mutex<Vec<Vec<u8>>>>,
    pub stats: UnitStats,
}

impl UnitReader {
    pub fn new(up: Arc<Upstream>, block_size: u64, capacity: u64, prefetch: usize) -> UnitReader {
        let unit = unit_size(block_size);
        UnitReader {
            up,
            bs: block_size.max(1),
            unit,
            capacity: capacity.max(unit),
            prefetch,
            state: Mutex::new(State::default()),
            buffers: Arc::new(Mutex::new(Vec::new())),
            stats: UnitStats::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes held in units now (for tests and counters).
    pub fn held(&self) -> u64 {
        self.lock().held
    }

    /// Fill `out` with bytes from `start` of version `vid` (`version` its id) of a file of
    /// `size` bytes: the count (less than `out.len()` only at the end of the object), or
    /// why not (after retrying until the deadline).
    #[allow(clippy::too_many_arguments)]
    pub fn read(
        self: &Arc<Self>,
        pool: &Pool,
        vid: u32,
        version: &str,
        size: u64,
        start: u64,
        out: &mut [u8],
        streaming: bool,
    ) -> Result<usize, String> {
        let end = (start + out.len() as u64).min(size);
        if end <= start {
            return Ok(0);
        }
        let spans = units_spanned(start, end, self.bs, size);
        let mut mine = Vec::new();
        let mut ahead = Vec::new();
        let units: Vec<Arc<Unit>> = {
            let mut st = self.lock();
            if !streaming && !spans.iter().all(|u| st.units.contains_key(&(vid, u.start))) {
                drop(st);
                self.stats.exact_fetches.fetch_add(1, Ordering::Relaxed);
                self.stats.exact_bytes.fetch_add(end - start, Ordering::Relaxed);
                return self.up.get_range(version, start, &mut out[..(end - start) as usize]);
            }
            st.tick += 1;
            let tick = st.tick;
            let mut got = Vec::with_capacity(spans.len());
            for u in &spans {
                let (unit, new) = self.unit(&mut st, vid, version, u.start, u.end, Slot::Fetching);
                unit.last_use.store(tick, Ordering::Relaxed);
                if new {
                    mine.push(unit.clone());
                }
                got.push(unit);
            }
            if streaming {
                let last = spans.last().map_or(end, |u| u.end);
                for u in units_after(last, self.prefetch, self.bs, size) {
                    if !st.units.contains_key(&(vid, u.start)) {
                        let (unit, _) =
                            self.unit(&mut st, vid, version, u.start, u.end, Slot::Queued);
                        unit.last_use.store(tick, Ordering::Relaxed);
                        ahead.push(unit);
                    }
                }
            }
            self.evict(&mut st, &got);
            got
        };
        for unit in ahead {
            self.stats.prefetches.fetch_add(1, Ordering::Relaxed);
            let me = self.clone();
            pool.submit(move || {
                let mut slot = unit.lock();
                if matches!(*slot, Slot::Queued) {
                    *slot = Slot::Fetching;
                    drop(slot);
                    me.fetch(&unit);
                }
            });
        }
        for unit in &mine {
            self.fetch(unit);
        }
        let mut n = 0usize;
        for unit in &units {
            let data = self.wait(unit)?;
            let lo = start.max(unit.start) - unit.start;
            let hi = (end.min(unit.start + unit.len as u64) - unit.start).min(data.len() as u64);
            if hi > lo {
                let take = (hi - lo) as usize;
                out[n..n + take].copy_from_slice(&data[lo as usize..hi as usize]);
                n += take;
                let served = unit.served.fetch_add(take as u64, Ordering::Relaxed) + take as u64;
                if served >= unit.len as u64 {
                    self.forget(unit); // all handed to the kernel: its page cache has it now
                }
            }
            if (data.len() as u64) < unit.len as u64 {
                break; // the object ended early
            }
        }
        Ok(n)
    }

    /// The unit at `[u0, u1)` of `vid`, made in state `initial` if absent (and whether it
    /// was made).
    fn unit(
        &self,
        st: &mut State,
        vid: u32,
        version: &str,
        u0: u64,
        u1: u64,
        initial: Slot,
    ) -> (Arc<Unit>, bool) {
        if let Some(u) = st.units.get(&(vid, u0)) {
            return (u.clone(), false);
        }
        let unit = Arc::new(Unit {
            vid,
            version: version.to_owned(),
            start: u0,
            len: (u1 - u0) as usize,
            slot: Mutex::new(initial),
            cv: Condvar::new(),
            served: AtomicU64::new(0),
            last_use: AtomicU64::new(0),
            buffers: self.buffers.clone(),
            keep_buffers: (self.capacity / self.unit) as usize,
        });
        st.held += unit.len as u64;
        st.units.insert((vid, u0), unit.clone());
        (unit, true)
    }

    /// Drop the least recently used units until within capacity (never those of `keep`).
    fn evict(&self, st: &mut State, keep: &[Arc<Unit>]) {
        while st.held > self.capacity && st.units.len() > keep.len() {
            let victim = st
                .units
                .iter()
                .filter(|(_, u)| !keep.iter().any(|k| Arc::ptr_eq(k, u)))
                .min_by_key(|(_, u)| u.last_use.load(Ordering::Relaxed))
                .map(|(k, _)| *k);
            let Some(key) = victim else { break };
            if let Some(u) = st.units.remove(&key) {
                st.held -= u.len as u64;
            }
        }
    }

    fn forget(&self, unit: &Arc<Unit>) {
        let mut st = self.lock();
        let key = (unit.vid, unit.start);
        if st.units.get(&key).is_some_and(|u| Arc::ptr_eq(u, unit)) {
            st.units.remove(&key);
            st.held -= unit.len as u64;
        }
    }

    /// Fetch a unit this thread owns (its slot is Fetching), then wake its waiters.
    fn fetch(&self, unit: &Arc<Unit>) {
        let mut buf =
            self.buffers.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
        buf.resize(unit.len, 0);
        let result = self.up.get_range(&unit.version, unit.start, &mut buf);
        self.stats.unit_fetches.fetch_add(1, Ordering::Relaxed);
        let slot = match result {
            Ok(n) => {
                self.stats.unit_bytes.fetch_add(n as u64, Ordering::Relaxed);
                buf.truncate(n);
                Slot::Ready(Arc::new(buf))
            }
            Err(why) => {
                self.forget(unit); // forget a failure at once: the next read tries again
                Slot::Failed(why)
            }
        };
        *unit.lock() = slot;
        unit.cv.notify_all();
    }

    /// The bytes of a unit, fetching it here if it is still only queued.
    fn wait(&self, unit: &Arc<Unit>) -> Result<Arc<Vec<u8>>, String> {
        let mut slot = unit.lock();
        loop {
            match &*slot {
                Slot::Ready(b) => return Ok(b.clone()),
                Slot::Failed(why) => return Err(why.clone()),
                Slot::Queued => {
                    *slot = Slot::Fetching;
                    drop(slot);
                    self.fetch(unit);
                    slot = unit.lock();
                }
                Slot::Fetching => {
                    self.stats.shared_waits.fetch_add(1, Ordering::Relaxed);
                    slot = unit.cv.wait(slot).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }

    /// The unit a byte falls in (for tests).
    pub fn unit_of(&self, off: u64, size: u64) -> std::ops::Range<u64> {
        unit_at(off, self.bs, size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::UpstreamConfig;
    use crate::testserver::TestServer;
    use std::time::Duration;

    fn reader(srv: &TestServer, bs: u64, capacity: u64, deadline_ms: u64) -> Arc<UnitReader> {
        let up = Upstream::new(UpstreamConfig {
            base: srv.base(),
            dataset: "ds".into(),
            snapshot: "snap".into(),
            token: Some("tok".into()),
            deadline: Duration::from_millis(deadline_ms),
            connections: 8,
        });
        Arc::new(UnitReader::new(Arc::new(up), bs, capacity, 1))
    }

    fn data(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| ((i as u64 * 2654435761) >> 13) as u8 ^ seed).collect()
    }

    #[test]
    fn streams_fetch_whole_units_and_random_reads_exact_ranges() {
        let bs = 64 * 1024u64;
        let obj = data(10 * bs as usize + 123, 1);
        let srv = TestServer::start(vec![("v".into(), obj.clone())]);
        let r = reader(&srv, bs, 4 * bs, 5000);
        let pool = Pool::new(4, "t").unwrap();
        let mut streams = Streams::default();
        let size = obj.len() as u64;
        let mut buf = vec![0u8; 16 * 1024];
        let mut off = 0u64;
        while off < size {
            let end = (off + 16 * 1024).min(size);
            let s = streams.observe(0, off, end);
            let n = r.read(&pool, 0, "v", size, off, &mut buf[..(end - off) as usize], s).unwrap();
            assert_eq!(&buf[..n], &obj[off as usize..end as usize]);
            off = end;
        }
        let reqs = srv.requests();
        // One exact read (the first: no stream seen yet), then about one fetch per unit.
        assert!(reqs.len() <= 13, "{}", reqs.len());
        assert_eq!(r.stats.exact_fetches.load(Ordering::Relaxed), 1);
        assert!(srv.all_had("x-spokefs-snapshot", "snap"));
        assert!(srv.all_had("authorization", "Bearer tok"));
        // Random reads: exactly the range asked.
        srv.clear();
        let mut x = 7u64;
        for _ in 0..30 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let off = (x >> 20) % size;
            let len = ((x >> 8) % (3 * bs)).max(1);
            let end = (off + len).min(size);
            let mut out = vec![0u8; (end - off) as usize];
            let s = streams.observe(5, off, end);
            let n = r.read(&pool, 5, "v", size, off, &mut out, s).unwrap();
            assert_eq!(&out[..n], &obj[off as usize..end as usize]);
        }
        assert!(srv.requests().len() >= 25);
        // Past the end: nothing.
        assert_eq!(r.read(&pool, 0, "v", size, size, &mut buf, true).unwrap(), 0);
        assert!(r.held() <= 4 * bs + bs);
        pool.close();
    }

    #[test]
    fn concurrent_readers_of_one_stream_share_fetches() {
        let bs = 256 * 1024u64;
        let obj = data(8 * bs as usize, 2);
        let srv = TestServer::start(vec![("w".into(), obj.clone())]);
        let r = reader(&srv, bs, 64 * bs, 5000);
        let pool = Arc::new(Pool::new(4, "t").unwrap());
        let size = obj.len() as u64;
        let mut handles = Vec::new();
        for k in 0..4u64 {
            let (r, pool, obj) = (r.clone(), pool.clone(), obj.clone());
            handles.push(std::thread::spawn(move || {
                let mut out = vec![0u8; 32 * 1024];
                let mut off = k * 32 * 1024;
                while off < size {
                    let n = r.read(&pool, 0, "w", size, off, &mut out, true).unwrap();
                    assert_eq!(&out[..n], &obj[off as usize..off as usize + n]);
                    off += 4 * 32 * 1024;
                }
            }));
        }
        for h in handles {
            h.join().unwrap();
        }
        // Every unit fetched once (a unit dropped when fully served may be fetched again
        // by a prefetch racing its last reader, but never once per reader).
        assert!(srv.requests().len() <= 12, "{}", srv.requests().len());
        pool.close();
    }

    #[test]
    fn a_failed_unit_is_forgotten_and_the_next_read_tries_again() {
        let bs = 64 * 1024u64;
        let obj = data(3 * bs as usize, 3);
        let srv = TestServer::start(vec![("v".into(), obj.clone())]);
        let r = reader(&srv, bs, 4 * bs, 300);
        let pool = Pool::new(2, "t").unwrap();
        srv.set_failing(true); // 503s
        let mut out = vec![0u8; bs as usize];
        let e = r.read(&pool, 0, "v", obj.len() as u64, 0, &mut out, true).unwrap_err();
        assert!(e.contains("upstream unavailable for 0.3s (upstream answered 503)"), "{e}");
        srv.set_failing(false);
        let n = r.read(&pool, 0, "v", obj.len() as u64, 0, &mut out, true).unwrap();
        assert_eq!(&out[..n], &obj[..bs as usize]);
        // A version the upstream does not have: final at once.
        let t0 = std::time::Instant::now();
        let e = r.read(&pool, 1, "nope", 100, 0, &mut out[..100], false).unwrap_err();
        assert!(e.contains("no such"), "{e}");
        assert!(t0.elapsed() < Duration::from_millis(250));
        pool.close();
    }

    #[test]
    fn streams_are_seen_in_order() {
        let mut s = Streams::default();
        assert!(!s.observe(1, 4096, 8192));
        assert!(s.observe(1, 8192, 16384));
        assert!(!s.observe(1, 0, 4096));
        assert!(s.observe(2, 0, STREAM_MIN));
        assert!(!s.observe(3, 0, STREAM_MIN - 1));
    }
}
