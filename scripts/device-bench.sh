#!/usr/bin/env bash
# One run on a borrowed GPU machine with no network (spokefs not installed: run from source).
#
#   OUT=/empty/folder bash scripts/device-bench.sh      # from the repository root
#
# Measures, each part under its own timeout, all within DEVICE_BENCH_BUDGET seconds (400):
#   1. `spokefs bench train` with torchvision's ResNet-50 on the GPU (bf16): `local` against
#      `remote_spoke` (and `remote_spoke_hints` if time allows) over an emulated 60 ms link;
#      samples/s, accelerator utilisation (the loop's and nvidia-smi's), remote/local.
#   2. How the spoke's cold fill (`bench dataplane`) and the mount (`bench mount`, native
#      engine) grow with cores: each under `taskset -c 0-(N-1)` for N in 16, 2, 8, 4.
# Needs: python3 with torch (+ torchvision), aiohttp, prometheus-client, xxhash, urllib3,
# fsspec, tqdm (matplotlib for figures), and the built src/spokefs/_native.abi3.so.
# Writes to $OUT (8 files, flat): log.txt, run.json (preflight, what ran, skipped, failed),
# train.json, train.png, scaling.json, scaling.png, train.tar.gz, scaling.tar.gz (raw
# results and logs). Results are rewritten after each part, so a cut-short run keeps what
# finished. DEVICE_BENCH_TINY=1: tiny sizes, cores 1,2, the model on the CPU (a local check);
# DEVICE_BENCH_NO_MOUNT=1: no FUSE (the spoke read over HTTP, no mount bench).
# DEVICE_BENCH_SCENARIOS="local remote_spoke ...": the training scenarios, in order;
# DEVICE_BENCH_CORES="16 2": the core counts of the scaling part ("" skips it).
set -uo pipefail

T0=$(date +%s)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
: "${OUT:?set OUT to an empty folder}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TINY=${DEVICE_BENCH_TINY:-0}
BUDGET=${DEVICE_BENCH_BUDGET:-400}   # the machine gives 7 minutes; keep a margin
RESERVE=25                           # kept back for the summaries and archives at the end
PY=${PYTHON:-python3}
WORK=${DEVICE_BENCH_WORK:-/tmp/spokefs-devbench}

exec > >(tee -a "$OUT/log.txt") 2>&1
TEE_PID=$!

