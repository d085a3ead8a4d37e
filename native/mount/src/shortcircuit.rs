//! The short circuit: reading the spoke's cache files directly, on the spoke's own host
//! (the protocol of `spokefs.mount.source.ShortCircuit` and `spokefs.cache.shared`).
//!
//! The spoke says where blocks are (`POST /v1/datasets/{ds}/locate` with `fetch`, which
//! fetches missing ones first; its answer names the cache's id, which must be the one the
//! Python side probed). The mount reads the segment file itself (opened O_RDONLY |
//! O_NOFOLLOW) and checks every chunk it touches against the digests the spoke gave, in its
//! own buffer. A read whose block moved or left (its check fails) asks again; one that
//! fails twice is reported as damaged and the read goes over HTTP. Reads served here are
//! reported to the spoke every 50 ms in one request (`POST .../reads`), so its planner goes
//! on learning. Every locate and report also asks for the spoke's feed of blocks made
//! resident since the last one (`since`), so files the spoke prefetched are read without
//! asking first.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::num::NonZeroUsize;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use spokefs_core::read_checked;

use crate::blocks::{blocks_spanned, piece, whole_chunks};
use crate::events::{Events, Level};
use crate::http::{HttpError, Upstream, fmt_secs};
use crate::table::InodeTable;

pub const REPORT_EVERY: Duration = Duration::from_millis(50);
const SWEEP_EVERY: Duration = Duration::from_secs(10);
const CHUNKS_KEPT: usize = 64; // checked chunks kept for reads of pieces of them
const LOCS_KEPT: usize = 1 << 18; // block locations kept; the oldest go first

/// What the Python side's probe found (`ShortCircuit.probe`).
#[derive(Debug, Clone)]
pub struct ScConfig {
    pub cache_dir: PathBuf,
    pub cache_id: String,
    pub chunk_size: usize,
    /// The folder's internal key, sent as `X-Spokefs-Internal`.
    pub key: String,
}

/// How a read through the short circuit ended.
#[derive(Debug, PartialEq, Eq)]
pub enum ScRead {
    /// `n` bytes were read and checked into the buffer.
    Done(usize),
    /// Read it over HTTP instead (a block the spoke could not keep, a damaged one, the
    /// spoke refusing or down).
    Http,
    /// The spoke gave no answer within the deadline: EIO now.
    Fail(String),
}

struct Segment {
    id: u64,
    file: File,
}

#[derive(Clone)]
struct Loc {
    seg: Arc<Segment>,
    offset: u64,
    size: u64,
    chunks: Arc<[u8]>,
}

type Key = (u32, u64); // (version number, block index)

#[derive(Default)]
struct Locs {
    map: HashMap<Key, (Loc, u64)>,
    order: VecDeque<(Key, u64)>,
    seq: u64,
}

impl Locs {
    fn insert(&mut self, key: Key, loc: Loc) {
        self.seq += 1;
        self.map.insert(key, (loc, self.seq));
        self.order.push_back((key, self.seq));
        while self.map.len() > LOCS_KEPT {
            let Some((k, s)) = self.order.pop_front() else { break };
            if self.map.get(&k).is_some_and(|(_, cur)| *cur == s) {
                self.map.remove(&k);
            }
        }
        if self.order.len() > 2 * LOCS_KEPT {
            let map = &self.map;
            self.order.retain(|(k, s)| map.get(k).is_some_and(|(_, cur)| cur == s));
        }
    }
}

#[derive(Default)]
struct Chunks {
    map: HashMap<(u32, u64, u64), Arc<Vec<u8>>>,
    order: VecDeque<(u32, u64, u64)>,
}

#[derive(Default)]
struct Reports {
    reads: Vec<(u32, u64, u64)>,
    located_bytes: u64,
    pending: bool,
    stop: bool,
}

#[derive(Default)]
pub struct ScStats {
    pub hits: AtomicU64,
    pub located: AtomicU64,
    pub learned: AtomicU64,
    pub fallbacks: AtomicU64,
    pub damaged: AtomicU64,
    pub stale: AtomicU64,
    pub reports: AtomicU64,
}

