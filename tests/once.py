"""Expensive set-up built once per test run, whatever the number of pytest-xdist workers.

pytest-xdist's documented pattern for a session fixture that runs once: the first worker to ask
takes a file lock in the run's shared temporary folder (the parent of every worker's basetemp),
builds, and leaves the value there (pickled) beside what it made; the others wait on the lock
and read it. A module-scoped fixture alone is set up once per worker that runs one of the
module's tests, and again whenever a worker goes back to the module after other tests: the copy
test's launch of every copy and the docs build each ran four times in one run so.

Every build is written to a ledger in the same folder; ``tests/cpu_accounting.py`` fails the run
when one name was built twice, and when any module- or session-scoped fixture that cost more than
10 s of CPU was set up twice.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

LEDGER = "once-ledger.jsonl"


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every worker of this run shares (the controller's basetemp), or this process's
    basetemp when there are no workers."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]
) -> Any:
    """``build(folder)``'s value, computed by the first worker that asks and read by the others.

    ``folder`` is empty and shared by the run: what ``build`` writes there stays for every test of
    the run (and goes with the run's basetemp). The value must pickle. A build that fails (or
    skips) fails (or skips) every test that asks, with the first worker's message, instead of
    being built again."""
    root = shared_root(tmp_path_factory) / "once"
    root.mkdir(exist_ok=True)
    folder, saved = root / name, root / f"{name}.pkl"
    with FileLock(str(root / f"{name}.lock")):
        if saved.exists():
            kind, value = pickle.loads(saved.read_bytes())
        else:
            folder.mkdir()
            started, cpu_before = time.monotonic(), _cpu_seconds()
            try:
                kind, value = "value", build(folder)
            except pytest.skip.Exception as skipped:
                kind, value = "skip", str(skipped.msg)
            except BaseException as exc:  # noqa: BLE001 - every asker must see the first failure
                kind, value = "error", f"{type(exc).__name__}: {exc}"
                _save(saved, kind, value, name, started, cpu_before, root)
                raise
            _save(saved, kind, value, name, started, cpu_before, root)
    if kind == "skip":
        pytest.skip(value)
    if kind == "error":
        pytest.fail(f"the shared set-up {name!r} failed in another test: {value}", pytrace=False)
    return value


def _save(
    saved: Path, kind: str, value: Any, name: str, started: float, cpu_before: float, root: Path
) -> None:
    saved.write_bytes(pickle.dumps((kind, value)))
    with open(root.parent / LEDGER, "a", encoding="utf-8") as ledger:
        ledger.write(
            json.dumps(
                {
                    "name": name,
                    "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                    "wall_s": round(time.monotonic() - started, 2),
                    "cpu_s": round(_cpu_seconds() - cpu_before, 2),
                }
            )
            + "\n"
        )


def _cpu_seconds() -> float:
    from tests.cpu_accounting import tree_cpu_seconds

    return tree_cpu_seconds()


def builds(root: Path) -> list[dict]:
    """What the ledger in ``root`` (a run's shared folder) records."""
    path = root / LEDGER
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