say() { printf '[%4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

# Leftovers of an earlier run: mounts first (a dead FUSE mount blocks rm), then the folder.
unmount_work() {
  local mp
  while read -r mp; do
    [ -n "$mp" ] || continue
    fusermount3 -u -z "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null || true
  done < <(awk -v w="$WORK" 'index($5, w) == 1 {print $5}' /proc/self/mountinfo)
}
unmount_work
rm -rf "$WORK"
mkdir -p "$WORK"/{train,scaling,tmp}
# Every temporary folder under WORK (bench train's mount points too), so a part cut short
# leaves nothing that unmount_work cannot find.
export TMPDIR="$WORK/tmp"
PARTS="$WORK/parts.tsv"   # part, status, seconds, detail
: > "$PARTS"
note() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$PARTS"; }

# -- Python from source ----------------------------------------------------------------------
# spokefs is not installed there: the source tree on PYTHONPATH, `python3 -m spokefs.cli` as
# the command (what spokefs.procs uses for every child: hub, spoke, link, mount).
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
SPOKEFS=("$PY" -m spokefs.cli)

# pyfuse3 (the python engine's) is not installed there: every mount is the native engine.
export SPOKEFS_MOUNT_ENGINE=native

# -- sizes -----------------------------------------------------------------------------------
NPROC=$(nproc)
if [ "$TINY" = 1 ]; then
  CORES_LIST="1 2"
  TRAIN_SAMPLES=32; TRAIN_SIZE=20KB; TRAIN_BATCH=8; TRAIN_WORKERS=2; TRAIN_EPOCHS=2
  TRAIN_BW=200MB/s; T_LOCAL=150; T_REMOTE=120; T_HINTS=120
  DP_ARGS=(--small-files 300 --small-size 128KiB --small-dirs 10 --large-bytes 32MiB
           --large-file-size 8MiB --readers 4)
  MNT_ARGS=(--files 2 --file-size 16MiB --small-files 200 --readers 4 --random-reads 100)
  T_DP=90; T_MNT=90; T_MIN=20
else
  CORES_LIST="16 2 8 4"   # extremes first: a run cut short still shows the trend
  # 12,800 samples of ~110 KB (ImageNet's mean JPEG size) = 1.4 GB; batch 256: 50 batches an
  # epoch, ~4-5 s at the ~3,000 img/s a bf16 ResNet-50 trains at on an H200.
  TRAIN_SAMPLES=12800; TRAIN_SIZE=110KB; TRAIN_BATCH=256; TRAIN_WORKERS=12; TRAIN_EPOCHS=3
  TRAIN_BW=1GB/s; T_LOCAL=100; T_REMOTE=85; T_HINTS=75
  # Each point ~15-30 s (about 28 s at N=2 on a 2-core VM; the first pays the hub's hashing).
  DP_ARGS=(--small-files 2000 --small-size 128KiB --small-dirs 20 --large-bytes 512MiB
           --large-file-size 8MiB --readers 16)
  MNT_ARGS=(--files 2 --file-size 256MiB --small-files 2000 --readers 16 --random-reads 1000)
  T_DP=45; T_MNT=40; T_MIN=15
fi

# run_part NAME SECONDS CMD...: CMD under `timeout` (cut to the time left), its status noted.
LAST_RC=0
run_part() {
  local name=$1 want=$2; shift 2
  local avail=$(( $(left) - RESERVE ))
  local t=$(( want < avail ? want : avail ))
  if [ "$t" -lt "$T_MIN" ]; then
    say "SKIPPED $name: ${avail}s left of the budget, it needs up to ${want}s"
    note "$name" skipped 0 "not enough time left (${avail}s)"
    LAST_RC=125
    return 125
  fi
  say "RUN $name (timeout ${t}s): $*"
  local t1; t1=$(date +%s)
  timeout -k 10 "$t" "$@"
  LAST_RC=$?
  local took=$(( $(date +%s) - t1 ))
  case $LAST_RC in
    0) say "done $name in ${took}s"; note "$name" ok "$took" "" ;;
    124|137) say "TIMED OUT $name after ${took}s"; note "$name" timeout "$took" "limit ${t}s" ;;
    *) say "FAILED $name (exit $LAST_RC) after ${took}s"
       note "$name" failed "$took" "exit $LAST_RC" ;;
  esac
  unmount_work   # a mount left by a part that was cut short
  return $LAST_RC
}

# -- 0. preflight ----------------------------------------------------------------------------
say "spokefs device bench: budget ${BUDGET}s, tiny=$TINY, $NPROC cores, out $OUT, work $WORK"
if command -v nvidia-smi >/dev/null; then
  timeout 20 nvidia-smi -L || say "nvidia-smi -L failed"
  HAVE_SMI=1
else
  say "no nvidia-smi: GPU utilisation from the loop only"
  HAVE_SMI=0
fi
timeout -k 5 90 "$PY" - "$WORK/preflight.json" "$HAVE_SMI" <<'PYEOF'
import json, os, shutil, sys, time
out, checks = sys.argv[1], {}
def check(name, fn):
    t = time.perf_counter()
    try:
        checks[name] = {"ok": True, "value": fn()}
    except BaseException as exc:  # report everything, never stop
        checks[name] = {"ok": False, "value": f"{type(exc).__name__}: {exc}"}
    checks[name]["s"] = round(time.perf_counter() - t, 2)
    print(f"  {name:12} {'ok ' if checks[name]['ok'] else 'NO '} {checks[name]['value']}",
          flush=True)
def torch_():
    import torch
    return torch.__version__
