//! `spokefs._native.Mount`: the native FUSE mount (native/mount, spokefs-mount) behind the
//! Python CLI (`spokefs mount --engine native`, src/spokefs/mount/native.py).
//!
//! The seam is one call with everything: the manifest's columns (lists, copied once into
//! Rust) and the settings Python resolved. After `start()` the kernel's requests never
//! touch Python; Python only waits (`wait`, the GIL released, so its signal handlers run
//! between calls), unmounts on a signal, drains log lines into its logging, and reads the
//! counters. Errors at the seam are the project's own: ConfigError (spokefs.errors).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use spokefs_mount::{Answer, Ask, Columns, Mount, MountConfig, MountError, ScConfig};

/// A `spokefs.errors` exception (ConfigError, ReadFailed, ...) carrying `msg`.
fn project_error(py: Python<'_>, name: &str, msg: String) -> PyErr {
    let made = py
        .import("spokefs.errors")
        .and_then(|m| m.getattr(name))
        .and_then(|cls| cls.call1((msg.clone(),)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyValueError::new_err(msg), // spokefs not importable: still say why
    }
}

fn mount_error(py: Python<'_>, e: MountError) -> PyErr {
    // The Python mount raises ConfigError for both (a bad setting, a mountpoint refused).
    project_error(py, "ConfigError", e.to_string())
}

fn sc_config(d: &Bound<'_, PyDict>) -> PyResult<ScConfig> {
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        d.get_item(k)?.ok_or_else(|| PyValueError::new_err(format!("short_circuit needs {k:?}")))
    };
    Ok(ScConfig {
        cache_dir: PathBuf::from(get("cache_dir")?.extract::<String>()?),
        cache_id: get("cache_id")?.extract()?,
        chunk_size: get("chunk_size")?.extract()?,
        key: get("key")?.extract()?,
    })
}

/// One native mount of one snapshot (see src/spokefs/_native.pyi).
#[pyclass(module = "spokefs._native", name = "Mount", frozen)]
pub struct PyMount {
    inner: Mount,
}

