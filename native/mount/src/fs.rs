//! The FUSE operations (`fuser::Filesystem`) over an inode table and a reader: what
//! `spokefs.mount.fs.SnapshotFS` does for the Python mount.
//!
//! Metadata is answered on the session thread from the table (nothing crosses the network)
//! and cached by the kernel as long as it likes: day-long entry and attribute timeouts,
//! negative lookups cached, `keep_cache` on open so a file's pages survive close and reopen
//! (a snapshot never changes). Every read goes to the worker pool, which answers it from
//! the spoke's cache files (short circuit) or over HTTP; a read that cannot be answered
//! within the deadline fails with EIO and one log line. Everything that would write
//! answers EROFS.

use std::cell::RefCell;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BsdFileFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use crate::events::{Events, Level};
use crate::latency::{Latency, Op, Timed};
use crate::pool::Pool;
use crate::shortcircuit::{ScRead, ShortCircuit};
use crate::table::{Attr, InodeTable};
use crate::units::{Streams, UnitReader};

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
        self.core.table.attr(ino).map(|a| self.file_attr(&a))
    }
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
            .and_then(|n| self.core.table.lookup(parent.0, n));
        match found.and_then(|ino| self.attr(ino)) {
            Some(a) => reply.entry(&CACHE_TIMEOUT, &a, Generation(0)),
            None => {
                // Inode 0 is a negative entry the kernel caches: a miss is as final as a hit.
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
            Some(a) => reply.attr(&CACHE_TIMEOUT, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _timed = Timed::new(&self.core.latency, Op::Opendir);
        if self.core.table.is_dir(ino.0) {
            reply.opened(FileHandle(ino.0), FopenFlags::empty());
        } else if self.core.table.file_index(ino.0).is_some() {
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
        let t = &self.core.table;
        let Some(kids) = t.children(ino.0) else {
            reply.error(Errno::ENOTDIR);
            return;
        };
        // The offset is the position in the (immutable) child list: resuming is exact.
        for (pos, k) in kids.iter().enumerate().skip(offset as usize) {
            let kind = if t.is_dir(*k) { FileType::Directory } else { FileType::RegularFile };
            if reply.add(INodeNo(*k), pos as u64 + 1, kind, t.name(*k)) {
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
        let t = &self.core.table;
        let Some(kids) = t.children(ino.0) else {
            reply.error(Errno::ENOTDIR);
            return;
        };
        for (pos, k) in kids.iter().enumerate().skip(offset as usize) {
            let Some(a) = self.attr(*k) else { continue };
            if reply.add(INodeNo(*k), pos as u64 + 1, t.name(*k), &CACHE_TIMEOUT, &a, Generation(0))
            {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let t = &self.core.table;
        reply.statfs(t.total_bytes().div_ceil(4096), 0, 0, t.inode_count(), 0, BLKSIZE, 255, 4096);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        if mask.contains(AccessFlags::W_OK) {
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
        if t.file_index(ino.0).is_none() {
            reply.error(if t.is_dir(ino.0) { Errno::EISDIR } else { Errno::ENOENT });
            return;
        }
        if flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0 {
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
            reply.error(Errno::EBADF);
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
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn readlink(&self, _req: &Request, _ino: INodeNo, reply: ReplyData) {
        reply.error(Errno::EINVAL); // no symlinks in a snapshot
    }

    // -- everything that would change the tree: a snapshot is read-only -----------------
    // (the mount is "ro", so the kernel refuses most of these before asking)
    fn setattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.error(Errno::EROFS);
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
        reply.error(Errno::EROFS);
    }

    fn mkdir(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(Errno::EROFS);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        reply.error(Errno::EROFS);
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
        reply.error(Errno::EROFS);
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }
}