def cuda():
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    return torch.cuda.get_device_name(0)
def torchvision_():
    import torchvision
    return torchvision.__version__
def native():
    from spokefs import _native
    if not hasattr(_native, "Mount"):
        raise RuntimeError("this build of spokefs._native has no Mount (native mount engine)")
    return _native.__file__
def fuse():
    os.close(os.open("/dev/fuse", os.O_RDWR))
    return "opened /dev/fuse" + ("" if os.geteuid() == 0 else "; not root")
def mounter():
    if os.geteuid() == 0:
        return "root: mount(2) directly"
    if not shutil.which("fusermount3"):
        raise RuntimeError("not root and no fusermount3")
    return shutil.which("fusermount3")
def matplotlib_():
    import matplotlib
    return matplotlib.__version__
check("python", lambda: sys.version.split()[0])
check("cores", lambda: f"{os.cpu_count()} (affinity {len(os.sched_getaffinity(0))})")
check("memory", lambda: f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') >> 30} GiB")
check("tmp_free", lambda: f"{shutil.disk_usage('/tmp').free >> 30} GiB")
check("shm_free", lambda: f"{shutil.disk_usage('/dev/shm').free >> 30} GiB")
check("spokefs", lambda: __import__("spokefs").__file__)
check("native", native)
check("torch", torch_)
check("cuda", cuda)
check("torchvision", torchvision_)
check("matplotlib", matplotlib_)
check("fuse", fuse)
check("mounter", mounter)
check("taskset", lambda: shutil.which("taskset") or (_ for _ in ()).throw(RuntimeError("none")))
with open(out, "w") as f:
    json.dump({"checks": checks, "uname": " ".join(os.uname())}, f, indent=1)
PYEOF
pf() {  # pf NAME: 1 when the preflight check NAME passed
  "$PY" -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["checks"][sys.argv[2]]["ok"]))' \
    "$WORK/preflight.json" "$1" 2>/dev/null || echo 0
}
HAVE_NATIVE=$(pf native); HAVE_TORCH=$(pf torch); HAVE_CUDA=$(pf cuda)
HAVE_TV=$(pf torchvision); HAVE_FUSE=$(pf fuse); HAVE_MOUNTER=$(pf mounter)
HAVE_TASKSET=$(pf taskset)
[ "$HAVE_NATIVE" = 1 ] || say "WARNING: spokefs._native does not import (carry" \
  "src/spokefs/_native.abi3.so): hub and spoke will fail"
# DataLoader workers hand each batch (256 x 150 KB) over in /dev/shm: make sure there is room.
SHM_FREE=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "${SHM_FREE:-0}" -lt 2 ] && [ "$(id -u)" = 0 ]; then
  mkdir -p /dev/shm && mount -t tmpfs -o size=16g tmpfs /dev/shm \
    && say "/dev/shm had ${SHM_FREE:-no} GiB free: mounted a 16 GiB tmpfs there" \
    || say "WARNING: /dev/shm has ${SHM_FREE:-no} GiB free and could not be mounted"
fi
MOUNT_OK=0
if [ "${DEVICE_BENCH_NO_MOUNT:-0}" = 1 ]; then
  say "DEVICE_BENCH_NO_MOUNT=1: the training spoke is read over HTTP, mount variants skipped"
elif [ "$HAVE_FUSE" = 1 ] && [ "$HAVE_MOUNTER" = 1 ] && [ "$HAVE_NATIVE" = 1 ]; then
  MOUNT_OK=1
else
  say "no usable FUSE (/dev/fuse=$HAVE_FUSE, mounter=$HAVE_MOUNTER, native=$HAVE_NATIVE):" \
    "the training spoke is read over HTTP and the mount variants are skipped"
fi

# -- 1. training -----------------------------------------------------------------------------
if [ "$HAVE_TORCH" != 1 ]; then
  say "SKIPPED training: torch does not import"
  note train skipped 0 "torch does not import"
