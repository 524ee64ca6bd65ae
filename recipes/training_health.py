"""Training health: which rank went bad, at which step, and how, in one line, before it costs a day.

    torchrun --standalone --nproc_per_node=2 -m recipes.training_health
    torchrun --standalone --nproc_per_node=2 -m recipes.training_health --on-nonfinite skip
    torchrun --standalone --nproc_per_node=2 -m recipes.training_health --check-every 2

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/options.py (the command line, from the config).

DDP's loop (recipes/ddp_torchrun.py) with ``TrainingHealth``'s checks composed into it:

- NaN/inf: every step ONE all-reduce (MAX) of one int64 says whether a rank's loss, its own
  gradients (read in a DDP comm hook, before the average spreads a NaN to every rank) or the
  weights the step started from went bad, and the first rank that did. Every rank then raises the
  same one-line ``NonFiniteError`` (rank, step, loss / gradient / parameter, the batch's sample
  indices) or, with ``--on-nonfinite skip``, every rank skips the optimizer step.
- Stragglers: each rank times its own work per step, its waits for the others left out; every
  ``--check-every`` steps one all_gather; rank 0 prints the slowest ranks and names any slower
  than ``--straggler-ratio`` times the median rank.
- Replicas that silently diverge: every ``--check-every`` steps one all_gather of an exact
  checksum per parameter; ``ReplicaDivergenceError`` names the rank and the first parameter.
- Gradient-norm spikes: the averaged gradients' norm (equal on every rank: no collective) above
  its running mean + k sigma is logged with its step.
- Orphans: torchrun starts each worker in a session of its own, so a killed agent (the OOM
  killer) leaves them running; here a rank whose agent is gone exits within a second or two.

A world that hangs is recipes/hang_diagnosis.py's subject. This file injects no faults:
tests/test_training_health.py does, from outside.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import get_total_norm
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class HealthConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(8, "optimizer steps", at_least=1)
    global_batch_size: int = option(12, "sequences per step, summed over all ranks", at_least=1)
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    on_nonfinite: str = option(
        "stop", "stop: every rank raises; skip: every rank skips the step", choices=["stop", "skip"]
    )
    check_every: int = option(4, "steps between two straggler and replica checks", at_least=1)
    straggler_ratio: float = option(2.0, "warn when a rank works this x the median rank", above=1)
    spike_sigma: float = option(
        6.0, "a gradient norm above mean + this x sigma is a spike", above=0
    )
    spike_warmup: int = option(4, "steps of gradient norms before spikes are judged", at_least=2)
    watch_launcher: bool = option(True, "under torchrun: exit when torchrun's agent is gone")
    seed: int = option(0, "model init and data order, the same on every rank", at_least=0)
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.check_every > self.steps:
            raise ValueError(
                f"check_every={self.check_every} is more than steps={self.steps}: the straggler "
                f"and replica checks would never run; use check_every <= {self.steps}"
            )


# --8<-- [start:health]
class NonFiniteError(RuntimeError):
    """A NaN or inf, named in one line: the first bad rank, the step, what went bad, the batch."""

    def __init__(self, *, rank: int, step: int, what: str, name: str | None, samples: list[int]):
        self.rank, self.step, self.what, self.name, self.samples = rank, step, what, name, samples
        which = f" {name!r}" if name else ""
        super().__init__(
            f"non-finite {what}{which} on rank {rank} at step {step}, samples {samples}"
        )


class ReplicaDivergenceError(RuntimeError):
    """Replicas that should hold the same weights do not; one line naming the rank and parameter."""


WHAT = ("", "gradient", "loss", "parameter")  # a flag's kind; higher wins: the cause before effects
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TrainingHealth:
    """The checks, for a DDP model (one comm hook is registered on it at construction)."""

    def __init__(
        self, ddp_model: DDP, *, straggler_ratio: float, spike_sigma: float, spike_warmup: int
    ):
        self.ratio, self.sigma, self.warmup = straggler_ratio, spike_sigma, spike_warmup
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.names, self.params = zip(*ddp_model.module.named_parameters())
        self.device = self.params[0].device
        self.grads_finite = torch.ones((), dtype=torch.bool, device=self.device)
        self.work_ms, self.warnings, self.norms = [], [], (0, 0.0, 0.0)
        self.start = self.last_bucket = self._mark()
        ddp_model.register_comm_hook(None, self._comm_hook)

    def _comm_hook(self, state, bucket):
        # this rank's own gradients, before the average spreads a NaN to every rank
        self.grads_finite &= torch.isfinite(bucket.buffer()).all()
        self.last_bucket = self._mark()  # the last one: this rank's backward is done
        return allreduce_hook(state, bucket)  # then what DDP does without a hook

    def _mark(self):  # a point on the device's timeline (the host runs ahead of a GPU)
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.device.type == "cuda" else (end - start) * 1e3

    def warn(self, line: str) -> None:
        self.warnings.append(line)  # the same on every rank: decided from the same numbers
        if self.rank == 0:
            print(line, flush=True)

    def check_finite(self, step: int, loss, samples: torch.Tensor) -> NonFiniteError | None:
        """After backward: ONE all-reduce (MAX) of one int64 that encodes the worst kind and the
        lowest rank that has it. Returns the error (every rank the same), or None."""
        params = self.params
        weights_ok = torch.isfinite(get_total_norm(params))  # the weights this step started from
        bad = torch.stack([~self.grads_finite, ~torch.isfinite(loss.detach()), ~weights_ok])
        kind = (bad * torch.arange(1, 4, device=self.device)).max()  # WHAT[kind]: the worst
        flag = torch.where(kind > 0, kind * self.world + self.world - 1 - self.rank, 0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        code = int(flag)  # the step's one host sync
        self.work_ms.append(self._ms(self.start, self.last_bucket))
        self.grads_finite.fill_(True)
        self.start = self._mark()
        if code == 0:
            return None
        what, rank = WHAT[code // self.world], self.world - 1 - code % self.world
        # only now, and only on failure: the bad rank's parameter index and samples, to all
        # (a gradient: the averaged one, which has the bad rank's NaN on every rank now)
        tensors = {"parameter": params, "gradient": [p.grad for p in params]}.get(what, [])
        bad_ones = (i for i, t in enumerate(tensors) if t is not None and not t.isfinite().all())
        first = next(bad_ones, -1)
        details = torch.tensor([first, *samples.tolist()], device=self.device)
        dist.broadcast(details, src=rank)
        first, *sample_list = details.tolist()
        name = self.names[first] if first >= 0 else None
        return NonFiniteError(rank=rank, step=step, what=what, name=name, samples=sample_list)

    def check_grad_norm(self, step: int) -> float:
        """The averaged gradients' norm (equal on every rank: no collective) against the mean and
        deviation of the norms before it; a spike is logged and left out of the statistics."""
        norm = float(get_total_norm([p.grad for p in self.params if p.grad is not None]))
        count, mean, m2 = self.norms  # Welford's running mean and sum of squared deviations
        sigma = math.sqrt(m2 / (count - 1)) if count > 1 else 0.0
        if count >= self.warmup and norm > mean + self.sigma * sigma:
            self.warn(
                f"grad norm spike at step {step}: {norm:.4g} > mean {mean:.4g} + "
                f"{self.sigma:g} x sigma {sigma:.4g}"
            )
            return norm
        delta = norm - mean
        mean += delta / (count + 1)
        self.norms = (count + 1, mean, m2 + delta * (norm - mean))
        return norm

    def check_stragglers(self, step: int) -> list[int]:
        """ONE all_gather of every rank's work times since the last check; rank 0 prints the
        slowest ranks. Returns the ranks slower than ``straggler_ratio`` x the median rank."""
        mine = torch.tensor(self.work_ms, dtype=torch.float64, device=self.device)
        times = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(times, mine)
        self.work_ms, self.start = [], self._mark()
        medians = [float(t.median()) for t in times]
        typical = sorted(medians)[(self.world - 1) // 2]  # the median rank (the lower of two)
        slowest = sorted(range(self.world), key=lambda r: -medians[r])[:3]
        if self.rank == 0:  # a table of the slowest 3 ranks: min / median / max ms
            table = "; ".join(
                f"rank {r} {times[r].min():.1f} / {medians[r]:.1f} / {times[r].max():.1f}"
                for r in slowest
            )
            print(
                f"step {step} work ms over {len(mine)} steps, min / median / max: "
                f"median rank {typical:.1f}; {table}",
                flush=True,
            )
        slow = [r for r in range(self.world) if medians[r] > self.ratio * typical]
        for r in slow:
            self.warn(
                f"straggler at step {step}: rank {r} works {medians[r]:.1f} ms a step, "
                f"{medians[r] / typical:.1f}x the median rank's {typical:.1f} ms"
            )
        return slow

    def check_replicas(self, step: int) -> None:
        """ONE all_gather of an exact checksum per parameter (the integer sum of its bits: any
        reduction order gives the same sum); raises if a rank differs from the majority."""
        bits = [p.detach().reshape(-1).view(INT_OF_SIZE[p.element_size()]) for p in self.params]
        sums = torch.stack([b.sum(dtype=torch.int64) for b in bits])
        gathered = [torch.empty_like(sums) for _ in range(self.world)]
        dist.all_gather(gathered, sums)
        self.start = self._mark()
        rows = [tuple(g.tolist()) for g in gathered]
        majority = max(rows, key=rows.count)  # on a tie, the lowest rank's
        for rank, row in enumerate(rows):
            if row != majority:
                first = next(i for i, (a, b) in enumerate(zip(row, majority)) if a != b)
                raise ReplicaDivergenceError(
                    f"replicas diverged at step {step}: rank {rank}'s parameter "
                    f"{self.names[first]!r} differs from rank {rows.index(majority)}'s"
                )


def exit_when_launcher_dies(*, poll_s: float = 1.0) -> None:
    """Under torchrun, end this rank within ``poll_s`` once torchrun's agent is gone. torchrun
    starts each worker in a session of its own and sets no parent-death signal: a killed agent
    leaves its workers running (on a GPU, holding its memory). Not under torchrun: nothing."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    agent = os.getppid()

    def watch():
        while os.getppid() == agent:  # an orphan is adopted by init (or a subreaper)
            time.sleep(poll_s)
        rank = os.environ.get("RANK")
        print(f"rank {rank}: torchrun's agent (pid {agent}) is gone; exiting", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # from this thread: the main one may be blocked in a collective

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


# --8<-- [end:health]


@dataclass
class HealthRun:
    losses: list[float]  # the global batch's loss of each step (nan where skipped)
    skipped_steps: list[int]
    warnings: list[str]  # stragglers, spikes, skipped steps: the lines rank 0 printed


# --8<-- [start:train]
def train(cfg: HealthConfig, observer=None) -> HealthRun:
    """Train on this process's rank with the checks; every rank returns the same HealthRun."""
    if cfg.watch_launcher:
        exit_when_launcher_dies()
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, rank, world_size = world.device, world.rank, world.world_size
        local_rank = world.local_rank
        if cfg.global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across {world_size} "
                f"ranks; use a multiple of {world_size}"
            )
        use_cuda = device.type == "cuda"
        bf16 = use_cuda and torch.cuda.is_bf16_supported()

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
        # rank 0's weights at construction, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        model = DDP(model, device_ids=[local_rank] if use_cuda else None)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        health = TrainingHealth(  # registers its comm hook: before the first backward
            model,
            straggler_ratio=cfg.straggler_ratio,
            spike_sigma=cfg.spike_sigma,
            spike_warmup=cfg.spike_warmup,
        )
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
        # at step s is one process's batch s. drop_last keeps every global batch full.
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        # The loader's batches, named: the sampler's order is fixed by (seed, epoch), so a second
        # pass over the same batch sampler gives each batch's sample indices
        batches = BatchSampler(sampler, cfg.global_batch_size // world_size, drop_last=True)
        loader = DataLoader(dataset, batch_sampler=batches, pin_memory=use_cuda)

        losses, skipped, step, epoch = [], [], 0, 0
        while step < cfg.steps:
            # Pitfall: without set_epoch every epoch repeats the first epoch's order
            sampler.set_epoch(epoch)
            for samples, (inputs, targets) in zip(batches, loader):
                if step == cfg.steps:
                    break
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = lm_loss(model(inputs), targets)  # this rank's sequences' mean
                loss.backward()  # DDP averages the gradients; the comm hook checks this rank's
                # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks).
                # Averaged before the check: the check restarts the work clock, so no wait of
                # this step counts as this rank's work
                global_loss = loss.detach().float().clone()
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
                bad = health.check_finite(step, loss, torch.tensor(samples))  # one all-reduce
                if bad is None:
                    health.check_grad_norm(step)  # no collective
                    optimizer.step()  # every rank applies the same averaged gradient
                elif cfg.on_nonfinite == "skip" and bad.what != "parameter":
                    skipped.append(step)  # every rank skips: the replicas stay equal
                    health.warn(f"step {step} skipped: {bad}")
                else:  # every rank raises the same line; bad weights stop even under skip
                    raise bad
                losses.append(global_loss.item())
                if rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f}", flush=True)
                if observer:
                    observer.step_end(step, losses[-1])
                if (step + 1) % cfg.check_every == 0:  # two all_gathers every check_every steps
                    health.check_stragglers(step)
                    health.check_replicas(step)
                step += 1
            epoch += 1
        # --8<-- [end:loop]
        return HealthRun(losses, skipped, health.warnings)
    finally:
        cleanup_distributed()


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(HealthConfig, prog="python -m recipes.training_health", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), HealthConfig, argv)
    with exit_on_bad_input():  # a batch that does not divide: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
