"""One rank of a torch.distributed.checkpoint save or load on CPU (gloo), for
test_ckpt_dcp.py: ``python dcp_worker.py save|load PATH`` (DCP's FileSystemWriter and
Reader on a folder) or ``save-fsspec|load-fsspec URL`` (its FsspecWriter and Reader on a
``spokefs://`` URL), with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Each rank
holds a tensor of its own and one they share; a load checks every tensor against what its
rank saved, and exits non-zero if one differs."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter


def state(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {f"rank{rank}.weight": torch.randn(256, 64, generator=g),
            "shared.bias": torch.arange(1000.0)}


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        want = state(rank)
        if mode == "save":
            dcp.save(want, storage_writer=dcp.FileSystemWriter(path))
            return 0
        if mode == "save-fsspec":
            dcp.save(want, storage_writer=FsspecWriter(path))
            return 0
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        reader = FsspecReader(path) if mode == "load-fsspec" else dcp.FileSystemReader(path)
        dcp.load(got, storage_reader=reader)
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        print(f"rank {rank}: loaded {sorted(got)}, differing {bad}", flush=True)
        return 1 if bad else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
