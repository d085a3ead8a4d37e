"""The reference pages (docs/reference/*.md) are what scripts/gen-reference.py writes from
the code now: a flag, environment variable, chart value or metric added without
regenerating them fails here, with the command that fixes it."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "gen-reference.py"
REFERENCE = ROOT / "docs" / "reference"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_committed_pages_match_the_code(gen: ModuleType) -> None:
    want = gen.pages()
    stale = [name for name, text in want.items()
             if not (REFERENCE / name).exists() or (REFERENCE / name).read_text() != text]
    extra = sorted(p.name for p in REFERENCE.glob("*.md") if p.name not in want)
    assert not stale and not extra, (
        f"docs/reference is out of date with the code (stale: {stale}, not generated: "
        f"{extra}); regenerate it with `{gen.REGENERATE}` and commit the result")


def test_the_cli_page_lists_every_visible_command(gen: ModuleType) -> None:
    from spokefs.cli import build_parser

    page = gen.pages()["cli.md"]
    paths = [p for p, _, _ in gen._commands(build_parser())]
    assert ("spoke", "serve") in paths and ("mount",) in paths
    for path in paths:
        assert f"## spokefs {' '.join(path)}\n" in page, path
    assert "==SUPPRESS==" not in page and "## spokefs spoke _worker" not in page  # internal
    assert "--cache-size" in page and "--deadline" in page


def test_every_metric_defined_in_the_source_is_listed(gen: ModuleType) -> None:
    page = gen.pages()["metrics.md"]
    names = {m.name for m in gen.metrics_in_source()}
    # what the spoke's own module defines, read independently of the generator's parser
    spoke = (ROOT / "src" / "spokefs" / "spoke" / "metrics.py").read_text()
    assert set(re.findall(r'"(spokefs_[a-z0-9_]+)"', spoke)) <= names
    for name in names:
        assert f"`{name}`" in page, name


def test_every_chart_value_is_listed(gen: ModuleType) -> None:
    yaml = pytest.importorskip("yaml")
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "spokefs" / "values.yaml").read_text())
    page = gen.pages()["chart-values.md"]

    def leaves(node: object, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        if isinstance(node, dict) and node:
            return [p for k, v in node.items() for p in leaves(v, (*path, k))]
        return [path]

    for path in leaves(values, ()):
        # a flow mapping ({cpu: "2"}) is one row, its default the whole mapping
        names = [".".join(k.replace(".", "\\.") for k in path[:n])
                 for n in range(len(path), 0, -1)]
        listed = next((n for n in names if f"| `{n}` |" in page), None)
        assert listed, names[0]
        row = page.split(f"| `{listed}` |", 1)[1].split("\n", 1)[0]
        assert row.split("|")[0].strip(), f"{names[0]}: listed without its default"


def test_an_undescribed_environment_variable_stops_the_generator(
        gen: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(gen.ENV_VARS, "SPOKEFS_TOKEN")
    with pytest.raises(SystemExit, match="describe SPOKEFS_TOKEN"):
        gen.env_page()
