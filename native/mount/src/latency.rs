//! How long the mount takes to answer each kind of FUSE request, as histograms the mount's
//! `/metrics` exports (`spokefs_mount_op_seconds`, src/spokefs/mount/metrics.py).
//!
//! Recording is on every request, so it is atomics only: one clock read at the start, and
//! at the reply a bucket index from the leading zeros of the microseconds, then two relaxed
//! adds. The buckets are fixed and log-spaced (upper bounds 1 µs · 2^k, k = 0..24: 1 µs to
//! 16.8 s, then +Inf), the same bounds as the Python engine's histogram, so the two engines'
//! metrics are one series. Python reads all of it in one call (`snapshot`), never a call per
//! request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Finite buckets; `counts` has one more, for +Inf.
pub const BUCKETS: usize = 25;

/// The kinds of request timed (readdirplus counts as readdir).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Lookup,
    Getattr,
    Open,
    Opendir,
    Read,
    Readdir,
}

impl Op {
    pub const ALL: [Op; 6] =
        [Op::Lookup, Op::Getattr, Op::Open, Op::Opendir, Op::Read, Op::Readdir];

    pub fn name(self) -> &'static str {
        match self {
            Op::Lookup => "lookup",
            Op::Getattr => "getattr",
            Op::Open => "open",
            Op::Opendir => "opendir",
            Op::Read => "read",
            Op::Readdir => "readdir",
        }
    }
}

/// The upper bound of bucket `k`, in seconds.
pub fn bound_s(k: usize) -> f64 {
    (1u64 << k) as f64 / 1e6
}

/// The bucket a request of `ns` nanoseconds falls in: the least k with ns <= 2^k µs
/// (`BUCKETS` is +Inf).
pub fn bucket(ns: u64) -> usize {
    let us = ns.div_ceil(1000);
    if us <= 1 { 0 } else { ((64 - (us - 1).leading_zeros()) as usize).min(BUCKETS) }
}

#[derive(Default)]
struct Histogram {
    counts: [AtomicU64; BUCKETS + 1],
    sum_ns: AtomicU64,
}

/// One histogram per kind of request.
#[derive(Default)]
pub struct Latency {
    ops: [Histogram; 6],
}

/// One kind's reading: requests per bucket (not cumulative; the last is +Inf) and their
/// total time in seconds.
pub struct OpSnapshot {
    pub op: &'static str,
    pub counts: Vec<u64>,
    pub sum_s: f64,
}

impl Latency {
    /// Record a request of kind `op` that began at `start` and has just been answered.
    pub fn record(&self, op: Op, start: Instant) {
        let ns = start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        let h = &self.ops[op as usize];
        h.counts[bucket(ns)].fetch_add(1, Ordering::Relaxed);
        h.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Every kind's counts (relaxed reads: a scrape racing a request may see its bucket
    /// and not yet its time, which the next scrape sets right).
    pub fn snapshot(&self) -> Vec<OpSnapshot> {
        Op::ALL
            .iter()
            .map(|&op| {
                let h = &self.ops[op as usize];
                OpSnapshot {
                    op: op.name(),
                    counts: h.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect(),
                    sum_s: h.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
                }
            })
            .collect()
    }
}

/// Records its request's time when dropped: after the reply, whichever way the handler
/// returns.
pub struct Timed<'a> {
    latency: &'a Latency,
    op: Op,
    start: Instant,
}

impl<'a> Timed<'a> {
    pub fn new(latency: &'a Latency, op: Op) -> Timed<'a> {
        Timed { latency, op, start: Instant::now() }
    }
}

impl Drop for Timed<'_> {
    fn drop(&mut self) {
        self.latency.record(self.op, self.start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn buckets_are_the_least_bound_at_or_above() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1000), 0); // 1 µs: le 1e-06
        assert_eq!(bucket(1001), 1);
        assert_eq!(bucket(2000), 1);
        assert_eq!(bucket(2001), 2);
        assert_eq!(bucket(4000), 2);
        assert_eq!(bucket(1_000_000), 10); // 1 ms: le 1.024e-3
        assert_eq!(bucket((1 << 24) * 1000), 24);
        assert_eq!(bucket((1 << 24) * 1000 + 1), BUCKETS); // +Inf
        assert_eq!(bucket(u64::MAX), BUCKETS);
        for ns in [1u64, 999, 1500, 3_000_000, 7_777_777_777] {
            let k = bucket(ns);
            assert!(ns as f64 / 1e9 <= bound_s(k) + 1e-15, "{ns} {k}");
            assert!(k == 0 || ns as f64 / 1e9 > bound_s(k - 1), "{ns} {k}");
        }
        assert_eq!(bound_s(0), 1e-6);
        assert_eq!(bound_s(24), 16.777216);
    }

    #[test]
    fn records_by_kind_with_their_time() {
        let l = Latency::default();
        {
            let _t = Timed::new(&l, Op::Lookup);
        }
        l.record(Op::Read, Instant::now() - Duration::from_millis(3));
        l.record(Op::Read, Instant::now() - Duration::from_secs(20));
        let s = l.snapshot();
        assert_eq!(
            s.iter().map(|o| o.op).collect::<Vec<_>>(),
            ["lookup", "getattr", "open", "opendir", "read", "readdir"]
        );
        assert!(s.iter().all(|o| o.counts.len() == BUCKETS + 1));
        assert_eq!(s[0].counts.iter().sum::<u64>(), 1);
        let read = &s[4];
        assert_eq!(read.counts.iter().sum::<u64>(), 2);
        assert_eq!(read.counts[BUCKETS], 1); // 20 s: past the last bound
        assert_eq!(read.counts[12], 1); // 3 ms: le 4.096 ms
        assert!(read.sum_s >= 20.003 && read.sum_s < 21.0, "{}", read.sum_s);
        assert_eq!(s[1].counts.iter().sum::<u64>(), 0);
    }
}
