//! spokefs-mount: the FUSE mount of one snapshot (read-only, or writable for new files), as
//! a native daemon.
//!
//! Python keeps setup (resolving the snapshot, loading the manifest, probing the short
//! circuit, readiness, readahead, logging, daemonising) and hands this crate, in one call,
//! the manifest's columns and the settings ([`MountConfig`], [`Columns`]); from then on the
//! kernel's requests never touch Python. Pieces:
//!
//! - [`table`]: the inode table (lookups by parent and name, listings, attributes);
//! - [`fs`]: the FUSE operations (fuser), metadata on the session thread, reads on the
//!   worker [`pool`];
//! - [`shortcircuit`]: reads of the spoke's cache files on its own host, every chunk
//!   checked (`spokefs_core::read_checked`), reads reported in batches;
//! - [`units`]: reads over HTTP ([`http`]), whole units for streams, exact ranges for
//!   random reads, with in-flight de-duplication and a bounded cache;
//! - [`mount`]: the lifecycle (start, wait, unmount, counters, logs via [`events`]);
//! - [`latency`]: each kind of request's time, as histograms (atomics only);
//! - [`writes`]: a writable mount's files (staged here, uploaded by Python: `--writable`).
//!
//! One `unsafe` call: mount(2), in [`sysmount`] (its comment says why it is sound).
#![deny(unsafe_code)]

pub mod blocks;
pub mod events;
pub mod fs;
pub mod http;
pub mod latency;
pub mod mount;
pub mod pool;
pub mod shortcircuit;
pub mod sysmount;
pub mod table;
pub mod units;
pub mod writes;

#[cfg(test)]
mod testserver;

pub use events::Level;
pub use fs::Perms;
pub use mount::{Mount, MountConfig, MountError, parse_options, perms_of};
pub use shortcircuit::ScConfig;
pub use table::{Columns, InodeTable};
pub use writes::{Answer, Ask};