pub struct ShortCircuit {
    up: Arc<Upstream>,
    cfg: ScConfig,
    table: Arc<InodeTable>,
    events: Arc<Events>,
    bs: u64,
    chunk: NonZeroUsize,
    reader: String,
    locs: Mutex<Locs>,
    heard: Mutex<HashMap<Key, Value>>,
    segs: Mutex<HashMap<u64, Arc<Segment>>>,
    chunks: Mutex<Chunks>,
    reports: Mutex<Reports>,
    reports_cv: Condvar,
    cursor: AtomicU64,
    asking_news: AtomicBool,
    more_news: AtomicBool,
    reporter: Mutex<Option<JoinHandle<()>>>,
    pub stats: ScStats,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// A segment file's name (`spokefs.cache.segments.SegmentFiles.name`).
pub fn segment_name(id: u64) -> String {
    format!("{id:08x}.seg")
}

impl ShortCircuit {
    pub fn new(
        up: Arc<Upstream>,
        cfg: ScConfig,
        table: Arc<InodeTable>,
        events: Arc<Events>,
        block_size: u64,
    ) -> Arc<ShortCircuit> {
        let sc = Arc::new(ShortCircuit {
            up,
            chunk: NonZeroUsize::new(cfg.chunk_size).unwrap_or(NonZeroUsize::MIN),
            cfg: ScConfig { chunk_size: cfg.chunk_size.max(1), ..cfg },
            table,
            events,
            bs: block_size.max(1),
            reader: format!("mount-{}", std::process::id()),
            locs: Mutex::default(),
            heard: Mutex::default(),
            segs: Mutex::default(),
            chunks: Mutex::default(),
            reports: Mutex::default(),
            reports_cv: Condvar::new(),
            cursor: AtomicU64::new(0),
            asking_news: AtomicBool::new(false),
            more_news: AtomicBool::new(false),
            reporter: Mutex::new(None),
            stats: ScStats::default(),
        });
        let me = sc.clone();
        let handle = std::thread::Builder::new()
            .name("spokefs-reports".into())
            .spawn(move || me.report_loop());
        match handle {
            Ok(h) => *lock(&sc.reporter) = Some(h),
            Err(e) => sc.events.log(
                Level::Warning,
                format!("short circuit: no report thread ({e}); reads go unreported"),
            ),
        }
        sc
    }

    /// Fill `out` with bytes `[start, start + out.len())` of version `vid`.
    pub fn read(&self, vid: u32, start: u64, out: &mut [u8]) -> ScRead {
        let end = start + out.len() as u64;
        let bs = self.bs;
        let keys = blocks_spanned(start, end, bs);
        let missing: Vec<u64> =
            keys.clone().filter(|i| !self.has_loc((vid, *i)) && !self.adopt((vid, *i))).collect();
        if !missing.is_empty() {
            // The spoke hears of this read (and counts it) with the locate.
            match self.locate(vid, &missing, Some((start, end))) {
                Ok(true) => {}
                Ok(false) => {
                    self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                    return ScRead::Http;
                }
                Err(why) => return ScRead::Fail(why),
            }
        } else {
            self.report(vid, start, end);
        }
        let mut n = 0usize;
        for i in keys {
            let p = piece(i, start, end, bs);
            let Some(loc) = self.get_loc((vid, i)) else {
                self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                return ScRead::Http;
            };
            let hi = p.end.min(loc.size);
            if hi <= p.start {
                break;
            }
            let len = (hi - p.start) as usize;
            match self.read_block((vid, i), p.start, &mut out[n..n + len]) {
                Ok(true) => {}
                Ok(false) => {
                    self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                    return ScRead::Http;
                }
                Err(why) => return ScRead::Fail(why),
            }
            n += len;
            if hi < p.end {
                break; // the last block of the object: done
            }
        }
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        if !missing.is_empty() {
            let mut r = lock(&self.reports);
            r.located_bytes += n as u64;
            r.pending = true;
            drop(r);
            self.reports_cv.notify_one();
        }
        ScRead::Done(n)
    }

    fn has_loc(&self, key: Key) -> bool {
        lock(&self.locs).map.contains_key(&key)
    }

    fn get_loc(&self, key: Key) -> Option<Loc> {
        lock(&self.locs).map.get(&key).map(|(l, _)| l.clone())
    }

    fn drop_loc(&self, key: Key) {
        lock(&self.locs).map.remove(&key);
    }

