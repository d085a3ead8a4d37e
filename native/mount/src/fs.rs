//! The FUSE operations (`fuser::Filesystem`) over an inode table and a reader: what
//! `spokefs.mount.fs.SnapshotFS` does for the Python mount.
//!
//! Metadata is answered on the session thread from the table (nothing crosses the network)
//! and cached by the kernel as long as it likes: day-long entry and attribute timeouts,
//! negative lookups cached, `keep_cache` on open so a file's pages survive close and reopen
//! (a snapshot never changes). Every read goes to the worker pool, which answers it from
//! the spoke's cache files (short circuit) or over HTTP; a read that cannot be answered
//! within the deadline fails with EIO and one log line. Everything that would change the
//! snapshot answers EROFS; a writable mount (`--writable`, [`crate::writes`]) also lets
//! files be created, written and published, and answers for them here.

use std::cell::RefCell;
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BackingId, BsdFileFlags, Errno, FileAttr, FileHandle, FileType, Filesystem,
    FopenFlags, Generation, INodeNo, InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use crate::events::{Events, Level};
use crate::latency::{Latency, Op, Timed};
use crate::pool::Pool;
use crate::shortcircuit::{ScRead, ShortCircuit};
use crate::table::{Attr, InodeTable};
use crate::units::{Streams, UnitReader};
use crate::writes::{Ask, Kind, Node, Overlay, Stamp, Writes, Written, valid_name};

/// How long the kernel may trust entries and attributes: a snapshot is immutable.
pub const CACHE_TIMEOUT: Duration = Duration::from_secs(86400);
/// st_blksize: the I/O size tools pick; one FUSE request's worth.
pub const BLKSIZE: u32 = 128 * 1024;

/// What the mount counts (read by `Mount::counters`).
#[derive(Default)]
pub struct Counters {
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    pub read_errors: AtomicU64,
    pub lookups: AtomicU64,
    pub sc_reads: AtomicU64,
    pub http_reads: AtomicU64,
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub uploads: AtomicU64,
    pub upload_errors: AtomicU64,
    /// Files created in kernel passthrough (their writes are not counted above).
    pub passthrough_files: AtomicU64,
}

/// Everything a read needs, shared by the session thread and the workers.
pub struct Core {
    pub table: Arc<InodeTable>,
    pub units: Arc<UnitReader>,
    pub sc: Option<Arc<ShortCircuit>>,
    pub pool: Arc<Pool>,
    pub events: Arc<Events>,
    pub counters: Counters,
    pub latency: Latency,
    pub perms: Perms,
    /// Set on a writable mount.
    pub writes: Option<Arc<Writes>>,
}

/// What stat shows as every inode's owner and permission bits (`--uid`, `--gid`,
/// `--file-mode`, `--dir-mode`); with `default_permissions` the kernel checks access
/// against them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Perms {
    pub uid: u32,
    pub gid: u32,
    /// Every file's permission bits; None: each file's own from the manifest.
    pub file_mode: Option<u16>,
    /// Every directory's permission bits.
    pub dir_mode: u16,
}

impl Perms {
    /// The bits stat shows for an inode whose table attributes are `a`.
    pub fn perm(&self, a: &Attr) -> u16 {
        match (a.is_dir, self.file_mode) {
            (true, _) => self.dir_mode,
            (false, Some(m)) => m,
            (false, None) => a.perm,
        }
    }
}

pub struct SnapshotFs {
    core: Arc<Core>,
    streams: Mutex<Streams>,
    ready: Mutex<Option<SyncSender<Result<(), String>>>>,
}