else
  if [ "$TINY" = 1 ]; then
    if [ "$HAVE_TV" = 1 ]; then
      MODEL=(--model resnet50 --device "$([ "$HAVE_CUDA" = 1 ] && echo cuda || echo cpu)")
    else
      MODEL=(--model); say "no torchvision: the tiny CNN on the CPU instead of ResNet-50"
    fi
  elif [ "$HAVE_CUDA" = 1 ] && [ "$HAVE_TV" = 1 ]; then
    MODEL=(--model resnet50 --device cuda)
  else
    # No GPU model: the step emulated at what an H200 takes for ResNet-50 bf16 at batch 256.
    MODEL=(--compute 85ms)
    say "NO GPU MODEL (cuda=$HAVE_CUDA, torchvision=$HAVE_TV): an 85 ms sleep per batch of" \
      "256 stands in for the H200's ResNet-50 step"
  fi
  if [ "$MOUNT_OK" = 1 ]; then READER=auto; else READER=http; fi
  say "training: ${MODEL[*]}, $TRAIN_SAMPLES samples of ~$TRAIN_SIZE, batch $TRAIN_BATCH," \
    "$TRAIN_WORKERS workers, $TRAIN_EPOCHS epochs, link 60ms at $TRAIN_BW, spoke reader $READER"
  for sc in ${DEVICE_BENCH_SCENARIOS:-local remote_spoke remote_spoke_hints}; do
    case $sc in local) want=$T_LOCAL ;; remote_spoke) want=$T_REMOTE ;; *) want=$T_HINTS ;; esac
    if [ "$sc" = remote_spoke_hints ] && [ "$TINY" != 1 ] && [ -n "${DEVICE_BENCH_CORES-$CORES_LIST}" ] \
       && [ "$(left)" -lt 230 ]; then
      say "SKIPPED train:$sc: kept the time for the scaling runs"
      note "train:$sc" skipped 0 "time kept for scaling"
      continue
    fi
    dir="$WORK/train/$sc"; mkdir -p "$dir"
    SMI_PID=""
    if [ "$HAVE_SMI" = 1 ]; then
      timeout "$want" nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw \
        --format=csv,noheader,nounits -lms 250 > "$dir/gpu.csv" 2>/dev/null &
      SMI_PID=$!
    fi
    run_part "train:$sc" "$want" "${SPOKEFS[@]}" bench train --out "$dir" --scenarios "$sc" \
      "${MODEL[@]}" --samples "$TRAIN_SAMPLES" --sample-size "$TRAIN_SIZE" \
      --batch-size "$TRAIN_BATCH" --workers "$TRAIN_WORKERS" --epochs "$TRAIN_EPOCHS" \
      --rtt 60ms --bandwidth "$TRAIN_BW" --spoke-reader "$READER" \
      --data-dir "$WORK/traindata" --no-progress
    if [ -n "$SMI_PID" ]; then kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; fi
    timeout 60 "$PY" - "$WORK" "$OUT" <<'PYEOF' || say "train summary failed"
import csv, datetime, json, statistics, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
rows, results, timelines, params = {}, {}, {}, None
for d in sorted((work / "train").iterdir()):
    doc_path = d / "results.json"
    if not doc_path.exists():
        rows[d.name] = {"status": "no results (failed, timed out or skipped: see log.txt)"}
        continue
    doc = json.loads(doc_path.read_text())
    params = params or doc["params"]
    if not doc["results"]:
        rows[d.name] = {"status": "did not run", "skipped": doc["params"]["skipped"],
                        "failed": doc["params"]["failed"]}
        continue
    for key, r in doc["results"].items():
        row = {k: r.get(k) for k in (
            "reader", "reader_detail", "samples_per_s_steady", "au", "au_steady",
            "first_epoch_s", "epoch_s", "warmup_batches", "warmed_up", "time_to_steady_s",
            "stall_batches", "wan_bytes", "hit_ratio", "bytes_wrong", "notes")}
        tl = list(csv.DictReader((d / "timeline.csv").open()))
        row["samples_per_s"] = (sum(int(b["samples"]) for b in tl) / float(tl[-1]["t"])
                                if tl else None)
        gpu = d / "gpu.csv"
        if gpu.exists() and r.get("started_unix") and tl:
            t0, t1 = r["started_unix"], r["started_unix"] + float(tl[-1]["t"])
            util = []
            for line in gpu.read_text().splitlines():
                f = [x.strip() for x in line.split(",")]
                try:
                    ts = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    if t0 <= ts <= t1:
                        util.append(float(f[1]))
                except (ValueError, IndexError):
                    continue
            if util:
                row["gpu_util_nvidia_smi"] = {"mean": round(statistics.mean(util), 1),
                                              "median": statistics.median(util),
                                              "samples": len(util)}
        rows[key] = row
        results[key] = r
        from spokefs_bench.training.metrics import Batch
        timelines[key] = [Batch(int(b["epoch"]), int(b["batch"]), float(b["t"]),
                                float(b["data_wait_s"]), float(b["compute_s"]),
                                int(b["samples"]), int(b["bytes"])) for b in tl]
