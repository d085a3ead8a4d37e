//! xxh3-64 and xxh3-128, from the vendored libxxhash (`build.rs`, `vendor/xxhash`): on
//! x86-64 through its run-time dispatcher (the kernel chosen by cpuid once, AVX-512 where
//! the CPU has it), elsewhere its plain build. The same code, and so the same digests, as
//! python-xxhash, which the hub and `spokefs.integrity` use.
#![allow(unsafe_code)] // the FFI calls below, each with its argument

use std::ffi::c_void;

/// `XXH128_hash_t`.
#[repr(C)]
struct Hash128 {
    low64: u64,
    high64: u64,
}

#[cfg(target_arch = "x86_64")]
unsafe extern "C" {
    #[link_name = "XXH3_64bits_dispatch"]
    fn xxh3_64bits(input: *const c_void, len: usize) -> u64;
    #[link_name = "XXH3_128bits_dispatch"]
    fn xxh3_128bits(input: *const c_void, len: usize) -> Hash128;
}

#[cfg(not(target_arch = "x86_64"))]
unsafe extern "C" {
    #[link_name = "XXH3_64bits"]
    fn xxh3_64bits(input: *const c_void, len: usize) -> u64;
    #[link_name = "XXH3_128bits"]
    fn xxh3_128bits(input: *const c_void, len: usize) -> Hash128;
}

/// The xxh3-64 of `data` (seed 0, default secret).
#[inline]
pub fn xxh3_64(data: &[u8]) -> u64 {
    // SAFETY: libxxhash reads `len` bytes of `input` (an empty slice's pointer is non-null,
    // and it reads none) and writes only its dispatch table, set at load; `data` is a live
    // slice of exactly `len` bytes that nothing writes meanwhile (we hold `&[u8]`).
    unsafe { xxh3_64bits(data.as_ptr().cast(), data.len()) }
}

/// The xxh3-128 of `data` (seed 0, default secret).
#[inline]
pub fn xxh3_128(data: &[u8]) -> u128 {
    // SAFETY: as in `xxh3_64`; the result is returned by value as the C struct it is.
    let h = unsafe { xxh3_128bits(data.as_ptr().cast(), data.len()) };
    (u128::from(h.high64) << 64) | u128::from(h.low64)
}