thread_local! {
    /// Each worker's read buffer, reused: no allocation (and page faults) per read.
    static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn time_of(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

impl SnapshotFs {
    pub fn new(core: Arc<Core>, ready: SyncSender<Result<(), String>>) -> SnapshotFs {
        SnapshotFs { core, streams: Mutex::new(Streams::default()), ready: Mutex::new(Some(ready)) }
    }

    fn file_attr(&self, a: &Attr) -> FileAttr {
        let t = time_of(a.mtime_ns);
        FileAttr {
            ino: INodeNo(a.ino),
            size: a.size,
            blocks: a.size.div_ceil(512),
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            kind: if a.is_dir { FileType::Directory } else { FileType::RegularFile },
            perm: self.core.perms.perm(a),
            // 1 for folders too: find/fts read it as "subdirectory count unknown".
            nlink: 1,
            uid: self.core.perms.uid,
            gid: self.core.perms.gid,
            rdev: 0,
            blksize: BLKSIZE,
            flags: 0,
        }
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        if let Some(a) = self.core.table.attr(ino) {
            return Some(self.file_attr(&a));
        }
        let w = self.core.writes.as_ref()?;
        w.lock().nodes.get(&ino).map(|n| self.node_attr(ino, n))
    }

    /// How long the kernel may keep an inode's entry and attributes: a day for the
    /// snapshot's, none for what this mount writes (its size changes).
    fn ttl(&self, ino: u64) -> Duration {
        if ino <= self.core.table.inode_count() { CACHE_TIMEOUT } else { Duration::ZERO }
    }

    fn node_attr(&self, ino: u64, n: &Node) -> FileAttr {
        let (kind, size, mtime) = match &n.kind {
            Kind::Dir => (FileType::Directory, 0, n.mtime),
            // In passthrough the kernel writes the staging file: its size and mtime are the
            // file's (this mount never saw the writes).
            Kind::File(w) => match w.file.as_ref().filter(|_| w.backing.is_some()) {
                Some(f) => match f.metadata() {
                    Ok(m) => (FileType::RegularFile, m.len(), m.modified().unwrap_or(n.mtime)),
                    Err(_) => (FileType::RegularFile, w.size, n.mtime),
                },
                None => (FileType::RegularFile, w.size, n.mtime),
            },
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind,
            perm: n.perm,
            nlink: 1,
            uid: self.core.perms.uid,
            gid: self.core.perms.gid,
            rdev: 0,
            blksize: BLKSIZE,
            flags: 0,
        }
    }

    /// A folder of the snapshot or of this mount.
    fn is_dir(&self, ino: u64) -> bool {
        self.core.table.is_dir(ino)
            || self.core.writes.as_ref().is_some_and(|w| w.lock().is_dir(ino))
    }

    /// A name this mount may create in folder `parent`: Ok(the writable state), or the
    /// errno to answer.
    fn creatable(&self, parent: u64, name: &OsStr) -> Result<(&Arc<Writes>, String), Errno> {
        let w = self.core.writes.as_ref().ok_or(Errno::EROFS)?;
        let name = std::str::from_utf8(name.as_bytes()).map_err(|_| Errno::EINVAL)?;
        if !valid_name(name) {
            return Err(Errno::EINVAL);
        }
        if !self.is_dir(parent) {
            return Err(Errno::ENOTDIR);
        }
        if self.core.table.lookup(parent, name).is_some() || w.lock().lookup(parent, name).is_some()
        {
            return Err(Errno::EEXIST);
        }
        Ok((w, name.to_owned()))
    }

    /// A new staging file registered with the kernel for passthrough, where it is on; the
    /// first refusal (no CAP_SYS_ADMIN) turns it off for the mount, with one log line.
    fn backing(&self, w: &Writes, f: &File, reply: &ReplyCreate) -> Option<Arc<BackingId>> {
        if !w.passthrough() {
            return None;
        }
        match reply.open_backing(f) {
            Ok(b) => {
                self.core.counters.passthrough_files.fetch_add(1, Ordering::Relaxed);
                Some(Arc::new(b))
            }
            Err(e) => {
                if w.passthrough.swap(false, Ordering::Relaxed) {
                    self.core.events.log(
                        Level::Warning,
                        format!(
                            "writes go through the mount: the kernel refused passthrough \
                                 ({e}; it needs CAP_SYS_ADMIN)"
                        ),
                    );
                }
                None
            }
        }
    }

    /// The inode this mount made named `name` in `parent`.
    fn made(&self, parent: u64, name: &OsStr) -> Option<u64> {
        let w = self.core.writes.as_ref()?;
        let name = std::str::from_utf8(name.as_bytes()).ok()?;
        w.lock().lookup(parent, name)
    }
}

/// Upload a written file if it has changes the spoke does not hold (a close or an fsync);
/// runs on a writer thread, and answers once the spoke holds them durably.
fn upload(core: &Core, w: &Writes, ino: u64) -> Result<(), Errno> {
    let (path, staged, mark) = {
        let o = w.lock();
        let Some(Node { kind: Kind::File(f), .. }) = o.nodes.get(&ino) else {
            return Ok(()); // unlinked meanwhile
        };
        if !f.dirty() || f.file.is_none() {
            return Ok(());
        }
        (o.path(&core.table, ino).ok_or(Errno::ENOENT)?, f.staged.clone(), f.mark())
    };
    let answer = w.queue.ask(Ask::Put { path, staged });
    if answer.errno != 0 {
        core.counters.upload_errors.fetch_add(1, Ordering::Relaxed);
        return Err(Errno::from_i32(answer.errno));
    }
    core.counters.uploads.fetch_add(1, Ordering::Relaxed);
    uploaded(&core.table, &mut w.lock(), ino, mark, answer.committed);
    Ok(())
}

/// After Python uploaded `ino` as it was at `mark` (its first changes, its staging file's
/// stamp: `Written::mark`, taken before the upload began): the spoke holds them, and a
/// folder it committed with them loses its staging copies.
fn uploaded(
    table: &InodeTable,
    o: &mut Overlay,
    ino: u64,
    (changes, stamp): (u64, Option<Stamp>),
    committed: Option<String>,
) {
    if let Some(Node { kind: Kind::File(f), .. }) = o.nodes.get_mut(&ino) {
        f.uploaded = f.uploaded.max(changes);
        if stamp.is_some() {
            f.stamp = stamp;
        }
        f.at_spoke = true;
    }
    if let Some(prefix) = committed {
        for staged in o.committed(table, &prefix) {
            let _ = std::fs::remove_file(staged);
        }
    }
}

/// What this mount made at an inode.
enum Staged {
    /// Its staging file, and the backing id its opens answer with (passthrough).
    File(Arc<File>, Option<Arc<BackingId>>),
    Dir,
    /// A file published at the hub: its staging copy is gone, and it lives in a newer
    /// snapshot than this mount's.
    Published,
}

fn staged_file(w: &Writes, ino: u64) -> Option<Staged> {
    Some(match &w.lock().nodes.get(&ino)?.kind {
        Kind::Dir => Staged::Dir,
        Kind::File(f) => match &f.file {
            Some(file) => Staged::File(file.clone(), f.backing.clone()),
            None => Staged::Published,
        },
    })
}

fn io_errno(e: &std::io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

/// Answer one read on a worker thread; `t0`: when the request came (its time in the pool's
/// queue counts: it is the reader's wait).
fn serve_read(
    core: &Core,
    index: usize,
    start: u64,
    end: u64,
    streaming: bool,
    t0: Instant,
    reply: ReplyData,
) {
    let (size, vid, version) = core.table.file(index);
    let len = (end - start) as usize;
    BUF.with(|b| {
        let mut b = b.borrow_mut();
        if b.len() < len {
            b.resize(len, 0);
        }
        let out = &mut b[..len];
        let mut result = None;
        if let Some(sc) = &core.sc {
            match sc.read(vid, start, out) {
                ScRead::Done(n) => {
                    core.counters.sc_reads.fetch_add(1, Ordering::Relaxed);
                    result = Some(Ok(n));
                }
                ScRead::Fail(why) => result = Some(Err(why)),
                ScRead::Http => {}
            }
        }
        let result = result.unwrap_or_else(|| {
            core.counters.http_reads.fetch_add(1, Ordering::Relaxed);
            core.units.read(&core.pool, vid, version, size, start, out, streaming)
        });
        match result {
            Ok(n) => {
                core.counters.reads.fetch_add(1, Ordering::Relaxed);
                core.counters.read_bytes.fetch_add(n as u64, Ordering::Relaxed);
                reply.data(&out[..n]);
            }
            Err(why) => {
                core.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                let path = core.table.path(core.table.file_inode(index)).unwrap_or("?");
                core.events.log(
                    Level::Error,
                    format!("read of '{path}' [{start}, {end}) failed, answering EIO: {why}"),
                );
                reply.error(Errno::EIO);
            }
        }
    });
    core.latency.record(Op::Read, t0);
}

impl SnapshotFs {
    /// Folder `ino`'s children as (inode, is a folder, name): the snapshot's, then what
    /// this mount made; None when `ino` is not a folder.
    fn listing(&self, ino: u64) -> Option<Vec<(u64, bool, String)>> {
        let t = &self.core.table;
        let mut out: Vec<(u64, bool, String)> = match t.children(ino) {
            Some(kids) => kids.iter().map(|k| (*k, t.is_dir(*k), t.name(*k).to_owned())).collect(),
            None if self.is_dir(ino) => Vec::new(),
            None => return None,
        };
        if let Some(w) = &self.core.writes {
            let o = w.lock();
            for k in o.children(ino) {
                let n = &o.nodes[&k];
                out.push((k, matches!(n.kind, Kind::Dir), n.name.clone()));
            }
        }
        Some(out)
    }

    /// A close or fsync: uploads what this mount wrote to the file and the spoke does not
    /// hold yet, on a writer thread; answered once the spoke holds it durably.
    fn sync(&self, ino: u64, reply: ReplyEmpty) {
        let Some(w) = self.core.writes.clone().filter(|_| ino > self.core.table.inode_count())
        else {
            reply.ok();
            return;
        };
        let dirty = matches!(w.lock().nodes.get(&ino),
                             Some(Node { kind: Kind::File(f), .. }) if f.dirty() && f.file.is_some());
        if !dirty {
            reply.ok();
            return;
        }
        let core = self.core.clone();
        let w2 = w.clone();
        w.pool.submit(move || match upload(&core, &w2, ino) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        });
    }
}

impl Filesystem for SnapshotFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Readahead and parallel reads: the kernel may keep this many requests in flight
        // in the background (readahead of several files at once).
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        // ls -l and find get attributes with the listing, not one lookup per entry.
        let _ = config
            .add_capabilities(InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        if let Some(w) = &self.core.writes
            && w.passthrough()
        {
            // Depth 1: the staging files sit on a plain filesystem, not another stack.
            let granted = config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH)
                && config.set_max_stack_depth(1).is_ok()
                && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok();
            w.passthrough.store(granted, Ordering::Relaxed);
            self.core.events.log(
                Level::Info,
                if granted {
                    "writes: the kernel writes new files to their staging files itself \
                     (FUSE passthrough)"
                } else {
                    "writes go through the mount: the kernel offers no FUSE passthrough"
                },
            );
        }
        if let Some(tx) = self.ready.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(Ok(()));
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _timed = Timed::new(&self.core.latency, Op::Lookup);
        self.core.counters.lookups.fetch_add(1, Ordering::Relaxed);
        let found = std::str::from_utf8(name.as_bytes())
            .ok()
            .and_then(|n| self.core.table.lookup(parent.0, n))
            .or_else(|| self.made(parent.0, name));
        match found.and_then(|ino| self.attr(ino)) {
            Some(a) => reply.entry(&self.ttl(a.ino.0), &a, Generation(0)),
            None => {
                // Inode 0 is a negative entry the kernel caches: a miss is as final as a hit
                // (what this mount creates goes through the kernel, which forgets the entry).
                let mut a =
                    self.file_attr(&Attr { ino: 0, is_dir: false, perm: 0, size: 0, mtime_ns: 0 });
                a.ino = INodeNo(0);
                reply.entry(&CACHE_TIMEOUT, &a, Generation(0));
            }
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _timed = Timed::new(&self.core.latency, Op::Getattr);
        match self.attr(ino.0) {
            Some(a) => reply.attr(&self.ttl(ino.0), &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _timed = Timed::new(&self.core.latency, Op::Opendir);
        if self.is_dir(ino.0) {
            reply.opened(FileHandle(ino.0), FopenFlags::empty());
        } else if self.attr(ino.0).is_some() {
            reply.error(Errno::ENOTDIR);
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let _timed = Timed::new(&self.core.latency, Op::Readdir);
        let Some(kids) = self.listing(ino.0) else {
            reply.error(Errno::ENOTDIR);
            return;
        };
        // The offset is the position in the child list (the snapshot's first, then what
        // this mount made, by inode): resuming is exact unless a file went meanwhile.
        for (pos, (k, is_dir, name)) in kids.iter().enumerate().skip(offset as usize) {
            let kind = if *is_dir { FileType::Directory } else { FileType::RegularFile };
            if reply.add(INodeNo(*k), pos as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let _timed = Timed::new(&self.core.latency, Op::Readdir);
        let Some(kids) = self.listing(ino.0) else {
            reply.error(Errno::ENOTDIR);
            return;
        };
        for (pos, (k, _, name)) in kids.iter().enumerate().skip(offset as usize) {
            let Some(a) = self.attr(*k) else { continue };
            if reply.add(INodeNo(*k), pos as u64 + 1, name, &self.ttl(*k), &a, Generation(0)) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let t = &self.core.table;
        reply.statfs(t.total_bytes().div_ceil(4096), 0, 0, t.inode_count(), 0, BLKSIZE, 255, 4096);
    }

    fn access(&self, _req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        let writable = self.core.writes.as_ref().is_some_and(|w| {
            // New files go into any folder; a file this mount made, until it is published.
            self.core.table.is_dir(ino.0)
                || matches!(staged_file(w, ino.0), Some(Staged::File(..) | Staged::Dir))
        });
        if mask.contains(AccessFlags::W_OK) && !writable {
            reply.error(Errno::EROFS);
        } else {
            reply.ok();
        }
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        reply.error(Errno::NO_XATTR);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: ReplyXattr) {
        if size == 0 { reply.size(0) } else { reply.data(&[]) }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _timed = Timed::new(&self.core.latency, Op::Open);
        let t = &self.core.table;
        let writing = flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0;
        if t.file_index(ino.0).is_none() {
            if let Some(w) = &self.core.writes {
                match staged_file(w, ino.0) {
                    Some(Staged::File(f, backing)) => {
                        if flags.0 & libc::O_TRUNC != 0 && writing {
                            if let Err(e) = f.set_len(0) {
                                reply.error(io_errno(&e));
                                return;
                            }
                            if let Some(Node { kind: Kind::File(wf), mtime, .. }) =
                                w.lock().nodes.get_mut(&ino.0)
                            {
                                wf.size = 0;
                                wf.changes += 1;
                                *mtime = SystemTime::now();
                            }
                        }
                        match backing {
                            Some(b) => {
                                reply.opened_passthrough(FileHandle(ino.0), FopenFlags::empty(), &b)
                            }
                            None => reply.opened(FileHandle(ino.0), FopenFlags::empty()),
                        }
                        return;
                    }
                    Some(Staged::Published) if writing => {
                        reply.error(Errno::EROFS); // published: it no longer changes
                        return;
                    }
                    Some(Staged::Published) => {
                        // Published; opening works (stat, fstat), reads answer ESTALE.
                        // Direct I/O: the kernel takes it beside files of the inode still
                        // open in passthrough, where a cached open would fail with EIO.
                        reply.opened(FileHandle(ino.0), FopenFlags::FOPEN_DIRECT_IO);
                        return;
                    }
                    Some(Staged::Dir) | None => {}
                }
            }
            reply.error(if t.is_dir(ino.0) { Errno::EISDIR } else { Errno::ENOENT });
            return;
        }
        if writing {
            reply.error(Errno::EROFS);
            return;
        }
        // keep_cache: pages read once stay valid across opens (the bytes never change).
        reply.opened(FileHandle(ino.0), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let t0 = Instant::now();
        let t = &self.core.table;
        let Some(index) = t.file_index(ino.0) else {
            match self.core.writes.as_ref().and_then(|w| staged_file(w, ino.0)) {
                Some(Staged::File(f, _)) => {
                    let core = self.core.clone();
                    self.core.pool.submit(move || {
                        let mut buf = vec![0u8; size as usize];
                        match f.read_at(&mut buf, offset) {
                            Ok(n) => reply.data(&buf[..n]),
                            Err(e) => reply.error(io_errno(&e)),
                        }
                        core.latency.record(Op::Read, t0);
                    });
                }
                Some(Staged::Published) => reply.error(Errno::ESTALE),
                Some(Staged::Dir) => reply.error(Errno::EISDIR),
                None => reply.error(Errno::EBADF),
            }
            self.core.latency.record(Op::Read, t0);
            return;
        };
        let (file_size, vid, _) = t.file(index);
        if offset >= file_size || size == 0 {
            reply.data(&[]);
            self.core.latency.record(Op::Read, t0);
            return;
        }
        let end = (offset + size as u64).min(file_size);
        let streaming =
            self.streams.lock().unwrap_or_else(|e| e.into_inner()).observe(vid, offset, end);
        let core = self.core.clone();
        self.core.pool.submit(move || serve_read(&core, index, offset, end, streaming, t0, reply));
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        self.sync(ino.0, reply);
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.sync(ino.0, reply);
    }

    fn readlink(&self, _req: &Request, _ino: INodeNo, reply: ReplyData) {
        reply.error(Errno::EINVAL); // no symlinks in a snapshot
    }

    // -- what changes the tree: the snapshot is read-only; a writable mount changes only
    // what it made (the snapshot's part is "ro" to the kernel unless --writable)
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(w) = self.core.writes.as_ref().filter(|_| ino.0 > self.core.table.inode_count())
        else {
            reply.error(Errno::EROFS);
            return;
        };
        let file = match staged_file(w, ino.0) {
            Some(Staged::File(f, _)) => Some(f),
            Some(Staged::Dir) => None,
            Some(Staged::Published) => {
                reply.error(Errno::EROFS);
                return;
            }
            None => {
                reply.error(Errno::ENOENT);
                return;
            }
        };
        if let (Some(n), Some(f)) = (size, &file)
            && let Err(e) = f.set_len(n)
        {
            reply.error(io_errno(&e));
            return;
        }
        let mut o = w.lock();
        let Some(node) = o.nodes.get_mut(&ino.0) else {
            reply.error(Errno::ENOENT);
            return;
        };
        if let Some(m) = mode {
            node.perm = (m & 0o7777) as u16;
        }
        match mtime {
            Some(TimeOrNow::SpecificTime(t)) => node.mtime = t,
            Some(TimeOrNow::Now) => node.mtime = SystemTime::now(),
            None => {}
        }
        if let (Some(n), Kind::File(f)) = (size, &mut node.kind) {
            f.size = n;
            f.changes += 1;
            node.mtime = SystemTime::now();
        }
        let a = self.node_attr(ino.0, node);
        drop(o);
        reply.attr(&Duration::ZERO, &a);
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(if self.core.writes.is_some() { Errno::EPERM } else { Errno::EROFS });
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        match self.creatable(parent.0, name) {
            Ok((w, name)) => {
                let node = Node {
                    parent: parent.0,
                    name,
                    perm: (mode & !umask & 0o7777) as u16,
                    mtime: SystemTime::now(),
                    kind: Kind::Dir,
                };
                let mut o = w.lock();
                let a = self.node_attr(0, &node);
                let ino = o.add(node);
                drop(o);
                reply.entry(&Duration::ZERO, &FileAttr { ino: INodeNo(ino), ..a }, Generation(0));
            }
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (Some(w), Some(ino)) = (self.core.writes.clone(), self.made(parent.0, name)) else {
            reply.error(Errno::EROFS);
            return;
        };
        let (path, at_spoke) = {
            let o = w.lock();
            match o.nodes.get(&ino) {
                Some(Node { kind: Kind::File(f), .. }) if f.file.is_some() => {
                    (o.path(&self.core.table, ino), f.at_spoke)
                }
                Some(Node { kind: Kind::File(_), .. }) => {
                    drop(o);
                    reply.error(Errno::EROFS); // published
                    return;
                }
                _ => {
                    drop(o);
                    reply.error(Errno::EISDIR);
                    return;
                }
            }
        };
        let core = self.core.clone();
        let w2 = w.clone();
        w.pool.submit(move || {
            if at_spoke && let Some(path) = path {
                let answer = w2.queue.ask(Ask::Discard { path });
                if answer.errno != 0 {
                    core.counters.upload_errors.fetch_add(1, Ordering::Relaxed);
                    reply.error(Errno::from_i32(answer.errno));
                    return;
                }
            }
            if let Some(Node { kind: Kind::File(f), .. }) = w2.lock().remove(ino) {
                let _ = std::fs::remove_file(&f.staged);
            }
            reply.ok();
        });
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (Some(w), Some(ino)) = (self.core.writes.as_ref(), self.made(parent.0, name)) else {
            reply.error(Errno::EROFS);
            return;
        };
        let mut o = w.lock();
        if !o.is_dir(ino) {
            drop(o);
            reply.error(Errno::ENOTDIR);
        } else if !o.children(ino).is_empty() {
            drop(o);
            reply.error(Errno::ENOTEMPTY);
        } else {
            o.remove(ino);
            drop(o);
            reply.ok();
        }
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(if self.core.writes.is_some() { Errno::EPERM } else { Errno::EROFS });
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let (Some(w), Some(ino)) = (self.core.writes.clone(), self.made(parent.0, name)) else {
            reply.error(Errno::EROFS);
            return;
        };
        if flags.contains(RenameFlags::RENAME_EXCHANGE) {
            reply.error(Errno::EINVAL);
            return;
        }
        let Some(to_name) = std::str::from_utf8(newname.as_bytes()).ok().filter(|n| valid_name(n))
        else {
            reply.error(Errno::EINVAL);
            return;
        };
        if !self.is_dir(newparent.0) {
            reply.error(Errno::ENOTDIR);
            return;
        }
        if self.core.table.lookup(newparent.0, to_name).is_some() {
            reply.error(Errno::EEXIST); // the snapshot's files are never replaced
            return;
        }
        let replaced = self.made(newparent.0, newname).filter(|r| *r != ino);
        if replaced.is_some() && flags.contains(RenameFlags::RENAME_NOREPLACE) {
            reply.error(Errno::EEXIST);
            return;
        }
        let (op, mark) = {
            let o = w.lock();
            let tbl = &self.core.table;
            let target = |p: Option<String>| match p {
                Some(h) if h.is_empty() => to_name.to_owned(),
                Some(h) => format!("{h}/{to_name}"),
                None => to_name.to_owned(),
            };
            match o.nodes.get(&ino) {
                Some(Node { kind: Kind::File(f), .. }) if f.file.is_some() => (
                    Ask::Rename {
                        from: o.path(tbl, ino).unwrap_or_default(),
                        to: target(o.path(tbl, newparent.0)),
                        staged: f.staged.clone(),
                        uploaded: f.at_spoke,
                    },
                    f.mark(),
                ),
                Some(Node { kind: Kind::File(_), .. }) => {
                    drop(o);
                    reply.error(Errno::EROFS); // published
                    return;
                }
                // A folder this mount made: mv falls back to copying its files.
                _ => {
                    drop(o);
                    reply.error(Errno::EXDEV);
                    return;
                }
            }
        };
        let core = self.core.clone();
        let w2 = w.clone();
        let to_name = to_name.to_owned();
        w.pool.submit(move || {
            let answer = w2.queue.ask(op);
            if answer.errno != 0 {
                core.counters.upload_errors.fetch_add(1, Ordering::Relaxed);
                reply.error(Errno::from_i32(answer.errno));
                return;
            }
            core.counters.uploads.fetch_add(1, Ordering::Relaxed);
            let mut o = w2.lock();
            if let Some(r) = replaced
                && let Some(Node { kind: Kind::File(f), .. }) = o.remove(r)
            {
                let _ = std::fs::remove_file(&f.staged);
            }
            o.rename(ino, newparent.0, &to_name);
            uploaded(&core.table, &mut o, ino, mark, answer.committed);
            drop(o);
            reply.ok();
        });
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(if self.core.writes.is_some() { Errno::EPERM } else { Errno::EROFS });
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let (w, name) = match self.creatable(parent.0, name) {
            Ok(v) => v,
            Err(e) => {
                reply.error(e);
                return;
            }
        };
        let mut o = w.lock();
        let node = Node {
            parent: parent.0,
            name,
            perm: (mode & !umask & 0o7777) as u16,
            mtime: SystemTime::now(),
            kind: Kind::Dir, // becomes the file below, once its staging file exists
        };
        let ino = o.add(node);
        let staged = w.staged_path(ino);
        let made = File::options().read(true).write(true).create_new(true).open(&staged);
        match made {
            Ok(f) => {
                let backing = self.backing(w, &f, &reply);
                let node = o.nodes.get_mut(&ino).expect("just added");
                node.kind = Kind::File(Written {
                    staged,
                    file: Some(Arc::new(f)),
                    size: 0,
                    changes: 1, // even an empty file is uploaded at its close
                    uploaded: 0,
                    at_spoke: false,
                    backing: backing.clone(),
                    stamp: None,
                });
                let a = self.node_attr(ino, node);
                drop(o);
                let (ttl, fh, flags) = (Duration::ZERO, FileHandle(ino), FopenFlags::empty());
                match backing {
                    Some(b) => reply.created_passthrough(&ttl, &a, Generation(0), fh, flags, &b),
                    None => reply.created(&ttl, &a, Generation(0), fh, flags),
                }
            }
            Err(e) => {
                o.remove(ino);
                drop(o);
                self.core.events.log(
                    Level::Error,
                    format!("cannot stage a new file in {}: {e}", w.staging.display()),
                );
                reply.error(io_errno(&e));
            }
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(w) = &self.core.writes else {
            reply.error(Errno::EROFS);
            return;
        };
        let f = match staged_file(w, ino.0) {
            Some(Staged::File(f, _)) => f,
            Some(Staged::Dir) => {
                reply.error(Errno::EISDIR);
                return;
            }
            Some(Staged::Published) | None => {
                reply.error(Errno::EROFS);
                return;
            }
        };
        // On the session thread: a pwrite into the page cache costs about what handing the
        // bytes to another thread would (a copy).
        if let Err(e) = f.write_all_at(data, offset) {
            reply.error(io_errno(&e));
            return;
        }
        if let Some(Node { kind: Kind::File(wf), mtime, .. }) = w.lock().nodes.get_mut(&ino.0) {
            wf.size = wf.size.max(offset + data.len() as u64);
            wf.changes += 1;
            *mtime = SystemTime::now();
        }
        self.core.counters.writes.fetch_add(1, Ordering::Relaxed);
        self.core.counters.write_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        reply.written(data.len() as u32);
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        reply.error(if self.core.writes.is_some() { Errno::ENOTSUP } else { Errno::EROFS });
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(if self.core.writes.is_some() { Errno::ENOTSUP } else { Errno::EROFS });
    }
}