ratio = {}
loc = rows.get("local", {}).get("samples_per_s_steady")
for k in ("remote_spoke", "remote_spoke_hints"):
    rem = rows.get(k, {}).get("samples_per_s_steady")
    if loc and rem:
        ratio[f"{k}/local samples_per_s_steady"] = round(rem / loc, 3)
        ratio[f"{k}/local samples_per_s (whole run)"] = round(
            rows[k]["samples_per_s"] / rows["local"]["samples_per_s"], 3)
keep = ("samples", "sample_size", "batch_size", "workers", "epochs", "accelerator", "arch",
        "device", "rtt_s", "link_bytes_per_s", "spoke_reader", "datasets", "machine")
doc = {"params": {k: params[k] for k in keep if params and k in params},
       "scenarios": rows, "ratios": ratio,
       "definitions": "au: compute / wall (the step synchronised on the GPU); steady: the "
       "last epoch; gpu_util_nvidia_smi: nvidia-smi utilization.gpu sampled every 250 ms "
       "while the loop ran (docs/benchmark.md)"}
(out / "train.json").write_text(json.dumps(doc, indent=1) + "\n")
print(f"  {'scenario':20} {'reader':12} {'sps_steady':>10} {'sps_all':>8} {'au':>6} "
      f"{'au_st':>6} {'gpu%':>6} {'1st_ep_s':>8} {'hit':>6} {'wrong_B':>7}")
for k, r in rows.items():
    if "reader" not in r:
        print(f"  {k:20} {r['status']}")
        continue
    def f(v, spec):
        return "-" if v is None else format(v, spec)
    g = r.get("gpu_util_nvidia_smi", {}).get("mean")
    print(f"  {k:20} {r['reader']:12} {f(r['samples_per_s_steady'], '10.0f'):>10} "
          f"{f(r['samples_per_s'], '8.0f'):>8} {f(r['au'], '6.3f'):>6} "
          f"{f(r['au_steady'], '6.3f'):>6} {f(g, '6.1f'):>6} "
          f"{f(r['first_epoch_s'], '8.2f'):>8} {f(r['hit_ratio'], '6.3f'):>6} "
          f"{r['bytes_wrong']!s:>7}")
for k, v in ratio.items():
    print(f"  {k}: {v}")
if timelines:
    try:
        from spokefs_bench.training.plots import plot_timelines
        plot_timelines(out / "train.png", timelines, results,
                       f"device bench: {params['accelerator']}, batch {params['batch_size']}")
    except Exception as exc:  # a figure is a bonus
        print(f"  (no train.png: {type(exc).__name__}: {exc})")
PYEOF
  done
fi