#[pymethods]
impl PyMount {
    #[new]
    #[pyo3(signature = (mountpoint, *, paths, sizes, modes, mtimes_ns, versions, dirs, block_size,
                        dataset, snapshot, base_url, token=None, deadline_s=30.0, options,
                        uid=0, gid=0, created_ns=0, short_circuit=None, workers=32,
                        connections=32, file_uid=None, file_gid=None, file_mode=None,
                        dir_mode=None, staging=None, write_passthrough=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        mountpoint: PathBuf,
        paths: Vec<String>,
        sizes: Vec<u64>,
        modes: Vec<u32>,
        mtimes_ns: Vec<i64>,
        versions: Vec<String>,
        dirs: Vec<String>,
        block_size: u64,
        dataset: String,
        snapshot: String,
        base_url: String,
        token: Option<String>,
        deadline_s: f64,
        options: Vec<String>,
        uid: u32,
        gid: u32,
        created_ns: i64,
        short_circuit: Option<Bound<'_, PyDict>>,
        workers: usize,
        connections: usize,
        file_uid: Option<u32>,
        file_gid: Option<u32>,
        file_mode: Option<u32>,
        dir_mode: Option<u32>,
        staging: Option<PathBuf>,
        write_passthrough: bool,
    ) -> PyResult<PyMount> {
        if !(deadline_s.is_finite() && deadline_s > 0.0) {
            return Err(project_error(
                py,
                "ConfigError",
                format!("deadline must be positive, not {deadline_s}"),
            ));
        }
        let mut cfg = MountConfig::new(mountpoint, &base_url, &dataset, &snapshot, block_size);
        cfg.token = token;
        cfg.deadline = Duration::from_secs_f64(deadline_s);
        cfg.options = options;
        cfg.uid = uid;
        cfg.gid = gid;
        cfg.file_uid = file_uid;
        cfg.file_gid = file_gid;
        cfg.file_mode = file_mode;
        cfg.dir_mode = dir_mode;
        cfg.created_ns = created_ns;
        cfg.short_circuit = short_circuit.as_ref().map(sc_config).transpose()?;
        cfg.workers = workers;
        cfg.connections = connections;
        cfg.staging = staging;
        cfg.write_passthrough = write_passthrough;
        let cols = Columns { paths, sizes, modes, mtimes_ns, versions, dirs };
        let inner = py.detach(|| Mount::new(cfg, cols)).map_err(|e| mount_error(py, e))?;
        Ok(PyMount { inner })
    }

    /// Mount; returns once the kernel has started the session (GIL released).
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.start()).map_err(|e| mount_error(py, e))
    }

    /// Wait up to `timeout_s` (less when a log line is waiting); True once unmounted.
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> bool {
        let t = Duration::from_secs_f64(timeout_s.clamp(0.0, 3600.0));
        py.detach(|| self.inner.wait(t))
    }

    /// Detach the mount lazily; False if it was gone already.
    fn unmount(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.inner.unmount()).map_err(|e| mount_error(py, e))
    }

    /// Counters by name: reads, read_bytes, read_errors, short_circuit_hits, http_reads,
    /// fallbacks, ...
    fn counters(&self) -> HashMap<&'static str, u64> {
        self.inner.counters().into_iter().collect()
    }

    /// Everything `/metrics` shows, in one call (never one per request): the latency
    /// buckets' upper bounds in seconds (+Inf left out), each kind of request as (kind,
    /// requests per bucket, not cumulative, the last +Inf; their total seconds), and the
    /// counters.
    #[allow(clippy::type_complexity)]
    fn metrics(
        &self,
    ) -> (Vec<f64>, Vec<(&'static str, Vec<u64>, f64)>, HashMap<&'static str, u64>) {
        let bounds = (0..spokefs_mount::latency::BUCKETS).map(spokefs_mount::latency::bound_s);
        let ops = self.inner.latency().into_iter().map(|o| (o.op, o.counts, o.sum_s));
        (bounds.collect(), ops.collect(), self.inner.counters().into_iter().collect())
    }

    /// A writable mount's requests (waiting up to `timeout_s` for one, the GIL released):
    /// (id, "put", path, None, staged, False), (id, "rename", from, to, staged, uploaded),
    /// (id, "discard", path, None, None, True); None once the mount is closed.
    #[allow(clippy::type_complexity)]
    fn take_writes(
        &self,
        py: Python<'_>,
        timeout_s: f64,
    ) -> Option<Vec<(u64, &'static str, String, Option<String>, Option<PathBuf>, bool)>> {
        let t = Duration::from_secs_f64(timeout_s.clamp(0.0, 3600.0));
        let asks = py.detach(|| self.inner.take_writes(t))?;
        Some(
            asks.into_iter()
                .map(|(id, ask)| match ask {
                    Ask::Put { path, staged } => (id, "put", path, None, Some(staged), false),
                    Ask::Rename { from, to, staged, uploaded } => {
                        (id, "rename", from, Some(to), Some(staged), uploaded)
                    }
                    Ask::Discard { path } => (id, "discard", path, None, None, true),
                })
                .collect(),
        )
    }

    /// Answer request `id`: 0 or an errno, and the folder ("dir/") committed with it.
    #[pyo3(signature = (id, errno, committed=None))]
    fn answer_write(&self, id: u64, errno: i32, committed: Option<String>) -> bool {
        self.inner.answer_write(id, Answer { errno, committed })
    }

    /// Log lines waiting, as (logging level, message), oldest first.
    fn take_logs(&self) -> Vec<(u8, String)> {
        self.inner.take_logs()
    }

    /// After unmounting: report the last reads to the spoke (briefly tried).
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close())
    }

    #[getter]
    fn file_count(&self) -> usize {
        self.inner.table().file_count()
    }

    #[getter]
    fn total_bytes(&self) -> u64 {
        self.inner.table().total_bytes()
    }
}
