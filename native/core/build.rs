//! Compiles the vendored libxxhash (vendor/xxhash: xxHash v0.8.2, BSD-2-Clause, unmodified)
//! into spokefs-core. On x86-64 with its run-time dispatcher (xxh_x86dispatch.c: the xxh3
//! kernel chosen by cpuid among scalar, SSE2, AVX2 and AVX-512), which is what python-xxhash
//! ships and what makes it fast; a Rust xxh3 picks its kernel when compiled, so a portable
//! wheel would carry the SSE2 one only (measured here: 32 GB/s against 110, docs/
//! architecture.md, "The native core"). Elsewhere (arm64: NEON is the baseline) the plain
//! build is already the best kernel.

fn main() {
    let dir = "vendor/xxhash";
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={dir}");
    let mut build = cc::Build::new();
    build.include(dir).file(format!("{dir}/xxhash.c")).opt_level(3).warnings(false);
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64") {
        build.file(format!("{dir}/xxh_x86dispatch.c"));
    }
    build.compile("xxhash");
}