# -- 2. scaling with cores -------------------------------------------------------------------
scaling_summary() {
  timeout 60 "$PY" - "$WORK" "$OUT" <<'PYEOF' || say "scaling summary failed"
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
by_n: dict[int, dict] = {}
for p in sorted((work / "scaling").glob("*-n*/results.json")):
    kind, n = p.parent.name.rsplit("-n", 1)
    doc = json.loads(p.read_text())
    row = by_n.setdefault(int(n), {})
    if kind == "dataplane":
        for ds, r in doc["results"].items():
            ph = {(x["phase"]): x for x in r["phases"] if x["variant"] == "this"}
            row[f"dataplane_{ds}"] = {
                "fill_GBps": r["fill_GBps"], "fill_blocks_per_s": r["fill_blocks_per_s"],
                "spoke_cpu_s_per_GiB": r["spoke_cpu_s_per_GiB"],
                "warm_GBps": ph.get("warm", {}).get("GBps"),
                "hit_GBps": ph.get("hit", {}).get("GBps"),
                "hub_GBps": ph.get("hub", {}).get("GBps"),
                "loop_lag_p99_ms": r["loop_lag_p99_ms"]}
    else:
        for name in ("mount", "mount_http", "direct"):
            if name in doc:
                row[name] = {state: {k: doc[name][state].get(k) for k in (
                    "seq_GBps", "rand_128KiB_p99_ms", "small_files_per_s")}
                    for state in doc[name]}
        row["mount_read_ahead_kb"] = doc["config"].get("read_ahead_kb")
(out / "scaling.json").write_text(json.dumps(
    {"cores": {str(n): by_n[n] for n in sorted(by_n)},
     "notes": "each N under taskset -c 0-(N-1), spoke --workers N; dataplane: cold fill by "
     "HTTP readers (GB/s of the demand phase), then warm-up, hits, hub; mount: native "
     "engine, 1 MiB sequential GB/s and small files/s per page-cache state"}, indent=1) + "\n")
cols = ["N", "small fill GB/s", "small hit GB/s", "large fill GB/s", "large hit GB/s",
        "mnt seq cold", "mnt seq hot", "mnt small/s cold", "direct seq cold"]
def g(d, *ks):
    for k in ks:
        d = d.get(k) if isinstance(d, dict) else None
    return "-" if d is None else (f"{d:.3f}" if isinstance(d, float) and d < 100 else f"{d:.0f}")
print("  " + " | ".join(cols))
for n in sorted(by_n):
    r = by_n[n]
    print("  " + " | ".join([str(n), g(r, "dataplane_small", "fill_GBps"),
                              g(r, "dataplane_small", "hit_GBps"),
                              g(r, "dataplane_large", "fill_GBps"),
                              g(r, "dataplane_large", "hit_GBps"),
                              g(r, "mount", "cold", "seq_GBps"),
                              g(r, "mount", "spoke_hot", "seq_GBps"),
                              g(r, "mount", "cold", "small_files_per_s"),
                              g(r, "direct", "cold", "seq_GBps")]))
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = sorted(by_n)
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for label, keys in (("dataplane small fill", ("dataplane_small", "fill_GBps")),
                        ("dataplane small hit", ("dataplane_small", "hit_GBps")),
                        ("dataplane large fill", ("dataplane_large", "fill_GBps")),
                        ("dataplane large hit", ("dataplane_large", "hit_GBps"))):
        pts = [(n, by_n[n].get(keys[0], {}).get(keys[1])) for n in ns]
        pts = [(n, v) for n, v in pts if v is not None]
        if pts:
            ax[0].plot(*zip(*pts), marker="o", label=label)
    for label, keys in (("mount seq cold", ("mount", "cold", "seq_GBps")),
                        ("mount seq spoke_hot", ("mount", "spoke_hot", "seq_GBps")),
                        ("direct seq cold", ("direct", "cold", "seq_GBps"))):
        pts = []
        for n in ns:
            v = by_n[n]
            for k in keys:
                v = v.get(k) if isinstance(v, dict) else None
            if v is not None:
                pts.append((n, v))
        if pts:
            ax[1].plot(*zip(*pts), marker="o", label=label)
    for a, t in zip(ax, ("spoke (HTTP readers), GB/s", "mount, GB/s"), strict=True):
        a.set_xlabel("cores (taskset)")
        a.set_title(t)
        a.set_xticks(ns)
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=100)
except Exception as exc:  # a figure is a bonus
    print(f"  (no scaling.png: {type(exc).__name__}: {exc})")
