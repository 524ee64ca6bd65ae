import gc
import multiprocessing.util
import os
import shutil
import sys
import tempfile

import pytest
import torch

from recipes.core import spawn
from tests import deadlines

# Spawned ranks inherit this: one thread per rank keeps a 2-core machine from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# The ranks unpickle functions of tests/helpers.py, which imports pytest: 0.07 s of CPU in each of
# the ~150 ranks of a run unless the fork server has it (tests.helpers itself is not preloaded:
# its CUDA device count must not run in the server that GPU ranks fork from).
spawn.preload_in_fork_server("pytest")


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist (-p no:xdist) there is no such hook
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one and a half test processes per CPU core (3 on 2 cores, 2 on one). A test
    here spends part of its time waiting (ranks starting up, timeouts it asserts, subprocesses),
    which a further worker fills; but each worker also costs ~12 s of CPU to start and collect.
    Measured on 2 cores (issue 30): 4 workers 705 CPU s in 369 s, 3 workers 634 CPU s in 332 s;
    one per core had left about 40% of the CPU idle. Again on 2026-11-28 (675 tests): 2 workers
    537 CPU s in 307 s (87% of the 2 cores busy), 3 workers 559 CPU s in 289 s (97%)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    return cores + max(1, cores // 2)


# Started first: each launches fresh interpreters (torchrun, two hosts, a browser) or waits out a
# timeout it asserts, for 15-60 s. Started last, one of them leaves a single worker running alone
# at the end of the run. (pytest-xdist hands out the xdist_group modules first, largest first,
# then the other tests in this order.)
LONG_FIRST = (
    "test_multinode",
    "test_elastic",
    "test_ddp_torchrun",
    "test_performance",
    "test_collect_results",
    "test_third_party_models",
    "test_hang_diagnosis",
    "test_recipes_index",
    "test_ddp_spawn",
    "test_collectives",
    "test_world",
    # Then the modules whose tests take 10-60 s of wall time in all and sort late by name: run in
    # name order, they were the run's last 30 s, with one or two workers left (2026-11-28).
    "test_job",
    "test_job_your_model",
    "test_preflight",
    "test_suite_hygiene",
    "test_troubleshooting",
    "test_hf_checkpoint",
    "test_standalone",
    "test_speed",
    "test_sharded_accumulation",
    "test_tensor_parallel",
)


HYGIENE_TEST = (
    "tests/test_suite_hygiene.py::test_a_representative_set_of_tests_leaves_no_temporary_file"
)


def _run_the_hygiene_set_once(config, items) -> None:
    """The hygiene test runs its representative tests in a pytest of its own, and fails unless
    each passes there. Where it is selected, they are not run a second time beside it (one is a
    torchrun launch: ~7 CPU s); they are reported as deselected. Selected without it (a run of
    their own file), they run as any test."""
    if not any(item.nodeid == HYGIENE_TEST for item in items):
        return
    from tests.test_suite_hygiene import REPRESENTATIVE

    inside = [item for item in items if item.nodeid in REPRESENTATIVE]
    if inside:
        items[:] = [item for item in items if item.nodeid not in REPRESENTATIVE]
        config.hook.pytest_deselected(items=inside)


# trylast: after -k and -m have deselected what they do, so that a representative test selected
# without the hygiene test still runs.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _run_the_hygiene_set_once(config, items)
    rank = {name: order for order, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
    # Every test's hard timeout (the ini's, or its own mark's) times the run's factor
    # (tests/deadlines.py): the limit catches a hang on a slow machine without failing a slow pass.
    factor = deadlines.time_factor()
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        base = float(marker.args[0]) if marker and marker.args else default
        if base > 0:
            item.add_marker(pytest.mark.timeout(base * factor), append=False)


def pytest_report_header(config):
    lines = [f"deadlines: x{deadlines.time_factor():.2f} ({deadlines.ENV}; tests/deadlines.py)"]
    if getattr(config, "_recipes_bytecode_variable", None) is not None:
        lines.append(f"bytecode: cached in __pycache__, {BYTECODE_VARIABLE} set aside for the run")
    return lines


@pytest.hookimpl(trylast=True)  # after pytest's tmp_path set-up, whose root must stay in /tmp
def pytest_configure(config):
    """The factor is settled (measured, or read and checked) before the workers start, so that
    they and every process they start share it. A bad value is one line and exit 4."""
    try:
        deadlines.time_factor()
    except deadlines.TimeFactorError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not hasattr(config, "workerinput"):  # the controller (or the one process without xdist)
        _private_temp_folder(config)
        _cache_bytecode(config)


# PYTHONDONTWRITEBYTECODE=1, which many container images set, makes every process of the run
# compile the cookbook's modules and rewrite the test modules again: each worker's collection,
# each fork server, each recipe a test starts as a command. Measured on 2 cores (2026-11-28): the
# default run spent 400-443 machine CPU s with it, 370-382 s without. For the run, and the
# processes it starts, Python writes its caches to __pycache__ (.gitignore lists it); the variable
# is back when the run ends.
BYTECODE_VARIABLE = "PYTHONDONTWRITEBYTECODE"


def _cache_bytecode(config) -> None:
    config._recipes_bytecode_variable = os.environ.pop(BYTECODE_VARIABLE, None)
    if config._recipes_bytecode_variable is not None:  # not `python -B`: the user's own choice
        sys.dont_write_bytecode = False


# Every temporary file of the run goes into one folder of its own, removed when the run ends:
# what tests, recipes, torchrun (torchelastic_*, pytorch-errorfile-*), multiprocessing (pymp-*)
# and the compiler (torchinductor_*) put in the temporary folder. Before, one run left a dozen
# such entries in /tmp. pytest's own tmp_path folders stay where pytest keeps them (its last 3
# runs, for a look after a failure): their root is settled before TMPDIR changes.
TEMP_PREFIX = "recipes-tests-"


def _private_temp_folder(config) -> None:
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        factory.getbasetemp()
    # This process's own multiprocessing folder (pymp-*) stays where it is: multiprocessing
    # removes it at exit, after this folder is gone (without xdist, this process runs the tests).
    multiprocessing.util.get_temp_dir()
    folder = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    config._recipes_temp_folder = (folder, os.environ.get("TMPDIR"))
    os.environ["TMPDIR"] = folder  # the workers and every process below them inherit it
    tempfile.tempdir = None  # re-read from TMPDIR by this process too


def pytest_unconfigure(config):
    bytecode_variable = getattr(config, "_recipes_bytecode_variable", None)
    if bytecode_variable is not None:
        os.environ[BYTECODE_VARIABLE] = bytecode_variable
    folder, before = getattr(config, "_recipes_temp_folder", (None, None))
    if folder is None:
        return
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    shutil.rmtree(folder, ignore_errors=True)


# The Hugging Face models the tests build in their ranks (tests/third_party.py, and tests that
# import transformers themselves): ~2.5 s of imports per rank otherwise, in a dozen worlds of the
# default run. The fork server imports them once (~3 s), where a collected test module uses them.
# Without transformers installed the server skips them (it ignores an ImportError).
HUGGING_FACE_MODELS = (
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
)


def pytest_collection_finish(session):
    """Before the first world starts: the fork server's Hugging Face imports, where a collected
    module needs them. Then, with torch, transformers, Lightning and every test module imported,
    put those objects (~420k) out of the garbage collector's reach: ``join_world`` collects before
    each in-process run, and a full collection over them costs ~0.3 s of CPU each time. Objects
    the tests create later are collected as before."""
    paths = {item.path for item in session.items}
    if any(word in path.read_text() for path in paths for word in ("transformers", "third_party")):
        spawn.preload_in_fork_server(*HUGGING_FACE_MODELS)
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """One full collection now, then everything out of the collector's reach: at exit pytest
    collects 5 times more to catch a ``__del__`` that raises (an "unraisable exception"), and each
    pass over this heap (torch, transformers, Lightning, and every object the tests left) cost
    ~0.3 s of CPU in each of the run's processes. What this collection finalises still reaches
    pytest's check: its hook is in place until the run ends."""
    gc.collect()
    gc.freeze()


# A world's variables that an in-process run may set in the test's own process: Lightning's
# Fabric and Trainer write MASTER_ADDR, MASTER_PORT, WORLD_SIZE and LOCAL_RANK into os.environ
# when they launch, even a world of 1. Left behind, a later test in the same worker would meet at
# that port and find it taken ("MASTER_PORT ... is already in use": 30 tests failed so).
WORLD_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
)


@pytest.fixture(autouse=True)
def _restore_world_variables():
    before = {name: os.environ.get(name) for name in WORLD_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# CPU seconds per test file, printed at the end of the run (tests/cpu_accounting.py).
from tests.cpu_accounting import pytest_addoption  # noqa: E402, F401
from tests.cpu_accounting import pytest_configure as _register_cpu_accounting  # noqa: E402


def pytest_sessionstart(session):
    _register_cpu_accounting(session.config)
