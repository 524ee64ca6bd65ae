"""What the tests share: run a recipe in a spawned world, compare with the single-process run."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
import types

import pytest
import torch

from recipes.core import spawn as _spawn
from recipes.core.world import join_world
from tests.deadlines import scaled

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_DEVICES = torch.cuda.device_count() if torch.cuda.is_available() else 0

# Every distributed test runs on gloo; the NCCL variant runs where there is one GPU per rank.
BACKENDS = [
    "gloo",
    pytest.param(
        "nccl", marks=pytest.mark.skipif(CUDA_DEVICES == 0, reason="NCCL needs CUDA devices")
    ),
]


def require_world(backend: str, world_size: int) -> None:
    """Skip (with the reason) a world this machine cannot host."""
    if backend == "nccl" and CUDA_DEVICES < world_size:
        pytest.skip(
            f"NCCL with {world_size} ranks needs {world_size} CUDA devices, found {CUDA_DEVICES}"
        )


def spawn_world(fn, world_size: int, *args, deadline_s: float = 120.0, **kwargs):
    """``recipes.core.spawn.spawn_world`` with its deadline times the run's factor
    (tests/deadlines.py): the deadline catches a hung world, it does not time the machine."""
    return _spawn.spawn_world(fn, world_size, *args, deadline_s=scaled(deadline_s), **kwargs)


def in_one_world(train_fn, configs, backend: str = "gloo", timeout_s: float = 60.0):
    """Run several configs of a recipe in one world: one spawn instead of one per config."""
    with join_world(backend, timeout_s=timeout_s):
        return [train_fn(cfg) for cfg in configs]


def run_world(
    train_fn, world_size: int, configs, *, backend: str = "gloo", deadline_s: float = 120.0
):
    """Rank 0's results of ``train_fn`` over ``configs`` on a fresh spawned world."""
    require_world(backend, world_size)
    return spawn_world(
        in_one_world, world_size, train_fn, list(configs), backend, deadline_s=deadline_s
    )


@functools.cache
def single_process_reference(*, steps: int | None = None, keep_final_state: bool = True):
    """The DDP recipe on one process, fp32, measured by the harness (``prove``): computed once per
    test process (each xdist worker).

    It is what every parity test compares with; callers must not modify the result. ``steps=None``
    keeps the recipe's default (what a CLI run without --steps does).
    """
    from recipes import ddp_torchrun

    fields = {"steps": steps} if steps is not None else {}
    return run_alone(
        ddp_result if keep_final_state else ddp_result_only,
        ddp_torchrun.DDPConfig(precision="fp32", **fields),
    )


def ddp_result(cfg, *, keep_final_state: bool = True):
    """recipes.ddp_torchrun.train(cfg) measured by the harness: a RecipeResult with its final
    state (the copyable recipe itself returns its losses only). Module-level: spawn_world can
    pickle it."""
    from recipes import ddp_torchrun
    from recipes.core.observe import prove

    return prove(ddp_torchrun.train, cfg, name="ddp_torchrun", keep_final_state=keep_final_state)


def ddp_result_only(cfg):
    """``ddp_result`` without the final state."""
    return ddp_result(cfg, keep_final_state=False)


def tp_result(cfg, *, keep_final_state: bool = True):
    """recipes.tensor_parallel.train(cfg) measured by the harness, as ``ddp_result`` measures DDP:
    its RecipeResult with the full final state (all-gathered) and the split's figures in extras
    (recipes.core.observe.TensorParallelObserver). Module-level: spawn_world can pickle it."""
    from recipes import tensor_parallel
    from recipes.core.observe import prove

    return prove(
        tensor_parallel.train, cfg, name="tensor_parallel", keep_final_state=keep_final_state
    )


def tp_result_only(cfg):
    """``tp_result`` without the final state."""
    return tp_result(cfg, keep_final_state=False)


def fsdp2_result(cfg, *, keep_final_state: bool = True):
    """recipes.fsdp2.train(cfg) measured by the harness (``prove``; its extras come from
    ``recipes.core.observe.ShardedObserver``): a RecipeResult with the final state gathered to
    rank 0. Module-level: spawn_world can pickle it."""
    from recipes import fsdp2
    from recipes.core.observe import prove

    return prove(fsdp2.train, cfg, name="fsdp2", keep_final_state=keep_final_state)


