//! One mount's life: built from the manifest's columns and the settings Python resolved
//! (`Mount::new`), mounted (`start`: returns once the kernel has initialised the
//! session), waited on (`wait`: true once unmounted), unmounted (`unmount`: a lazy detach,
//! as `spokefs umount` does), and closed (`close`: the last reads reported).
//!
//! The session runs `fuser::mount2` on its own thread: one session thread answers metadata
//! from the table and hands every read to the worker pool. When the mount goes away (this
//! process's `unmount`, `spokefs umount`, `fusermount3 -u`), the kernel ends the session
//! once no file is open and the thread finishes; `wait` returns true as soon as the detach
//! is done either way, so the owner can exit (which ends a session still held by open
//! files: they then see ENOTCONN, as with the Python mount).

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{RecvTimeoutError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fuser::{MountOption, SessionACL};

use crate::events::{Events, Level};
use crate::fs::{Core, Counters, Perms, SnapshotFs};
use crate::http::{Upstream, UpstreamConfig};
use crate::latency::{Latency, OpSnapshot};
use crate::pool::Pool;
use crate::shortcircuit::{ScConfig, ShortCircuit};
use crate::sysmount::SysMount;
use crate::table::{Columns, InodeTable, TableError};
use crate::units::{DEFAULT_CAPACITY, PREFETCH, UnitReader};
use crate::writes::{Answer, Ask, Writes, fine_grained_times};

/// Writer threads of a writable mount: closes and fsyncs waiting for their uploads at once.
const WRITE_THREADS: usize = 16;

/// Everything the mount needs besides the manifest's columns.
#[derive(Debug, Clone)]
pub struct MountConfig {
    pub mountpoint: PathBuf,
    pub block_size: u64,
    pub dataset: String,
    /// The pinned snapshot id (never "latest": Python resolved it).
    pub snapshot: String,
    /// http://HOST:PORT of the spoke or hub (https is not supported natively yet).
    pub base_url: String,
    pub token: Option<String>,
    pub deadline: Duration,
    /// Mount options as libfuse spells them: ro, nosuid, nodev, default_permissions,
    /// allow_other, fsname=..., subtype=...
    pub options: Vec<String>,
    /// The mount's owner (the kernel lets only this user in without allow_other).
    pub uid: u32,
    pub gid: u32,
    /// What stat shows as owner and permission bits; None: the owner above, each file's
    /// mode from the manifest, directories 0o555.
    pub file_uid: Option<u32>,
    pub file_gid: Option<u32>,
    pub file_mode: Option<u32>,
    pub dir_mode: Option<u32>,
    /// What directories show as their times.
    pub created_ns: i64,
    pub short_circuit: Option<ScConfig>,
    /// Threads that answer reads.
    pub workers: usize,
    /// HTTP connections kept alive to the upstream.
    pub connections: usize,
    /// Bytes of fetch units held for streaming reads over HTTP.
    pub unit_capacity: u64,
    /// Set: a writable mount, its new files staged in this folder (which must exist).
    pub staging: Option<PathBuf>,
    /// New files in kernel passthrough where the kernel and the staging folder allow it
    /// (`crate::writes`); false: every write goes through this process.
    pub write_passthrough: bool,
}

impl MountConfig {
    pub fn new(
        mountpoint: impl Into<PathBuf>,
        base_url: &str,
        dataset: &str,
        snapshot: &str,
        block_size: u64,
    ) -> MountConfig {
        MountConfig {
            mountpoint: mountpoint.into(),
            block_size,
            dataset: dataset.into(),
            snapshot: snapshot.into(),
            base_url: base_url.into(),
            token: None,
            deadline: Duration::from_secs(30),
            options: [
                "ro",
                "nosuid",
                "nodev",
                "default_permissions",
                "fsname=spokefs",
                "subtype=spokefs",
            ]
            .map(String::from)
            .to_vec(),
            uid: 0,
            gid: 0,
            file_uid: None,
            file_gid: None,
            file_mode: None,
            dir_mode: None,
            created_ns: 0,
            short_circuit: None,
            workers: 32,
            connections: 32,
            unit_capacity: DEFAULT_CAPACITY,
            staging: None,
            write_passthrough: false,
        }
    }
}

/// Why a mount could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountError {
    /// The settings or columns are wrong (Python's ConfigError).
    Config(String),
    /// The kernel or the session refused (no /dev/fuse, a busy mountpoint, ...).
    Mount(String),
}

