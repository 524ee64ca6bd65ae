"""Ray Train as a second engine: the cookbook's train functions under Ray's TorchTrainer.

    python -m recipes.ray_train --recipe ddp_torchrun --workers 2 -- --steps 6
    python -m recipes.ray_train --recipe fsdp2 --workers 2 -- --steps 6 --backend gloo
    python -m recipes.ray_train --recipe job --workers 2 --max-failures 2 -- --steps 12
    python -m recipes.ray_train --recipe job --workers 16 --use-gpu --address auto \\
        --storage-path /shared/ray -- --out-dir /shared/runs/job    # on a Ray cluster

Copy with it: recipes/options.py (the command line, from the config) and the recipes it runs,
with their own sets: recipes/ddp_torchrun.py, recipes/fsdp2.py, recipes/toy.py,
recipes/dist_setup.py, recipes/job.py, recipes/_job_checkpoint.py, recipes/_checkpoint_store.py,
recipes/_job_model.py, recipes/data.py, recipes/evaluation.py, recipes/parallelize.py. Needs
``pip install 'ray[train]'``.

The flags before ``--`` are this file's (which recipe, how many workers, how many failures to
survive, which Ray cluster); those after it are the wrapped recipe's own, parsed by that recipe's
parser in the driver, so a bad one is that recipe's one-line error before Ray starts.

Where torchrun starts one process per rank and restarts them all when one dies
(``--max-restarts``), Ray Train starts one actor per rank (a *worker group*), placed by Ray's
scheduler on any node of the cluster that has a CPU (or a GPU) free, and restarts the whole group
when a worker dies (``FailureConfig(max_failures)``). The recipes run unchanged inside: Ray's
``TorchTrainer`` sets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and joins the process group itself before
the loop starts; ``setup_distributed`` uses that group as it finds it. A restarted group reruns
the loop from its start: the job resumes from the newest DCP checkpoint in its ``out_dir``, as
after a torchrun restart, so on several nodes that folder must be on storage every node sees.

Rank 0's result comes back to the driver through ``ray.train.report`` and is printed as one JSON
line. A ``ValueError`` in the workers (bad input every rank refuses) ends the run with that one
line and exit 2, instead of being retried as a failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch.distributed as dist

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config

RECIPES = ("ddp_torchrun", "fsdp2", "job")


@dataclass
class RayTrainConfig:
    recipe: str = option("ddp_torchrun", "the cookbook recipe to run", choices=list(RECIPES))
    workers: int = option(2, "training workers (ranks), one CPU or GPU each", at_least=1)
    use_gpu: bool = option(False, "a GPU per worker, NCCL (else a CPU each, gloo)")
    max_failures: int = option(2, "worker-group failures Ray restarts from (0: none)", at_least=0)
    address: str | None = option(
        None, "a running Ray cluster ('auto', or HEAD:6379); default: a local one for this run"
    )
    cpus: int | None = option(
        None, "CPUs the local cluster offers (default: this machine's)", at_least=1
    )
    storage_path: str | None = option(
        None,
        "Ray Train's run folder (rank 0's result); with --address a folder every node sees; "
        "default: a temporary folder, removed at the end",
    )
    timeout_s: int = option(300, "seconds a collective waits for its peers", at_least=1)
    ray_logs: bool = option(False, "show Ray's own logs (default: only what the ranks print)")

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.address is None and not self.use_gpu:
            cpus = self.cpus or os.cpu_count() or 1
            if self.workers > cpus:  # Ray would wait for CPUs that never come: refuse now
                raise ValueError(
                    f"workers={self.workers} needs {self.workers} CPUs (one a worker) and the "
                    f"local Ray cluster has {cpus}; use --workers {cpus} or fewer"
                )
        if self.address is not None and self.storage_path is None:
            raise ValueError(
                "--address needs --storage-path: a folder every node sees (NFS), where rank 0 "
                "reports its result, wherever Ray placed it"
            )


def recipe_train(name: str):
    """The wrapped recipe's ``train`` function."""
    if name == "job":
        from recipes import job

        return job.train
    if name == "fsdp2":
        from recipes import fsdp2

        return fsdp2.train
    from recipes import ddp_torchrun

    return ddp_torchrun.train


def recipe_config(name: str, argv: list[str]):
    """The wrapped recipe's config, from its own command line, by its own parser (a bad flag is
    that recipe's one-line error, exit 2)."""
    if name == "job":
        from recipes import job

        return job.parse_args(argv)
    if name == "fsdp2":
        from recipes import fsdp2

        return parse_config(fsdp2.make_parser(), fsdp2.FSDP2Config, argv)
    from recipes import ddp_torchrun

    return parse_config(ddp_torchrun.make_parser(), ddp_torchrun.DDPConfig, argv)


