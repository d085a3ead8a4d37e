//! spokefs-core: the byte path of spokefs, in plain Rust.
//!
//! What lives here is what touches every cached byte: the xxh3-64 digests of a block's
//! chunks (`chunks`) and the checked read of a block region from a segment file (`read`):
//! one positional read into a buffer the caller owns, then every chunk the read touches
//! checked against the block's chunk digests. Nothing here knows about Python; the
//! extension module (`native/py`, `spokefs._native`) is a thin layer over these functions,
//! and a native mount or serve path can call them directly.
//!
//! `unsafe` only in `xxh3` (the calls into the vendored libxxhash, each with its argument):
//! descriptors come in through the [`read::ReadAt`] trait, so the one place that turns a raw
//! descriptor into reads (the Python seam) carries that unsafe code and its argument.
#![deny(unsafe_code)]

pub mod chunks;
pub mod read;
pub mod xxh3;

pub use chunks::{
    DIGEST_LEN, block_digest, chunk_count, chunk_digest, chunk_digests, chunk_digests_into,
    chunks_match,
};
pub use read::{ReadAt, ReadError, pread_full, read_checked, read_span, span};
