//! The writable part of a mount (`spokefs mount --writable`): files this mount creates,
//! staged on local disk, and the queue that hands their uploads to Python.
//!
//! What may change: files and folders this mount made (create, write, truncate, fsync,
//! close, rename, unlink, mkdir, rmdir). The snapshot's own files and folders stay
//! read-only (EROFS), and a file stops being writable once it is published.
//!
//! **The seam.** Bytes never cross it: a written file lives in its staging file here, and
//! Python (`spokefs.mount.writes`) gets one request per file operation, never per write:
//! `Put` (a close or fsync of a file with bytes not yet uploaded), `Rename`, `Discard`. It
//! uploads the staging file to the spoke with the client's resumable uploads, commits a
//! folder when its commit marker arrives, and answers with an errno (0: done) and the folder
//! it committed. The FUSE request waits on a writer thread (never the session thread), so
//! `close()` and `fsync()` return once the spoke holds the bytes durably, and other requests
//! go on meanwhile. A committed file's staging copy is dropped (the hub and the spoke hold
//! it); it stays listed and reads of it answer ESTALE (it is in a newer snapshot).
//!
//! **Kernel passthrough.** Where the kernel lets it (FUSE passthrough: Linux 6.9 and later,
//! a mount by root), a file this mount creates is opened in passthrough: the kernel reads
//! and writes its staging file itself, so a write costs what a write to local disk costs and
//! never wakes this process. This mount then sees no write; it knows a file changed by its
//! staging file's [`Stamp`] (size, mtime, ctime), which is exact only where the staging
//! folder's filesystem gives a new ctime to every write after a stat (multigrain
//! timestamps: ext4, xfs, btrfs, tmpfs from Linux 6.13). [`fine_grained_times`] checks that
//! when the mount starts; where it fails, writes go through this process as before.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::BackingId;

use crate::pool::Pool;
use crate::table::InodeTable;

/// One request to Python.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// Upload `staged` as `path` (durable at the spoke when answered).
    Put { path: String, staged: PathBuf },
    /// `from` becomes `to`: upload `staged` as `to`, then drop the upload of `from`
    /// (`uploaded`: one was made).
    Rename { from: String, to: String, staged: PathBuf, uploaded: bool },
    /// Drop the upload of `path` (the file was unlinked).
    Discard { path: String },
}

/// Python's answer: 0 or an errno, and the folder prefix it committed ("dir/"), if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub errno: i32,
    pub committed: Option<String>,
}

impl Answer {
    fn failed(errno: i32) -> Answer {
        Answer { errno, committed: None }
    }
}

#[derive(Default)]
struct QueueState {
    waiting: VecDeque<(u64, Ask)>,
    answers: HashMap<u64, SyncSender<Answer>>,
    next: u64,
    closed: bool,
}

/// Requests waiting for Python, and who waits for each answer.
#[derive(Default)]
pub struct Queue {
    state: Mutex<QueueState>,
    cv: Condvar,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ask Python and wait for its answer (EIO once the queue is closed).
    pub fn ask(&self, op: Ask) -> Answer {
        let (tx, rx) = sync_channel(1);
        {
            let mut s = self.lock();
            if s.closed {
                return Answer::failed(libc::EIO);
            }
            s.next += 1;
            let id = s.next;
            s.waiting.push_back((id, op));
            s.answers.insert(id, tx);
        }
        self.cv.notify_all();
        rx.recv().unwrap_or(Answer::failed(libc::EIO))
    }

    /// The requests waiting (at most `timeout` for one to come); None once closed.
    pub fn take(&self, timeout: Duration) -> Option<Vec<(u64, Ask)>> {
        let mut s = self.lock();
        if s.waiting.is_empty() && !s.closed {
            s = self.cv.wait_timeout(s, timeout).unwrap_or_else(|e| e.into_inner()).0;
        }
        if s.closed && s.waiting.is_empty() {
            return None;
        }
        Some(s.waiting.drain(..).collect())
    }

