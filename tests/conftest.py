from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from servers import ServerProcess, hub, make_dataset, spoke


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    return make_dataset(tmp_path / "ds")


@pytest.fixture
def hub_server(dataset: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    with hub(dataset, tmp_path / "hubstate") as h:
        yield h


@pytest.fixture
def spoke_server(hub_server: ServerProcess, tmp_path: Path) -> Iterator[ServerProcess]:
    with spoke(hub_server.url, tmp_path / "cache", "1GiB", "--deadline", "3s") as s:
        yield s


@pytest.fixture(scope="session")
def ro_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dataset shared by tests that only read (never modify it)."""
    return make_dataset(tmp_path_factory.mktemp("ro") / "ds")


@pytest.fixture(scope="session")
def ro_hub(ro_dataset: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    with hub(ro_dataset, tmp_path_factory.mktemp("ro-hubstate")) as h:
        yield h