# What Ray Train runs on every worker: the recipe's train, then a report of rank 0's result.
# --8<-- [start:worker]
def train_loop_per_worker(config: dict) -> None:
    import ray.train

    # Pitfall: Ray Train starts each worker in a folder of its own (RAY_CHDIR_TO_TRIAL_DIR): the
    # recipes' relative paths (runs/job, data/job_shards) mean where the command was started
    os.chdir(config["cwd"])
    name = config["recipe"]
    if name == "ddp_torchrun":
        # ddp_torchrun joins the world itself, in the open (init_process_group, env://), as under
        # torchrun: Ray's group made first would make that a second init, which raises. Leave
        # it, and meet again on a fresh port (Ray's store on the old one goes down with it).
        port = [_free_port() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(port, src=0)
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(port[0])
    # (fsdp2 and the job call setup_distributed, which uses the group Ray made as it is)
    result, error = None, None
    try:
        result = recipe_train(name)(config["recipe_config"])
    except ValueError as exc:  # bad input, refused alike by every rank: not a failure to retry
        error = str(exc)
    # Every worker reports once (a report is a barrier); rank 0's metrics are the run's result.
    # Ray Train keeps metrics only with a checkpoint: an empty folder carries them.
    if ray.train.get_context().get_world_rank() == 0:
        with tempfile.TemporaryDirectory() as empty:
            checkpoint = ray.train.Checkpoint.from_directory(empty)
            ray.train.report({"result": result, "error": error}, checkpoint=checkpoint)
    else:
        ray.train.report({})


# --8<-- [end:worker]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# A local cluster for one run on a small machine: no spot-preemption watcher, no Prometheus
# metrics (no dashboard to show them), no usage report. Every Ray process inherits them; a value
# the caller set stays theirs.
# Pitfall: Ray starts its workers at niceness 15: beside anything else busy the ranks get almost
# no CPU and the run stalls. The training ranks run at the normal priority.
LOCAL_CLUSTER_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
}
# Quiet workers: the ranks' print() as it is (Ray Train's print patch sends it through its logger
# too: every line twice), and none of Ray Train's own INFO lines (one per report)
QUIET_WORKERS_ENV = {
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "0",
}


# --8<-- [start:train]
def train(cfg: RayTrainConfig, recipe_cfg=None) -> dict | list:
    """Run ``cfg.recipe``'s train function (with ``recipe_cfg``, default: its defaults) on
    ``cfg.workers`` Ray workers; returns rank 0's result."""
    defaults = recipe_config(cfg.recipe, [])
    recipe_cfg = defaults if recipe_cfg is None else recipe_cfg
    if type(recipe_cfg) is not type(defaults):
        raise ValueError(
            f"recipe {cfg.recipe} takes a {type(defaults).__name__}, "
            f"got {type(recipe_cfg).__name__}"
        )
    try:  # imported here: ray.train pulls in pandas and pyarrow, not needed to parse a command
        import ray
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        raise ValueError("ray_train needs Ray Train: pip install 'ray[train]'") from None
    quiet = dict(
        logging_level=logging.WARNING,  # the driver's
        logging_config=ray.LoggingConfig(log_level="ERROR"),  # every Ray process's
        runtime_env={"env_vars": QUIET_WORKERS_ENV},  # what the job's actors start with
    )
    temp = storage = None
    added = [name for name in LOCAL_CLUSTER_ENV if name not in os.environ]
    try:
        if cfg.address is None:  # a local cluster, for this run only
            os.environ.update({name: LOCAL_CLUSTER_ENV[name] for name in added})
            # Pitfall: Ray's sockets live under its temporary folder and a socket's path must
            # stay under 108 bytes: a short folder
            base = tempfile.gettempdir()
            temp = tempfile.mkdtemp(prefix="ray", dir=base if len(base) <= 40 else "/tmp")
            ray.init(
                num_cpus=cfg.cpus or os.cpu_count(),
                include_dashboard=False,
                _temp_dir=temp,
                **({} if cfg.ray_logs else quiet),
            )
        else:  # `ray start --head` ran on one node, `ray start --address=HEAD:6379` on the others
            ray.init(address=cfg.address, **({} if cfg.ray_logs else quiet))
        have = ray.cluster_resources().get("GPU" if cfg.use_gpu else "CPU", 0)
        if cfg.workers > have:  # else the trainer waits for resources that never come
            kind = "GPU" if cfg.use_gpu else "CPU"
            raise ValueError(
                f"workers={cfg.workers} needs {cfg.workers} {kind}s and the Ray cluster has "
                f"{have:g}; use --workers {int(have)} or fewer, or add nodes"
            )
        storage = cfg.storage_path or tempfile.mkdtemp(prefix="ray-train-")
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "recipe": cfg.recipe,
                "recipe_config": recipe_cfg,
                "cwd": os.getcwd(),
            },
            # one actor per rank, a CPU (or a GPU) each, placed by Ray anywhere in the cluster
            scaling_config=ScalingConfig(num_workers=cfg.workers, use_gpu=cfg.use_gpu),
            # Ray joins the workers' process group itself (init_process_group, env://)
            torch_config=TorchConfig(
                backend="nccl" if cfg.use_gpu else "gloo", timeout_s=cfg.timeout_s
            ),
            run_config=RunConfig(
                name=f"{cfg.recipe}-ray",
                storage_path=storage,
                # a worker that dies (its node lost, a SIGKILL): the whole group restarts, the
                # loop runs again and the job resumes from its own newest checkpoint
                failure_config=FailureConfig(max_failures=cfg.max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=1),
                logging_config=None if cfg.ray_logs else ray.train.LoggingConfig("WARNING"),
            ),
        )
        reported = trainer.fit().metrics  # raises once max_failures restarts failed too
        if reported["error"]:
            raise ValueError(reported["error"])
        return reported["result"]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for name in added:  # the caller's environment as it was
            os.environ.pop(name, None)
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
        if storage and not cfg.storage_path:
            shutil.rmtree(storage, ignore_errors=True)


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    parser = config_parser(RayTrainConfig, prog="python -m recipes.ray_train", doc=__doc__)
    parser.usage = "%(prog)s [options] -- [the recipe's own flags]"
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # ours before "--", the recipe's after
    cfg = parse_config(make_parser(), RayTrainConfig, argv[:cut])
    recipe_argv = argv[cut + 1 :]
    recipe_cfg = recipe_config(cfg.recipe, recipe_argv)  # the recipe's own parser: its errors
    with exit_on_bad_input():  # Ray missing, too few CPUs, a refusal from the workers: one line
        result = train(cfg, recipe_cfg)
    print(json.dumps({"ray": asdict(cfg), "config": asdict(recipe_cfg), "result": result}))


if __name__ == "__main__":
    main()
