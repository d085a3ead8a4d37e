"""The training benchmark (``spokefs bench train`` / ``seed``): how well does a real PyTorch
DataLoader loop keep an emulated accelerator busy when the data is a 60 ms link away?

Layout: ``datasets`` (synthetic data, cached), ``openers`` (how a sample is read),
``loop`` (DataLoader + emulated accelerator), ``metrics`` (sans-I/O figures), ``scenarios``
(local, remote, spoke, staged, peers), ``plots``, ``run`` (the whole experiment).
Definitions: docs/benchmark.md.
"""

from spokefs_bench.training.run import TrainConfig, run_seed, run_train, seed_config

__all__ = ["TrainConfig", "run_seed", "run_train", "seed_config"]