impl std::fmt::Display for MountError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MountError::Config(m) | MountError::Mount(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for MountError {}

impl From<TableError> for MountError {
    fn from(e: TableError) -> Self {
        MountError::Config(format!("cannot mount this manifest: {e}"))
    }
}

/// Map libfuse-style option names onto fuser's (and the ACL `allow_other` sets).
pub fn parse_options(options: &[String]) -> Result<(Vec<MountOption>, SessionACL), MountError> {
    let mut out = Vec::new();
    let mut acl = SessionACL::Owner;
    for o in options {
        let opt = match o.as_str() {
            "ro" => MountOption::RO,
            "nosuid" => MountOption::NoSuid,
            "nodev" => MountOption::NoDev,
            "noexec" => MountOption::NoExec,
            "noatime" => MountOption::NoAtime,
            "default_permissions" => MountOption::DefaultPermissions,
            "allow_other" => {
                acl = SessionACL::All;
                continue;
            }
            "allow_root" => {
                acl = SessionACL::RootAndOwner;
                continue;
            }
            x if x.starts_with("fsname=") => MountOption::FSName(x["fsname=".len()..].into()),
            x if x.starts_with("subtype=") => MountOption::Subtype(x["subtype=".len()..].into()),
            x => {
                return Err(MountError::Config(format!(
                    "mount option {x:?} is not one the native mount knows"
                )));
            }
        };
        out.push(opt);
    }
    Ok((out, acl))
}

/// The owner and permission bits stat shows, from the settings; a mode beyond 0o777 (a
/// setuid, setgid or sticky bit, or not a mode at all) is refused.
pub fn perms_of(cfg: &MountConfig) -> Result<Perms, MountError> {
    let mode = |what: &str, m: Option<u32>| -> Result<Option<u16>, MountError> {
        match m {
            Some(m) if m > 0o777 => {
                Err(MountError::Config(format!("{what} {m:#o}: permission bits only (0 to 0o777)")))
            }
            Some(m) => Ok(Some(m as u16)),
            None => Ok(None),
        }
    };
    Ok(Perms {
        uid: cfg.file_uid.unwrap_or(cfg.uid),
        gid: cfg.file_gid.unwrap_or(cfg.gid),
        file_mode: mode("file mode", cfg.file_mode)?,
        dir_mode: mode("dir mode", cfg.dir_mode)?.unwrap_or(0o555),
    })
}

pub struct Mount {
    cfg: MountConfig,
    core: Arc<Core>,
    events: Arc<Events>,
    started: AtomicBool,
    unmounted: AtomicBool,
    closed: AtomicBool,
    session: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Mount {
    /// Build the table and the readers (nothing is mounted yet).
    pub fn new(cfg: MountConfig, cols: Columns) -> Result<Mount, MountError> {
        if !cfg.base_url.starts_with("http://") {
            return Err(MountError::Config(format!(
                "the native mount reads plain http only, not {:?} (use --engine python)",
                cfg.base_url
            )));
        }
        if cfg.block_size == 0 {
            return Err(MountError::Config("block size must be positive".into()));
        }
        if cfg.deadline.is_zero() {
            return Err(MountError::Config("the deadline must be positive".into()));
        }
        parse_options(&cfg.options)?;
        let perms = perms_of(&cfg)?;
        let table = Arc::new(InodeTable::new(cols, cfg.created_ns)?);
        let events = Arc::new(Events::default());
        let up = Arc::new(Upstream::new(UpstreamConfig {
            base: cfg.base_url.clone(),
            dataset: cfg.dataset.clone(),
            snapshot: cfg.snapshot.clone(),
            token: cfg.token.clone(),
            deadline: cfg.deadline,
            connections: cfg.connections,
        }));
        let pool = Arc::new(
            Pool::new(cfg.workers.max(1), "spokefs-read")
                .map_err(|e| MountError::Mount(format!("cannot start the read threads: {e}")))?,
        );
        let units =
            Arc::new(UnitReader::new(up.clone(), cfg.block_size, cfg.unit_capacity, PREFETCH));
        let sc = cfg.short_circuit.clone().map(|c| {
            ShortCircuit::new(up.clone(), c, table.clone(), events.clone(), cfg.block_size)
        });
        let writes = match &cfg.staging {
            Some(dir) if !dir.is_dir() => {
                return Err(MountError::Config(format!(
                    "the staging folder {} is not a folder",
                    dir.display()
                )));
            }
            // One thread per close or fsync waiting for its upload: ranks save at once.
            Some(dir) => {
                let passthrough = cfg.write_passthrough && {
                    let fine = fine_grained_times(dir);
                    if !fine {
                        events.log(
                            Level::Info,
                            format!(
                                "writes go through the mount: {} does not give every \
                                     write a new ctime (no multigrain timestamps: Linux \
                                     6.13 or later, ext4, xfs, btrfs or tmpfs)",
                                dir.display()
                            ),
                        );
                    }
                    fine
                };
                let first = table.inode_count() + 1;
                Some(Arc::new(
                    Writes::new(dir.clone(), first, WRITE_THREADS, passthrough).map_err(|e| {
                        MountError::Mount(format!("cannot start the write threads: {e}"))
                    })?,
                ))
            }
            None => None,
        };
        let core = Arc::new(Core {
            table,
            units,
            sc,
            pool,
            events: events.clone(),
            counters: Counters::default(),
            latency: Latency::default(),
            perms,
            writes,
        });
        Ok(Mount {
            cfg,
            core,
            events,
            started: AtomicBool::new(false),
            unmounted: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            session: Mutex::new(None),
        })
    }

    pub fn table(&self) -> &InodeTable {
        &self.core.table
    }

    /// Mount; returns once the kernel has initialised the session (requests are answered
    /// from then on). An error says why not (the mountpoint, /dev/fuse, permissions).
    pub fn start(&self) -> Result<(), MountError> {
        if self.started.swap(true, Ordering::SeqCst) {
            return Err(MountError::Config("this mount was started already".into()));
        }
        let r = self.start_session();
        if r.is_err() {
            // Nothing is mounted (or what was is detached): `wait` must not block on it.
            self.events.finish();
        }
        r
    }

    fn start_session(&self) -> Result<(), MountError> {
        let (options, acl) = parse_options(&self.cfg.options)?;
        let sys = SysMount::from_options(&self.cfg.options).map_err(MountError::Config)?;
        let mut config = fuser::Config::default();
        config.mount_options = options;
        config.acl = acl;
        config.n_threads = Some(1);
        let mp = self.cfg.mountpoint.clone();
        let failed = |e: &dyn std::fmt::Display| {
            MountError::Mount(format!("cannot mount at {}: {e}", mp.display()))
        };
        let (tx, rx) = sync_channel::<Result<(), String>>(2);
        let fs = SnapshotFs::new(self.core.clone(), tx.clone());
        match sys.mount(&mp, self.cfg.uid, self.cfg.gid) {
            Ok(fd) => {
                // Root: mounted as libfuse does (type fuse.spokefs); the session runs on the
                // descriptor, and only `unmount` ever detaches it.
                let session =
                    fuser::Session::from_fd(fs, fd, acl, config).and_then(fuser::Session::spawn);
                let bg = match session {
                    Ok(bg) => bg,
                    Err(e) => {
                        let _ = self.detach();
                        return Err(failed(&e));
                    }
                };
                let events = self.events.clone();
                let waiter =
                    std::thread::Builder::new().name("spokefs-fuse".into()).spawn(move || {
                        let _ = bg.join();
                        events.finish();
                    });
                match waiter {
                    Ok(h) => *self.session.lock().unwrap_or_else(|e| e.into_inner()) = Some(h),
                    Err(e) => self
                        .events
                        .log(Level::Warning, format!("no thread to watch the session ({e})")),
                }
                return Ok(());
            }
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {} // not root: fusermount3
            Err(e) => return Err(failed(&e)),
        }
        let events = self.events.clone();
        let mp2 = mp.clone();
        let handle = std::thread::Builder::new()
            .name("spokefs-fuse".into())
            .spawn(move || {
                let r = fuser::mount2(fs, &mp2, &config);
                if let Err(e) = &r {
                    let _ = tx.send(Err(e.to_string()));
                }
                events.finish();
            })
            .map_err(|e| MountError::Mount(format!("cannot start the session thread: {e}")))?;
        *self.session.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(failed(&e)),
            Err(RecvTimeoutError::Timeout) => {
                Err(failed(&"the kernel did not start the session within 60s"))
            }
            Err(RecvTimeoutError::Disconnected) => Err(failed(&"the session ended at once")),
        }
    }

    /// Wait up to `timeout` (returning early when a log line is waiting); true once the
    /// mount is gone (unmounted here or elsewhere, or the session ended).
    pub fn wait(&self, timeout: Duration) -> bool {
        self.events.wait(timeout)
    }

    /// Whether the mount is gone.
    pub fn done(&self) -> bool {
        self.events.done()
    }

    /// Detach the mount lazily (works while files are open): `fusermount3 -u -z`, else
    /// `umount -l`. Idempotent; false if it was gone already.
    pub fn unmount(&self) -> Result<bool, MountError> {
        // Never after the session ended: the path may hold another mount by now.
        if !self.started.load(Ordering::SeqCst)
            || self.events.done()
            || self.unmounted.swap(true, Ordering::SeqCst)
        {
            return Ok(false);
        }
        match self.detach() {
            Ok(()) => {
                self.events.finish();
                Ok(true)
            }
            Err(_) if self.events.done() => Ok(false), // gone meanwhile
            Err(why) => {
                self.unmounted.store(false, Ordering::SeqCst);
                Err(MountError::Mount(format!(
                    "cannot unmount {}: {why}",
                    self.cfg.mountpoint.display()
                )))
            }
        }
    }

    fn detach(&self) -> Result<(), String> {
        let mp = self.cfg.mountpoint.as_os_str();
        let mut last = String::from("neither fusermount3 nor umount is installed");
        for (cmd, flags) in [("fusermount3", &["-u", "-z"][..]), ("umount", &["-l"][..])] {
            match Command::new(cmd).args(flags).arg(mp).output() {
                Ok(o) if o.status.success() => return Ok(()),
                Ok(o) => {
                    last = String::from_utf8_lossy(if o.stderr.is_empty() {
                        &o.stdout
                    } else {
                        &o.stderr
                    })
                    .trim()
                    .to_owned()
                }
                Err(_) => continue,
            }
        }
        Err(last)
    }

    /// The counters, by name.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let c = &self.core.counters;
        let u = &self.core.units.stats;
        let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let mut out = vec![
            ("reads", ld(&c.reads)),
            ("read_bytes", ld(&c.read_bytes)),
            ("read_errors", ld(&c.read_errors)),
            ("lookups", ld(&c.lookups)),
            ("short_circuit_reads", ld(&c.sc_reads)),
            ("http_reads", ld(&c.http_reads)),
            ("unit_fetches", ld(&u.unit_fetches)),
            ("unit_bytes", ld(&u.unit_bytes)),
            ("exact_fetches", ld(&u.exact_fetches)),
            ("exact_bytes", ld(&u.exact_bytes)),
            ("prefetches", ld(&u.prefetches)),
            ("queued_reads", self.core.pool.queued() as u64),
            ("writes", ld(&c.writes)),
            ("write_bytes", ld(&c.write_bytes)),
            ("uploads", ld(&c.uploads)),
            ("upload_errors", ld(&c.upload_errors)),
            ("passthrough_files", ld(&c.passthrough_files)),
        ];
        if let Some(sc) = &self.core.sc {
            let s = &sc.stats;
            out.extend([
                ("short_circuit_hits", ld(&s.hits)),
                ("located", ld(&s.located)),
                ("learned", ld(&s.learned)),
                ("fallbacks", ld(&s.fallbacks)),
                ("damaged", ld(&s.damaged)),
                ("stale", ld(&s.stale)),
                ("reports", ld(&s.reports)),
            ]);
        } else {
            out.extend([("short_circuit_hits", 0), ("fallbacks", 0)]);
        }
        out
    }

    /// Each kind of request's latency histogram (`latency::BUCKETS` bounds, then +Inf).
    pub fn latency(&self) -> Vec<OpSnapshot> {
        self.core.latency.snapshot()
    }

    /// Log lines waiting for the owner (Python's logging levels).
    pub fn take_logs(&self) -> Vec<(u8, String)> {
        self.events.take_logs().into_iter().map(|(l, m)| (l as u8, m)).collect()
    }

    /// A writable mount's requests for its owner (at most `timeout` waiting for one);
    /// None once the mount is closed (or not writable).
    pub fn take_writes(&self, timeout: Duration) -> Option<Vec<(u64, Ask)>> {
        self.core.writes.as_ref()?.queue.take(timeout)
    }

    /// The owner's answer to request `id`; false when nothing waits for it.
    pub fn answer_write(&self, id: u64, answer: Answer) -> bool {
        self.core.writes.as_ref().is_some_and(|w| w.queue.answer(id, answer))
    }

    /// After the mount is gone: report the last reads, log the short circuit's counts.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(w) = &self.core.writes {
            w.queue.close(); // a close still waiting fails (EIO) rather than hang
        }
        if let Some(sc) = &self.core.sc {
            sc.close();
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_map_onto_fusers() {
        let opts: Vec<String> = [
            "ro",
            "nosuid",
            "nodev",
            "default_permissions",
            "allow_other",
            "fsname=spokefs",
            "subtype=spokefs",
        ]
        .map(String::from)
        .to_vec();
        let (o, acl) = parse_options(&opts).unwrap();
        assert_eq!(acl, SessionACL::All);
        assert!(o.contains(&MountOption::RO) && o.contains(&MountOption::NoSuid));
        assert!(o.contains(&MountOption::FSName("spokefs".into())));
        assert!(o.contains(&MountOption::Subtype("spokefs".into())));
        assert!(parse_options(&["rw,exec".to_string()]).is_err());
        assert_eq!(parse_options(&[]).unwrap().1, SessionACL::Owner);
    }

    #[test]
    fn https_and_bad_columns_are_config_errors() {
        let cols = Columns {
            paths: vec!["a".into()],
            sizes: vec![1],
            modes: vec![0o644],
            mtimes_ns: vec![0],
            versions: vec!["v".into()],
            dirs: vec![],
        };
        let cfg = MountConfig::new("/nonexistent", "https://h:1", "ds", "s", 4 << 20);
        assert!(
            matches!(Mount::new(cfg, cols.clone()), Err(MountError::Config(m)) if m.contains("http only"))
        );
        let cfg = MountConfig::new("/nonexistent", "http://h:1", "ds", "s", 4 << 20);
        let mut bad = cols.clone();
        bad.sizes.clear();
        assert!(matches!(Mount::new(cfg.clone(), bad), Err(MountError::Config(_))));
        let m = Mount::new(cfg, cols).unwrap();
        assert_eq!(m.table().file_count(), 1);
        assert!(!m.unmount().unwrap()); // never started
        assert!(!m.wait(Duration::from_millis(1)));
    }

    #[test]
    fn perms_default_to_the_owner_and_the_manifest() {
        let mut cfg = MountConfig::new("/m", "http://h:1", "ds", "s", 4 << 20);
        cfg.uid = 7;
        cfg.gid = 8;
        let p = perms_of(&cfg).unwrap();
        assert_eq!((p.uid, p.gid, p.file_mode, p.dir_mode), (7, 8, None, 0o555));
        let file = crate::table::Attr { ino: 2, is_dir: false, perm: 0o640, size: 1, mtime_ns: 0 };
        let dir = crate::table::Attr { ino: 1, is_dir: true, perm: 0o555, size: 0, mtime_ns: 0 };
        assert_eq!((p.perm(&file), p.perm(&dir)), (0o640, 0o555));
        cfg.file_uid = Some(1000);
        cfg.file_gid = Some(100);
        cfg.file_mode = Some(0o600);
        cfg.dir_mode = Some(0o700);
        let p = perms_of(&cfg).unwrap();
        assert_eq!((p.uid, p.gid), (1000, 100));
        assert_eq!((p.perm(&file), p.perm(&dir)), (0o600, 0o700));
        cfg.file_mode = Some(0o4755);
        assert!(matches!(perms_of(&cfg), Err(MountError::Config(m)) if m.contains("0o4755")));
    }

    #[test]
    fn a_mount_that_cannot_happen_says_why() {
        let cols = Columns {
            paths: vec![],
            sizes: vec![],
            modes: vec![],
            mtimes_ns: vec![],
            versions: vec![],
            dirs: vec![],
        };
        let cfg = MountConfig::new(
            "/nonexistent/spokefs-mountpoint",
            "http://127.0.0.1:1",
            "ds",
            "s",
            4 << 20,
        );
        let m = Mount::new(cfg, cols).unwrap();
        let e = m.start().unwrap_err();
        assert!(
            matches!(&e, MountError::Mount(msg) if msg.contains("cannot mount at /nonexistent")),
            "{e:?}"
        );
        assert!(m.wait(Duration::from_secs(5)));
    }
}