    /// Answer request `id`; false when nothing waits for it.
    pub fn answer(&self, id: u64, answer: Answer) -> bool {
        let tx = self.lock().answers.remove(&id);
        tx.is_some_and(|tx| tx.send(answer).is_ok())
    }

    /// No more requests: everything asked and not answered fails with EIO.
    pub fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        s.waiting.clear();
        for (_, tx) in s.answers.drain() {
            let _ = tx.send(Answer::failed(libc::EIO));
        }
        drop(s);
        self.cv.notify_all();
    }
}

/// A file this mount wrote.
#[derive(Debug)]
pub struct Written {
    pub staged: PathBuf,
    /// None once committed (the staging copy is gone).
    pub file: Option<Arc<File>>,
    pub size: u64,
    /// Changes made (writes, truncations) and how many of them the last upload carried.
    pub changes: u64,
    pub uploaded: u64,
    /// An upload of it exists at the spoke (to discard if it is unlinked).
    pub at_spoke: bool,
    /// Set while the kernel reads and writes the staging file itself (passthrough): every
    /// open of the file then answers with it (the kernel refuses an inode opened both ways).
    pub backing: Option<Arc<BackingId>>,
    /// The staging file's stamp when the last upload began (passthrough files).
    pub stamp: Option<Stamp>,
}

impl Written {
    /// Changes the spoke does not hold: counted, or (passthrough, where writes are not seen)
    /// a staging file whose stamp moved since the last upload began.
    pub fn dirty(&self) -> bool {
        self.changes != self.uploaded
            || (self.backing.is_some()
                && self.file.as_ref().is_some_and(|f| Stamp::of(f) != self.stamp))
    }

    /// What the next upload starts from: the changes counted and the staging file's stamp.
    pub fn mark(&self) -> (u64, Option<Stamp>) {
        let stamp = if self.backing.is_some() {
            self.file.as_ref().and_then(|f| Stamp::of(f))
        } else {
            None
        };
        (self.changes, stamp)
    }
}

