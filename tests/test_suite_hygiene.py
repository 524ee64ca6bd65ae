"""The suite leaves nothing behind: after a representative set of tests (a torchrun launch whose
agent is forked from the suite's preloaded server, a spawned world one of whose ranks dies), the
temporary folder holds nothing new.

What the run's processes write there goes into the run's own folder (tests/conftest.py), removed
when the run ends; this fails on what lands outside it or outlives it. (A recipe that forgot to
remove its own folder is not caught here: the run's folder takes it away.)

The set runs in a pytest of its own with a TMPDIR of its own (an empty folder, which every
tempfile call of its processes uses), so that what it would leave is told apart from what the
rest of this run, or anything else on the machine, is doing. Where this test is selected, the
representative tests run only here (tests/conftest.py deselects them beside it): it fails unless
each of them passes, so their own assertions still hold the run."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.deadlines import scaled
from tests.helpers import PYTHON, REPO_ROOT

REPRESENTATIVE = [
    # torchrun, its agent forked from the preloaded server (run_cli): its torchelastic_ log folder
    # and the workers' error files. (A default-run test: the slow profiling launch this used to be
    # cost 22 CPU s here against 14.)
    "tests/test_preflight.py::test_a_healthy_world_under_torchrun_passes_and_prints_the_table",
    # a world of the suite's harness (spawn_world) whose rank dies: the killed rank's files and
    # its fork server's. (It replaced ddp_spawn's bad-input test, which starts no process.)
    "tests/test_world.py::test_a_rank_that_dies_stops_the_world_and_is_named",
]


def test_a_representative_set_of_tests_leaves_no_temporary_file(tmp_path):
    # A short path: multiprocessing's fork server listens on a socket in TMPDIR, and a socket's
    # path must stay under 108 bytes (tmp_path is too deep for it). Removed below.
    temp, basetemp = Path(tempfile.mkdtemp(prefix="h", dir="/tmp")), tmp_path / "basetemp"
    try:
        check_leaves_nothing(temp, basetemp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def check_leaves_nothing(temp: Path, basetemp: Path) -> None:
    env = {**os.environ, "TMPDIR": str(temp), "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "pytest",
            "-p",
            "no:xdist",
            "-o",
            "addopts=-p no:cacheprovider",
            "-q",
            "--basetemp",
            str(basetemp),
            *REPRESENTATIVE,
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(240),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{len(REPRESENTATIVE)} passed" in proc.stdout, proc.stdout[-2000:]
    assert os.listdir(temp) == [], f"left in TMPDIR: {sorted(os.listdir(temp))}"