def recipe_result(cfg, *, keep_final_state: bool = True, observer=None):
    """A copyable recipe's ``train(cfg)`` measured by the harness (``prove``), the recipe named by
    its config's module (``recipes.zero.ZeroConfig`` -> zero): a RecipeResult with its final state.

    ``extras["grad_norms"]``: every norm ``torch.nn.utils.clip_grad_norm_`` returned during the run
    (recorded from outside, around torch's function), where the recipe clipped. ``observer``: a
    test's own Observer (fault injection). Module-level: spawn_world can pickle it."""
    from recipes.core.observe import prove

    module = importlib.import_module(type(cfg).__module__)
    name = module.__name__.rsplit(".", 1)[-1]
    clip, norms = torch.nn.utils.clip_grad_norm_, []

    def recording_clip(*args, **kwargs):
        norm = clip(*args, **kwargs)
        norms.append(float(norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = recording_clip
    try:
        result = prove(
            module.train, cfg, name=name, keep_final_state=keep_final_state, observer=observer
        )
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
    if norms:
        result.extras["grad_norms"] = norms
    return result


def run_alone(train_fn, cfg):
    """The single-process reference: a world of 1 in this very process."""
    return train_fn(cfg)


def assert_states_close(actual: dict, expected: dict, *, atol: float, rtol: float = 0.0) -> None:
    assert actual.keys() == expected.keys(), (
        f"parameter names differ: {sorted(actual.keys() ^ expected.keys())}"
    )
    worst = max(
        (
            (name, (actual[name].float() - expected[name].float()).abs().max().item())
            for name in expected
        ),
        key=lambda item: item[1],
    )
    for name in expected:
        torch.testing.assert_close(
            actual[name].float(),
            expected[name].float(),
            atol=atol,
            rtol=rtol,
            msg=lambda m, name=name: f"{name}: {m} (largest difference: {worst})",
        )


def assert_losses_close(actual, expected, *, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=atol, rtol=0.0)


def run_cli(
    args: list[str], *, timeout_s: float = 120.0, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run a command from the repo root the way a user would; never waits longer than
    ``timeout_s`` times the run's factor (tests/deadlines.py).

    ``python -m recipes.<name> ...`` and ``python scripts/<name>.py ...`` run in a process forked
    from a server that has already imported torch (the one spawn_world starts ranks from): the
    same ``__main__``, arguments, environment, standard streams and exit status as a fresh
    interpreter, without its ~2 s of imports (on 2 cores, under load, most of a CLI test's time).
    torchrun (``torchrun ...`` or ``python -m torch.distributed.run ...``) runs its agent the same
    way, forked with torch imported (~1.5 s of CPU saved a launch); the workers it starts are
    fresh interpreters, so what a user's ranks import and run is still tested from scratch.
    Every other command starts as it is.
    """
    timeout_s = scaled(timeout_s)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("RANK", None)
    if len(args) >= 3 and args[:2] == [PYTHON, "-m"] and args[2].startswith("recipes."):
        return _run_module_forked(args, ("module", args[2]), args[3:], timeout_s, full_env)
    torchrun = (
        1
        if args[:1] == ["torchrun"]
        else 3
        if args[:3] == [PYTHON, "-m", "torch.distributed.run"]
        else 0
    )
    if torchrun:
        return _run_module_forked(
            args, ("module", "torch.distributed.run"), args[torchrun:], timeout_s, full_env
        )
    if len(args) >= 2 and args[0] == PYTHON and args[1].startswith("scripts/"):
        return _run_module_forked(args, ("path", args[1]), args[2:], timeout_s, full_env)
    return subprocess.run(
        args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s, env=full_env
    )


def _run_module_forked(
    args: list[str], target: tuple[str, str], argv: list[str], timeout_s: float, env: dict
) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="recipes-cli-") as out:
        proc = _spawn._rank_context().Process(target=_module_main, args=(target, argv, env, out))
        proc.start()
        proc.join(timeout_s)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(args, timeout_s)
        streams = [
            open(os.path.join(out, name), encoding="utf-8", errors="replace").read()
            for name in ("stdout", "stderr")
        ]
    return subprocess.CompletedProcess(args, proc.exitcode, *streams)


def _module_main(target: tuple[str, str], argv: list[str], env: dict, out: str) -> None:
    """What ``python -m module *argv`` (target ("module", name)) or ``python path *argv``
    (("path", path)) does, in a process that has imported torch already."""
    _spawn.freeze_inherited_objects()
    os.chdir(REPO_ROOT)
    os.environ.clear()
    os.environ.update(env)
    torch.distributed.set_debug_level_from_env()  # read at import, which the server did
    # the fds themselves: the ranks this command starts write to them too
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        opened = os.open(os.path.join(out, stream), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)
    kind, name = target
    # sys.path[0]: the current directory for -m, the script's directory for a path
    sys.path.insert(0, REPO_ROOT if kind == "module" else os.path.dirname(os.path.abspath(name)))
    sys.argv = [name, *argv]
    code = 0
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(name, run_name="__main__")
    except SystemExit as exit_:  # what the interpreter does with it
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: traceback and exit status 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def last_json(stdout: str) -> dict:
    """A recipe CLI's result: the last stdout line, one JSON object."""
    return json.loads(stdout.strip().splitlines()[-1])


def with_fields(cfg, **changes):
    return dataclasses.replace(cfg, **changes)


PYTHON = sys.executable


@functools.cache
def docs_hooks():
    """docs/hooks.py as a module: the code that renders the pages' generated sections."""
    spec = importlib.util.spec_from_file_location(
        "docs_hooks", os.path.join(REPO_ROOT, "docs", "hooks.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_training_loop(
    model, *, steps: int, global_batch_size: int, lr: float, seed: int, dataset=None
):
    """The textbook single-process loop, no wrapper of any kind: the reference a split or mixed run
    must equal.

    ``dataset``: another dataset than the shared synthetic one (e.g. ragged, with ignored targets).
    Returns (per-step losses, final parameters on CPU).
    """
    from recipes.core.state import full_state_on_cpu
    from recipes.core.workload import (
        build_model,
        distributed_loader,
        iterate_steps,
        lm_loss,
        make_dataset,
    )

    lm = build_model(model, seed=seed)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=lr)
    dataset = dataset if dataset is not None else make_dataset(model, global_batch_size, seed=seed)
    loader, sampler = distributed_loader(
        dataset, rank=0, world_size=1, per_rank_batch_size=global_batch_size, seed=seed
    )
    losses = []
    for _, (inputs, targets) in iterate_steps(loader, sampler, steps):
        loss = lm_loss(lm(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, full_state_on_cpu(lm)


# Why "about": FSDP pads each flat parameter (classic) or each parameter's dim 0 (fully_shard) to
# a multiple of N, and AdamW keeps a 4-byte scalar `step` per parameter tensor on every rank that
# holds a piece of it; fully_shard's optimizer state follows the unpadded shard, so a last rank
# can hold a row less. On the tiny model these stay far inside 10% + 4 KiB; a real bug (a full
# copy kept, a shard not freed) is off by a factor of N.
SLACK_BYTES = 4096


def assert_about_fraction(actual: int, ddp: int, n: int, what: str) -> None:
    """``actual`` is about 1/n of DDP's ``ddp`` bytes (within 10%, plus padding)."""
    expected = ddp / n
    assert expected * 0.9 <= actual <= expected * 1.1 + SLACK_BYTES, (
        f"{what}: {actual} bytes, expected about 1/{n} of DDP's {ddp} = {expected:.0f}"
    )


def run_pair(pair):
    """Lets one spawned world run several recipes: in_one_world calls this with each
    (train, config)."""
    train, cfg = pair
    return train(cfg)


def expected_tp_param_fraction(tp_size: int) -> float:
    """The cookbook's tiny model under transformer_lm_plan: norms and row-wise biases are
    replicated on every rank; every other parameter is split tp_size ways."""
    from recipes.core.workload import build_model

    model = build_model("tiny")
    replicated = sum(
        p.numel() for n, p in model.named_parameters() if "norm" in n or n.endswith("w_out.bias")
    )
    total = sum(p.numel() for p in model.parameters())
    return (replicated + (total - replicated) / tp_size) / total


def child_pids(parent_pid: int) -> list[int]:
    """The live child processes of ``parent_pid`` (from /proc: no psutil needed)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent_pid and fields[0] != "Z":
                children.append(int(entry))
    return children


def process_env(pid: int) -> dict[str, str]:
    """The environment a process started with ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().decode(errors="replace").split("\0")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in items if "=" in item)


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the worker with global ``rank`` among a torchrun agent's children."""
    for pid in child_pids(launcher_pid):
        if process_env(pid).get("RANK") == str(rank):
            return pid
    return None


# The token shards tests/test_data.py and tests/test_evaluation.py read: a corpus of a few hundred
# KB (the stdlib's first sources), a small vocab, small shards (several per split).
SMALL_SHARDS = dict(max_bytes=200_000, vocab_size=300, shard_tokens=20_000)


def small_shards(tmp_path_factory) -> str:
    """The folder of SMALL_SHARDS, prepared once per run (tests/once.py)."""
    from recipes import data
    from tests.once import once_per_run

    def prepare(folder) -> str:
        cfg = data.DataConfig(data_dir=str(folder / "shards"), **SMALL_SHARDS)
        data.prepare_shards(cfg)
        return cfg.data_dir

    return once_per_run(tmp_path_factory, "small-shards", prepare)


class LazyModule(types.ModuleType):
    """A module imported on first use: collecting the Lightning test modules imported lightning
    (with transformers and torchmetrics: ~8 s of CPU) in every xdist worker, although only the
    worker that runs them needs it."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attribute: str):
        # pytest asks each module attribute for ``__bases__`` (``issubclass`` in its unittest
        # plugin) while collecting: a dunder must not import the module
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self.__dict__["_lazy_name"]), attribute)


def lightning_missing() -> bool:
    """Whether the Lightning recipes cannot run here (found without importing lightning)."""
    return importlib.util.find_spec("lightning") is None


NEEDS_LIGHTNING = pytest.mark.skipif(
    lightning_missing(), reason="the Lightning recipes need lightning: pip install -e .[lightning]"
)