/// A staging file's size, mtime and ctime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    pub fn of(f: &File) -> Option<Stamp> {
        let m = f.metadata().ok()?;
        Some(Stamp {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// Whether every write to a file in `dir` that follows a stat of it gets a new ctime (so a
/// [`Stamp`] sees every change): eight one-byte writes, each stat'ed, must give eight ctimes.
/// Coarse timestamps (one per clock tick) give the same one to writes microseconds apart.
pub fn fine_grained_times(dir: &Path) -> bool {
    let probe = dir.join(format!(".stamp-probe-{}", std::process::id()));
    let Ok(f) = File::options().read(true).write(true).create_new(true).open(&probe) else {
        return false;
    };
    let _ = std::fs::remove_file(&probe);
    let mut seen = Vec::with_capacity(8);
    for i in 0..8u8 {
        match (f.write_all_at(&[i], 0), Stamp::of(&f)) {
            (Ok(()), Some(s)) if !seen.contains(&s.ctime) => seen.push(s.ctime),
            _ => return false,
        }
    }
    true
}

#[derive(Debug)]
pub enum Kind {
    Dir,
    File(Written),
}

#[derive(Debug)]
pub struct Node {
    pub parent: u64,
    pub name: String,
    pub perm: u16,
    pub mtime: SystemTime,
    pub kind: Kind,
}

/// What this mount made, by inode (numbered after the snapshot's).
pub struct Overlay {
    pub nodes: HashMap<u64, Node>,
    names: HashMap<(u64, String), u64>,
    next: u64,
}

impl Overlay {
    pub fn new(first_ino: u64) -> Overlay {
        Overlay { nodes: HashMap::new(), names: HashMap::new(), next: first_ino }
    }

    pub fn lookup(&self, parent: u64, name: &str) -> Option<u64> {
        self.names.get(&(parent, name.to_owned())).copied()
    }

    pub fn add(&mut self, node: Node) -> u64 {
        let ino = self.next;
        self.next += 1;
        self.names.insert((node.parent, node.name.clone()), ino);
        self.nodes.insert(ino, node);
        ino
    }

    pub fn remove(&mut self, ino: u64) -> Option<Node> {
        let node = self.nodes.remove(&ino)?;
        self.names.remove(&(node.parent, node.name.clone()));
        Some(node)
    }

    pub fn rename(&mut self, ino: u64, parent: u64, name: &str) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            self.names.remove(&(node.parent, node.name.clone()));
            node.parent = parent;
            node.name = name.to_owned();
            self.names.insert((parent, name.to_owned()), ino);
        }
    }

    /// The children this mount made in folder `ino`, by inode.
    pub fn children(&self, ino: u64) -> Vec<u64> {
        let mut kids: Vec<u64> =
            self.nodes.iter().filter(|(_, n)| n.parent == ino).map(|(k, _)| *k).collect();
        kids.sort_unstable();
        kids
    }

    pub fn is_dir(&self, ino: u64) -> bool {
        matches!(self.nodes.get(&ino), Some(Node { kind: Kind::Dir, .. }))
    }

    /// The dataset path of inode `ino` (the snapshot's or this mount's).
    pub fn path(&self, table: &InodeTable, ino: u64) -> Option<String> {
        if let Some(p) = table.path(ino) {
            return Some(p.to_owned());
        }
        let node = self.nodes.get(&ino)?;
        let head = self.path(table, node.parent)?;
        Some(if head.is_empty() { node.name.clone() } else { format!("{head}/{}", node.name) })
    }

    /// After Python committed folder `prefix` ("dir/"): every file under it whose bytes
    /// were all uploaded is published; its staging copy goes. The staging paths removed.
    pub fn committed(&mut self, table: &InodeTable, prefix: &str) -> Vec<PathBuf> {
        let under: Vec<u64> = self
            .nodes
            .keys()
            .copied()
            .filter(|ino| self.path(table, *ino).is_some_and(|p| p.starts_with(prefix)))
            .collect();
        let mut gone = Vec::new();
        for ino in under {
            if let Some(Node { kind: Kind::File(w), .. }) = self.nodes.get_mut(&ino)
                && !w.dirty()
                && w.file.take().is_some()
            {
                // Opens that come now answer without it (the files open keep theirs).
                w.backing = None;
                gone.push(w.staged.clone());
            }
        }
        gone
    }
}

/// A writable mount's state: the overlay, the staging folder, the queue to Python, and the
/// threads that wait for its answers.
pub struct Writes {
    pub staging: PathBuf,
    pub overlay: Mutex<Overlay>,
    pub queue: Arc<Queue>,
    pub pool: Pool,
    /// New files are opened in kernel passthrough: asked for (the staging folder's times
    /// fine-grained), then granted by the kernel at the session's start; cleared if the
    /// kernel refuses a backing file (a mount without CAP_SYS_ADMIN).
    pub passthrough: AtomicBool,
}

impl Writes {
    pub fn new(
        staging: PathBuf,
        first_ino: u64,
        threads: usize,
        passthrough: bool,
    ) -> std::io::Result<Writes> {
        Ok(Writes {
            staging,
            overlay: Mutex::new(Overlay::new(first_ino)),
            queue: Arc::new(Queue::default()),
            pool: Pool::new(threads, "spokefs-write")?,
            passthrough: AtomicBool::new(passthrough),
        })
    }

    pub fn passthrough(&self) -> bool {
        self.passthrough.load(Ordering::Relaxed)
    }

    pub fn lock(&self) -> MutexGuard<'_, Overlay> {
        self.overlay.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The staging file of a new inode.
    pub fn staged_path(&self, ino: u64) -> PathBuf {
        self.staging.join(format!("{ino}.part"))
    }
}