    /// Read and check bytes `[lo, lo + out.len())` of a block (two tries): Ok(false) to go
    /// over HTTP instead, Err when the spoke gave no answer in time.
    fn read_block(&self, key: Key, lo: u64, out: &mut [u8]) -> Result<bool, String> {
        let chunk = self.cfg.chunk_size;
        for attempt in 0..2 {
            let loc = match self.get_loc(key) {
                Some(l) => l,
                None => {
                    if !self.locate(key.0, &[key.1], None)? {
                        return Ok(false);
                    }
                    match self.get_loc(key) {
                        Some(l) => l,
                        None => return Ok(false),
                    }
                }
            };
            let hi = lo + out.len() as u64;
            let ok = if whole_chunks(lo, hi, loc.size, chunk as u64) {
                read_checked(
                    &loc.seg.file,
                    loc.offset + lo,
                    out,
                    lo as usize,
                    self.chunk,
                    &loc.chunks,
                )
                .is_ok()
            } else {
                self.pieces(key, &loc, lo, out)
            };
            if ok {
                return Ok(true);
            }
            self.drop_loc(key); // stale (evicted, moved) or damaged: ask again
            if attempt == 1 {
                self.stats.damaged.fetch_add(1, Ordering::Relaxed);
                let doc = json!({"blocks": [[self.table.version(key.0), key.1]], "damaged": true});
                let _ = self.post("locate", doc);
            } else {
                self.stats.stale.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(false)
    }

    /// Fill `out` (not whole chunks) from checked chunks kept in memory: a chunk is read and
    /// checked once however many small pieces of it the kernel asks for.
    fn pieces(&self, key: Key, loc: &Loc, lo: u64, out: &mut [u8]) -> bool {
        let chunk = self.cfg.chunk_size as u64;
        let mut pos = 0usize;
        while pos < out.len() {
            let at = lo + pos as u64;
            let c = at / chunk;
            let Some(data) = self.chunk(key, loc, c) else { return false };
            let off = (at - c * chunk) as usize;
            let take = (out.len() - pos).min(data.len().saturating_sub(off));
            if take == 0 {
                return false;
            }
            out[pos..pos + take].copy_from_slice(&data[off..off + take]);
            pos += take;
        }
        true
    }

    fn chunk(&self, key: Key, loc: &Loc, c: u64) -> Option<Arc<Vec<u8>>> {
        let ck = (key.0, key.1, c);
        if let Some(d) = lock(&self.chunks).map.get(&ck) {
            return Some(d.clone());
        }
        let chunk = self.cfg.chunk_size as u64;
        let size = chunk.min(loc.size.checked_sub(c * chunk)?) as usize;
        let mut buf = vec![0u8; size];
        read_checked(
            &loc.seg.file,
            loc.offset + c * chunk,
            &mut buf,
            (c * chunk) as usize,
            self.chunk,
            &loc.chunks,
        )
        .ok()?;
        let data = Arc::new(buf);
        let mut cs = lock(&self.chunks);
        if cs.map.insert(ck, data.clone()).is_none() {
            cs.order.push_back(ck);
        }
        while cs.map.len() > CHUNKS_KEPT {
            let Some(old) = cs.order.pop_front() else { break };
            cs.map.remove(&old);
        }
        Some(data)
    }

    /// Ask the spoke where `blocks` of `vid` are (fetching missing ones): Ok(false) if it
    /// refused, failed or answers for another cache folder; Err if no answer in time.
    fn locate(&self, vid: u32, blocks: &[u64], read: Option<(u64, u64)>) -> Result<bool, String> {
        let version = self.table.version(vid);
        let mut doc = json!({
            "blocks": blocks.iter().map(|i| json!([version, i])).collect::<Vec<_>>(),
            "fetch": true,
        });
        if let Some((start, end)) = read {
            doc["read"] = json!({"start": start, "end": end, "reader": self.reader});
        }
        let Some(answer) = self.post_with_news("locate", doc)? else { return Ok(false) };
        if answer.pointer("/cache/id").and_then(Value::as_str) != Some(self.cfg.cache_id.as_str()) {
            return Ok(false); // the spoke restarted on another folder
        }
        let Some(entries) = answer.get("blocks").and_then(Value::as_array) else {
            return Ok(false);
        };
        self.stats.located.fetch_add(blocks.len() as u64, Ordering::Relaxed);
        for (i, entry) in blocks.iter().zip(entries) {
            match self.loc_from(entry) {
                Some(loc) => lock(&self.locs).insert((vid, *i), loc),
                None => self.drop_loc((vid, *i)),
            }
        }
        Ok(true)
    }

    /// Whether the spoke's feed told us where `key` is (now a known location).
    fn adopt(&self, key: Key) -> bool {
        let Some(entry) = lock(&self.heard).remove(&key) else { return false };
        match self.loc_from(&entry) {
            Some(loc) => {
                lock(&self.locs).insert(key, loc);
                true
            }
            None => false,
        }
    }

    fn loc_from(&self, entry: &Value) -> Option<Loc> {
        let seg = self.segment(entry.get("seg")?.as_u64()?)?;
        Some(Loc {
            seg,
            offset: entry.get("offset")?.as_u64()?,
            size: entry.get("size")?.as_u64()?,
            chunks: unhex(entry.get("chunks")?.as_str()?)?.into(),
        })
    }

    fn segment(&self, id: u64) -> Option<Arc<Segment>> {
        if let Some(s) = lock(&self.segs).get(&id) {
            return Some(s.clone());
        }
        let path = self.cfg.cache_dir.join("segments").join(segment_name(id));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .ok()?;
        let seg = Arc::new(Segment { id, file });
        Some(lock(&self.segs).entry(id).or_insert(seg).clone())
    }

    /// The spoke's answer; Ok(None) if it refused or failed at once (then the read goes
    /// over HTTP); Err if it gave no answer within the deadline.
    fn post(&self, what: &str, mut doc: Value) -> Result<Option<Value>, String> {
        doc["snapshots"] = json!([self.up.config().snapshot]);
        let deadline = self.up.config().deadline;
        match self.up.post_json(what, &doc, &[("X-Spokefs-Internal", &self.cfg.key)], deadline) {
            Ok(v) => Ok(Some(v)),
            Err(HttpError::Timeout) => Err(format!(
                "the spoke gave no answer within {}s ({what})",
                fmt_secs(deadline.as_secs_f64())
            )),
            Err(e) => {
                self.events.log(
                    Level::Debug,
                    format!("short circuit: {what} failed ({e}); reading over HTTP"),
                );
                Ok(None)
            }
        }
    }

    /// `post`, asking for the feed too unless a request in flight already does (answers to
    /// one cursor would bring the same blocks twice).
    fn post_with_news(&self, what: &str, mut doc: Value) -> Result<Option<Value>, String> {
        if self.asking_news.swap(true, Ordering::AcqRel) {
            return self.post(what, doc);
        }
        doc["since"] = json!(self.cursor.load(Ordering::Acquire));
        let answer = self.post(what, doc);
        if let Ok(Some(a)) = &answer {
            if let Some(news) = a.get("news") {
                self.take_news(news);
            }
        }
        self.asking_news.store(false, Ordering::Release);
        answer
    }

    fn take_news(&self, news: &Value) {
        let blocks = news.get("blocks").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
        let mut heard = lock(&self.heard);
        for b in blocks {
            let (Some(v), Some(i), Some(entry)) =
                (b.get(0).and_then(Value::as_str), b.get(1).and_then(Value::as_u64), b.get(2))
            else {
                continue;
            };
            if let Some(vid) = self.table.vid(v) {
                heard.insert((vid, i), entry.clone()); // decoded when read (most may never be)
            }
        }
        while heard.len() > LOCS_KEPT {
            let Some(k) = heard.keys().next().copied() else { break };
            heard.remove(&k);
        }
        drop(heard);
        self.stats.learned.fetch_add(blocks.len() as u64, Ordering::Relaxed);
        if let Some(c) = news.get("cursor").and_then(Value::as_u64) {
            self.cursor.store(c, Ordering::Release);
        }
        if news.get("more").and_then(Value::as_bool) == Some(true) {
            self.more_news.store(true, Ordering::Release);
            lock(&self.reports).pending = true;
            self.reports_cv.notify_one();
        }
    }

    fn report(&self, vid: u32, start: u64, end: u64) {
        let mut r = lock(&self.reports);
        r.reads.push((vid, start, end));
        r.pending = true;
        drop(r);
        self.reports_cv.notify_one();
    }

    fn reads_doc(&self, reads: &[(u32, u64, u64)], extra: u64) -> Value {
        let reads: Vec<Value> = reads
            .iter()
            .map(|(vid, s, e)| json!([self.table.version(*vid), s, e, {"reader": self.reader}]))
            .collect();
        json!({"reads": reads, "by": "mount", "bytes": extra})
    }

    /// Report reads every REPORT_EVERY while there are any (or news left to fetch); close
    /// segments the spoke deleted now and then.
    fn report_loop(&self) {
        let mut last_sweep = Instant::now();
        loop {
            {
                let mut r = lock(&self.reports);
                while !r.pending && !r.stop {
                    let (g, _) = self
                        .reports_cv
                        .wait_timeout(r, SWEEP_EVERY)
                        .unwrap_or_else(|e| e.into_inner());
                    r = g;
                    if last_sweep.elapsed() >= SWEEP_EVERY {
                        break;
                    }
                }
                if r.stop {
                    return;
                }
            }
            if last_sweep.elapsed() >= SWEEP_EVERY {
                self.sweep();
                last_sweep = Instant::now();
            }
            std::thread::sleep(REPORT_EVERY); // gather what comes meanwhile
            let (reads, extra) = {
                let mut r = lock(&self.reports);
                r.pending = false;
                (std::mem::take(&mut r.reads), std::mem::take(&mut r.located_bytes))
            };
            let more = self.more_news.swap(false, Ordering::AcqRel);
            if reads.is_empty() && extra == 0 && !more {
                continue;
            }
            self.stats.reports.fetch_add(1, Ordering::Relaxed);
            let _ = self.post_with_news("reads", self.reads_doc(&reads, extra)); // a report lost costs a hint
        }
    }

    /// Forget segments the spoke deleted (an open descriptor keeps the file); how many.
    pub fn sweep(&self) -> usize {
        let gone: Vec<u64> = lock(&self.segs)
            .iter()
            .filter(|(_, s)| s.file.metadata().map_or(true, |m| m.nlink() == 0))
            .map(|(id, _)| *id)
            .collect();
        if gone.is_empty() {
            return 0;
        }
        let mut segs = lock(&self.segs);
        for id in &gone {
            segs.remove(id);
        }
        drop(segs);
        lock(&self.locs).map.retain(|_, (l, _)| !gone.contains(&l.seg.id));
        gone.len()
    }

    /// Stop reporting; the last reads are told (briefly tried).
    pub fn close(&self) {
        lock(&self.reports).stop = true;
        self.reports_cv.notify_all();
        if let Some(h) = lock(&self.reporter).take() {
            let _ = h.join();
        }
        let (reads, extra) = {
            let mut r = lock(&self.reports);
            (std::mem::take(&mut r.reads), std::mem::take(&mut r.located_bytes))
        };
        if !reads.is_empty() || extra > 0 {
            let mut doc = self.reads_doc(&reads, extra);
            doc["snapshots"] = json!([self.up.config().snapshot]);
            let _ = self.up.post_json(
                "reads",
                &doc,
                &[("X-Spokefs-Internal", &self.cfg.key)],
                Duration::from_secs(2),
            );
        }
        let s = &self.stats;
        self.events.log(
            Level::Info,
            format!(
                "short circuit: {} reads from the spoke's cache files, {} blocks located by asking, {} locations heard ahead, {} reads over HTTP instead",
                s.hits.load(Ordering::Relaxed),
                s.located.load(Ordering::Relaxed),
                s.learned.load(Ordering::Relaxed),
                s.fallbacks.load(Ordering::Relaxed)
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_names() {
        assert_eq!(unhex("00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(unhex("0"), None);
        assert_eq!(unhex("zz"), None);
        assert_eq!(unhex(""), Some(vec![]));
        assert_eq!(segment_name(1), "00000001.seg");
        assert_eq!(segment_name(0x1234abcd), "1234abcd.seg");
    }

    #[test]
    fn locations_stay_bounded_and_the_newest_win() {
        let f = File::open("/proc/self/stat").unwrap();
        let seg = Arc::new(Segment { id: 1, file: f });
        let loc = |o| Loc { seg: seg.clone(), offset: o, size: 1, chunks: Arc::from(&[][..]) };
        let mut locs = Locs::default();
        for i in 0..(LOCS_KEPT as u64 + 10) {
            locs.insert((0, i), loc(i));
        }
        assert_eq!(locs.map.len(), LOCS_KEPT);
        assert!(!locs.map.contains_key(&(0, 0)));
        assert!(locs.map.contains_key(&(0, LOCS_KEPT as u64 + 9)));
        // Re-inserting an old key makes it new: it is not the next to go.
        locs.insert((0, 20), loc(99));
        locs.insert((0, LOCS_KEPT as u64 + 10), loc(1));
        assert_eq!(locs.map[&(0, 20)].0.offset, 99);
        assert!(locs.order.len() <= 2 * LOCS_KEPT + 1);
    }
}