PYEOF
}

if [ "$HAVE_TASKSET" != 1 ]; then
  say "SKIPPED scaling: no taskset"
  note scaling skipped 0 "no taskset"
else
  MOUNT_FAILED=0
  for n in ${DEVICE_BENCH_CORES-$CORES_LIST}; do
    if [ "$n" -gt "$NPROC" ]; then
      say "SKIPPED N=$n: only $NPROC cores"; note "scaling:n$n" skipped 0 "only $NPROC cores"
      continue
    fi
    cpus="0-$(( n - 1 ))"
    run_part "dataplane:n$n" "$T_DP" taskset -c "$cpus" "${SPOKEFS[@]}" bench dataplane \
      --out "$WORK/scaling/dataplane-n$n" --work-dir "$WORK/dp-work" --datasets small,large \
      --workers "$n" "${DP_ARGS[@]}"
    scaling_summary
    if [ "$MOUNT_OK" != 1 ]; then
      say "SKIPPED mount:n$n: no mount here (see above)"; note "mount:n$n" skipped 0 "no mount"
    elif [ "$MOUNT_FAILED" = 1 ]; then
      say "SKIPPED mount:n$n: the mount failed at a previous N"
      note "mount:n$n" skipped 0 "mount failed before"
    else
      run_part "mount:n$n" "$T_MNT" taskset -c "$cpus" "${SPOKEFS[@]}" bench mount \
        --out "$WORK/scaling/mount-n$n" --work-dir "$WORK/mnt-work" --variants sc \
        --spoke-arg=--workers "--spoke-arg=$n" "${MNT_ARGS[@]}"
      rc=$LAST_RC
      [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$rc" != 137 ] && [ "$rc" != 125 ] && MOUNT_FAILED=1
      rm -rf "$WORK/mnt-work/cache"
      scaling_summary
    fi
  done
fi

# -- the files that come back ----------------------------------------------------------------
say "packing results"
pack() {  # pack NAME DIR: DIR as OUT/NAME.tar.gz, the biggest files left out past 15 MiB
  local name=$1 dir=$2
  [ -d "$dir" ] || return 0
  tar -czf "$OUT/$name.tar.gz" -C "$(dirname "$dir")" "$(basename "$dir")" 2>/dev/null
  if [ "$(stat -c %s "$OUT/$name.tar.gz")" -gt $(( 15 << 20 )) ]; then
    tar -czf "$OUT/$name.tar.gz" -C "$(dirname "$dir")" --exclude='logs' \
      "$(basename "$dir")" 2>/dev/null
    say "$name.tar.gz: logs left out (over 15 MiB)"
  fi
}
pack train "$WORK/train"
pack scaling "$WORK/scaling"
timeout 30 "$PY" - "$WORK" "$OUT" "$BUDGET" "$T0" <<'PYEOF' || say "run.json failed"
import json, sys, time
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
parts = [dict(zip(("part", "status", "seconds", "detail"), line.split("\t"), strict=True))
         for line in (work / "parts.tsv").read_text().splitlines() if line]
try:
    pre = json.loads((work / "preflight.json").read_text())
except (OSError, ValueError) as exc:
    pre = f"no preflight results ({exc})"
doc = {"preflight": pre, "parts": parts,
       "budget_s": int(sys.argv[3]), "runtime_s": round(time.time() - int(sys.argv[4]))}
(out / "run.json").write_text(json.dumps(doc, indent=1) + "\n")
print("  " + "\n  ".join(f"{p['part']:26} {p['status']:8} {p['seconds']:>4}s {p['detail']}"
                          for p in parts))
PYEOF
unmount_work
say "finished in $(( $(date +%s) - T0 ))s; files in $OUT:"
ls -la "$OUT"
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit 0