/// A valid new name in a folder: one path component.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && name.len() <= 255
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_reaches_the_asker_and_close_fails_the_rest() {
        let q = Arc::new(Queue::default());
        let q2 = q.clone();
        let asker = std::thread::spawn(move || q2.ask(Ask::Discard { path: "a".into() }));
        let got = loop {
            let batch = q.take(Duration::from_millis(50)).expect("open");
            if let Some(first) = batch.into_iter().next() {
                break first;
            }
        };
        assert_eq!(got.1, Ask::Discard { path: "a".into() });
        assert!(q.answer(got.0, Answer { errno: 0, committed: Some("d/".into()) }));
        assert_eq!(asker.join().unwrap(), Answer { errno: 0, committed: Some("d/".into()) });
        assert!(!q.answer(got.0, Answer::failed(0)), "answered twice");

        let q3 = q.clone();
        let waiting = std::thread::spawn(move || q3.ask(Ask::Discard { path: "b".into() }));
        while q.lock().answers.is_empty() {
            std::thread::yield_now();
        }
        q.close();
        assert_eq!(waiting.join().unwrap().errno, libc::EIO);
        assert_eq!(q.ask(Ask::Discard { path: "c".into() }).errno, libc::EIO);
        assert!(q.take(Duration::ZERO).is_none());
    }

    #[test]
    fn the_stamp_probe_answers_for_the_folder_it_is_given() {
        // A folder that cannot be written cannot be vouched for.
        assert!(!fine_grained_times(std::path::Path::new("/proc")));
        let dir = std::env::temp_dir();
        if fine_grained_times(&dir) {
            // Vouched for: a same-size overwrite right after a stat moves the stamp.
            let path = dir.join(format!("spokefs-stamp-{}", std::process::id()));
            let f = File::create(&path).unwrap();
            f.write_all_at(b"abcd", 0).unwrap();
            let before = Stamp::of(&f);
            f.write_all_at(b"wxyz", 0).unwrap();
            assert_ne!(Stamp::of(&f), before);
            std::fs::remove_file(&path).unwrap();
        }
    }

    #[test]
    fn overlay_paths_renames_and_commits() {
        let cols = crate::table::Columns {
            paths: vec!["d/x".into()],
            sizes: vec![1],
            modes: vec![0o644],
            mtimes_ns: vec![0],
            versions: vec!["v".into()],
            dirs: vec!["".into(), "d".into()],
        };
        let table = InodeTable::new(cols, 0).unwrap();
        let mut o = Overlay::new(table.inode_count() + 1);
        let now = SystemTime::now();
        let dir =
            o.add(Node { parent: 2, name: "s".into(), perm: 0o755, mtime: now, kind: Kind::Dir });
        let tmp = std::env::temp_dir().join(format!("spokefs-overlay-{}", std::process::id()));
        let f = Arc::new(File::create(&tmp).unwrap());
        let w = |changes, uploaded| Written {
            staged: tmp.clone(),
            file: Some(f.clone()),
            size: 0,
            changes,
            uploaded,
            at_spoke: true,
            backing: None,
            stamp: None,
        };
        let a = o.add(Node {
            parent: dir,
            name: "a".into(),
            perm: 0o644,
            mtime: now,
            kind: Kind::File(w(2, 2)),
        });
        let b = o.add(Node {
            parent: dir,
            name: "b".into(),
            perm: 0o644,
            mtime: now,
            kind: Kind::File(w(3, 1)),
        });
        assert_eq!(o.path(&table, a).as_deref(), Some("d/s/a"));
        assert_eq!(o.lookup(dir, "a"), Some(a));
        assert_eq!(o.children(dir), vec![a, b]);
        o.rename(a, 1, "top");
        assert_eq!(o.lookup(dir, "a"), None);
        assert_eq!(o.path(&table, a).as_deref(), Some("top"));
        o.rename(a, dir, "a");
        // b has changes not uploaded: it stays staged.
        assert_eq!(o.committed(&table, "d/s/"), vec![tmp.clone()]);
        assert!(matches!(&o.nodes[&b].kind, Kind::File(w) if w.file.is_some()));
        assert!(o.committed(&table, "d/s/").is_empty(), "dropped once");
        std::fs::remove_file(&tmp).unwrap();
    }
}
