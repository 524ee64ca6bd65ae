"""Will it fit on 512 GPUs? A dry run of a pp x dp x tp layout in one CPU process, no GPU at all.

    python -m recipes.dry_run                  # 7b preset on pp 8 x dp 8 x tp 8 = 512 ranks
    python -m recipes.dry_run --model 70b --pp 8 --dp 8 --tp 8
    python -m recipes.dry_run --model tiny --world-size 8 --pp 2 --dp 2 --tp 2 --check-every-rank

A rank joins a world of 512 through torch's ``fake`` process-group backend (``FakeStore``; the
backend hallucinates every collective: right shapes, meaningless values), builds the 3-D DeviceMesh,
builds only its pipeline stage's layers on the ``meta`` device (shapes, no storage), applies tensor
parallel (``recipes.parallelize.apply_tp``) and then ``fully_shard`` over "dp"
(``recipes.parallelize.apply_fully_shard``) exactly as a real run would. What it then holds is read
off its DTensors' local shards. Per rank it reports:

- mesh coordinates and the layers of its stage;
- parameter bytes (measured on the meta shards), gradient bytes (fully_shard keeps fp32 gradients
  sharded like the parameters) and AdamW bytes: measured on real CPU storage for the
  representative rank of each stage (``to_empty``, one ``optimizer.step()``; the state tensors'
  local bytes, the 4-byte step counters left out as memory_estimate leaves them out);
- collectives per micro-batch, counted by ``CommDebugMode`` (a TorchDispatchMode) over one
  forward and backward on the fake backend. The step runs on a narrow twin of the model (same
  layers, heads and plan, width ``n_heads * 2``): the number and kind of collectives depend on the
  modules, not their width, and the full width would cost minutes of CPU. Pipeline send/recv are
  analytic (this recipe cuts stages but runs no schedule): one activation each way per micro-batch.

The bytes are checked against ``recipes.memory_estimate.model_state_per_rank``: a stage's
tensor-parallel share of parameters (counted from the model's shapes) under ZeRO-3 over dp ranks,
with the adam-fp32 layout (4 + 4 + 8 bytes per parameter: fully_shard keeps fp32 master shards).
Ranks that differ only in dp/tp coordinates hold the same bytes when every split is even, so each
kind of stage is probed once: the first, one middle stage (all middle stages hold the same
shapes), the last; ``--check-every-rank`` builds every rank and asserts it. Each probe runs in a
forked child: DTensor caches its redistribution plans keyed by mesh shape,
so a second fake world in one process would reuse the first one's process groups.

Not counted: activations, communication buffers, the framework's own memory (memory_estimate's
caveats). The fake backend exists since torch 2.1 (``torch.testing._internal``, a test utility).

Copy with it: recipes/toy.py (the model you replace with yours), recipes/parallelize.py (apply_tp,
apply_fully_shard: the layout under test), recipes/memory_estimate.py (the arithmetic each stage
is checked against: its model_state_per_rank, composed here, not reimplemented),
recipes/options.py (the command line, from the config).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from recipes.memory_estimate import LAYOUTS, model_state_per_rank
from recipes.options import check_options, config_parser, option, parse_config
from recipes.parallelize import apply_fully_shard, apply_tp, check_tp_fits, transformer_lm_plan
from recipes.toy import MODEL_PRESETS, Block, ModelConfig, TransformerLM

# Large shapes for the cookbook's GPT-style TransformerLM (MLP 4x, learned positions).
PRESETS: dict[str, ModelConfig] = {
    **MODEL_PRESETS,
    "7b": ModelConfig(vocab_size=32768, seq_len=4096, dim=4096, n_layers=32, n_heads=32),
    "70b": ModelConfig(vocab_size=32768, seq_len=4096, dim=8192, n_layers=80, n_heads=64),
}
FP32 = LAYOUTS["adam-fp32"]  # what fully_shard + AdamW hold: fp32 params, grads, m and v


class LayoutError(ValueError):
    """A layout that cannot exist: one line that names the fix."""


@dataclass
class DryRunConfig:
    model: str = option("7b", "model shape preset", choices=list(PRESETS))
    world_size: int = option(512, "ranks in the world (pp x dp x tp must equal it)", at_least=1)
    pp: int = option(8, "pipeline stages (must divide the layers)", at_least=1)
    dp: int = option(8, "data-parallel ranks that fully_shard each stage over", at_least=1)
    tp: int = option(
        8, "tensor-parallel ranks (must divide heads, MLP width, vocab, seq)", at_least=1
    )
    check_every_rank: bool = option(
        False, "build every rank's shard (meta) and assert it equals its stage's probe"
    )
    probe_timeout_s: float = option(
        300.0, "deadline in seconds for each stage's probe process", above=0
    )

    def __post_init__(self) -> None:
        check_options(self)  # the ranges and choices above: one line each
        # Checked before any probe starts: a layout that cannot exist costs no fork.
        check_layout(PRESETS[self.model], self.world_size, self.pp, self.dp, self.tp)


def check_layout(cfg: ModelConfig, world_size: int, pp: int, dp: int, tp: int) -> None:
    """One line naming the fix for a layout that cannot exist (tensor parallel's own refusal,
    TPPlanError, is a ValueError of one line too)."""
    if pp * dp * tp != world_size:
        raise LayoutError(
            f"pp {pp} x dp {dp} x tp {tp} = {pp * dp * tp}, not world_size "
            f"{world_size}; pick degrees whose product is {world_size}"
        )
    if cfg.n_layers % pp:
        fits = [n for n in range(1, cfg.n_layers + 1) if cfg.n_layers % n == 0]
        raise LayoutError(
            f"{cfg.n_layers} layers do not split into pp={pp} equal stages; use "
            f"pp in {', '.join(map(str, fits))}"
        )
    check_tp_fits(
        tp,
        n_heads=cfg.n_heads,
        mlp_width=cfg.mlp_ratio * cfg.dim,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
    )


# --8<-- [start:stage]
def build_stage(cfg: ModelConfig, stage: int, pp: int) -> TransformerLM:
    """Stage ``stage`` of ``pp``: its layer range; the embeddings on the first, the head on the
    last. Built on meta: a 70b stage costs no memory. Layer names keep their global index."""
    with torch.device("meta"):
        model = TransformerLM(cfg)
    per_stage = cfg.n_layers // pp
    for name in list(model.layers):
        if not stage * per_stage <= int(name) < (stage + 1) * per_stage:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = model.pos_embeddings = None
    if stage < pp - 1:
        model.norm = model.output = None
    return model


def parallelize_stage(model: TransformerLM, mesh) -> TransformerLM:
    """TP over mesh["tp"] first (the optimizer and fully_shard must see its DTensors), then
    fully_shard over mesh["dp"]: fully_shard shards the TP shards again on dim 0 (2-D DTensors)."""
    plan = {
        key: style
        for key, style in transformer_lm_plan().items()
        if key.startswith("layers.") or getattr(model, key.split(".")[0]) is not None
    }
    apply_tp(model, mesh["tp"], plan=plan)
    return apply_fully_shard(model, mesh["dp"], block_types=(Block,))


# --8<-- [end:stage]


def stage_params_per_tp_rank(cfg: ModelConfig, stage: int, pp: int, tp: int) -> int:
    """From the shapes alone: a stage's parameters on one TP rank (what fully_shard splits over dp).
    Split: q/k/v/o, MLP weights, w_in's bias, embeddings, head. Replicated: norms, w_out's bias."""
    dim, hidden = cfg.dim, cfg.mlp_ratio * cfg.dim
    block = (4 * dim * dim + 2 * dim * hidden + hidden) // tp + 2 * 2 * dim + dim
    total = block * (cfg.n_layers // pp)
    if stage == 0:
        total += (cfg.vocab_size + cfg.seq_len) * dim // tp
    if stage == pp - 1:
        total += 2 * dim + cfg.vocab_size * dim // tp
    return total


def local_bytes(tensors) -> int:
    return sum(getattr(t, "_local_tensor", t).nbytes for t in tensors)


COLLECTIVE_KINDS = (
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
)


def collective_kind(op: Any) -> str:
    name = str(op)
    return next((kind for key, kind in COLLECTIVE_KINDS if key in name), name)


# --8<-- [start:probe]
def probe_rank(
    cfg: ModelConfig, rank: int, world_size: int, pp: int, dp: int, tp: int, *, measure_step: bool
) -> dict[str, Any]:
    """Join a fake world as ``rank``, build and shard its stage, and read what it holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        stage, dp_rank, tp_rank = mesh.get_coordinate()
        model = parallelize_stage(build_stage(cfg, stage, pp), mesh)
        params = list(model.parameters())
        figures = {
            "rank": rank,
            "pp": stage,
            "dp": dp_rank,
            "tp": tp_rank,
            "layers": sorted(int(n) for n in model.layers),
            "param_bytes": local_bytes(params),
            "grad_bytes": local_bytes(params),
        }
        if not measure_step:
            return figures
        # Real storage for this rank's shards only (uninitialised: values do not matter).
        model.to_empty(device="cpu")
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.AdamW(model.parameters())
        optimizer.step()
        figures["optimizer_bytes"] = local_bytes(
            value
            for state in optimizer.state.values()
            for key, value in state.items()
            if key != "step"
        )
        figures["collectives"] = count_collectives(cfg, stage, pp, mesh)
        return figures
    finally:
        dist.destroy_process_group()


def count_collectives(cfg: ModelConfig, stage: int, pp: int, mesh) -> dict[str, int]:
    """One micro-batch's forward and backward on a narrow twin, under CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode

    tp = mesh["tp"].size()
    twin = ModelConfig(
        vocab_size=8 * tp,
        seq_len=2 * tp,
        dim=2 * cfg.n_heads,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        mlp_ratio=cfg.mlp_ratio,
    )
    model = parallelize_stage(build_stage(twin, stage, pp), mesh)
    model.to_empty(device="cpu")
    inputs = (
        torch.zeros(1, twin.seq_len, dtype=torch.long)
        if stage == 0
        else torch.zeros(1, twin.seq_len, twin.dim, requires_grad=True)
    )
    with CommDebugMode() as comm, warnings.catch_warnings():
        # fully_shard warns that the root returns a view, autograd that the input needs no grad:
        # both are true of this throwaway step and neither matters to the count.
        warnings.simplefilter("ignore", UserWarning)
        model(inputs).float().sum().backward()
    counts = Counter()
    for op, n in comm.get_comm_counts().items():
        counts[collective_kind(op)] += n
    # Pipeline p2p, analytic: activations forward to the next stage, their gradients back.
    counts["send"] += (stage < pp - 1) + (stage > 0)
    counts["recv"] += (stage > 0) + (stage < pp - 1)
    return dict(sorted((k, v) for k, v in counts.items() if v))


# --8<-- [end:probe]


def _probe_in_child(conn, *args, **kwargs) -> None:
    try:
        conn.send(("ok", probe_rank(*args, **kwargs)))
    except BaseException as exc:  # the parent raises it with the child's message
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def probe_in_fork(
    cfg: ModelConfig, rank: int, *layout: int, measure_step: bool, timeout_s: float
) -> dict[str, Any]:
    """A fresh fake world per probe: fork (torch is already imported; no world exists yet).

    On a CUDA host the probe is spawned instead, which imports torch again: once the parent has
    asked the CUDA runtime anything (even the device count), a forked child's CUDA calls fail with
    "initialization error" (seen on the H200)."""
    context = mp.get_context("spawn" if torch.cuda.is_available() else "fork")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(
        target=_probe_in_child,
        args=(child, cfg, rank, *layout),
        kwargs={"measure_step": measure_step},
        daemon=True,
    )
    process.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise RuntimeError(f"probe of rank {rank} passed its {timeout_s:.0f} s deadline")
        status, payload = parent.recv()
    finally:
        process.kill() if process.is_alive() else None
        process.join()
    if status != "ok":
        raise RuntimeError(f"probe of rank {rank} failed: {payload}")
    return payload


# --8<-- [start:dry_run]
def run(cfg: DryRunConfig) -> dict[str, Any]:
    """Probe each kind of stage, check it against memory_estimate; the report, JSON-able."""
    model_cfg, layout = PRESETS[cfg.model], (cfg.world_size, cfg.pp, cfg.dp, cfg.tp)
    stages, probes = [], {}
    for stage in range(cfg.pp):
        # Stages 1 .. pp-2 hold the same modules with the same shapes (only the layer indices
        # differ): one probe stands for all of them. --check-every-rank builds them all.
        kind = min(stage, 1) if stage < cfg.pp - 1 else "last"
        if kind not in probes:
            probes[kind] = probe_in_fork(
                model_cfg,
                stage * cfg.dp * cfg.tp,
                *layout,
                measure_step=True,
                timeout_s=cfg.probe_timeout_s,
            )
        per_stage = model_cfg.n_layers // cfg.pp
        probe = {
            **probes[kind],
            "pp": stage,
            "rank": stage * cfg.dp * cfg.tp,
            "layers": list(range(stage * per_stage, (stage + 1) * per_stage)),
        }
        psi = stage_params_per_tp_rank(model_cfg, stage, cfg.pp, cfg.tp)
        expected = model_state_per_rank(psi, cfg.dp, "zero3", FP32)["device"]
        probe["estimate"] = {
            k: expected[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")
        }
        probe["matches_estimate"] = all(probe[k] == v for k, v in probe["estimate"].items())
        probe["total_bytes"] = probe["param_bytes"] + probe["grad_bytes"] + probe["optimizer_bytes"]
        stages.append(probe)
    checked = 0
    if cfg.check_every_rank:
        for rank in range(cfg.world_size):
            got = probe_in_fork(
                model_cfg, rank, *layout, measure_step=False, timeout_s=cfg.probe_timeout_s
            )
            stage = stages[got["pp"]]
            if (got["param_bytes"], got["layers"]) != (stage["param_bytes"], stage["layers"]):
                raise AssertionError(
                    f"rank {rank} holds {got['param_bytes']} parameter bytes of "
                    f"layers {got['layers']}, its stage's probe "
                    f"{stage['param_bytes']} of {stage['layers']}"
                )
            checked += 1
    ranks = [
        {"rank": r, "pp": r // (cfg.dp * cfg.tp), "dp": r // cfg.tp % cfg.dp, "tp": r % cfg.tp}
        for r in range(cfg.world_size)
    ]
    worst = max(stages, key=lambda s: s["total_bytes"])
    return {
        "recipe": "dry_run",
        "model": cfg.model,
        "world_size": cfg.world_size,
        "layout": {"pp": cfg.pp, "dp": cfg.dp, "tp": cfg.tp},
        "stages": stages,
        "ranks": ranks,
        "ranks_checked": checked,
        "max_model_state_bytes": worst["total_bytes"],
        "all_match_estimate": all(s["matches_estimate"] for s in stages),
    }


# --8<-- [end:dry_run]


def format_table(cfg: DryRunConfig, stages: list[dict[str, Any]]) -> str:
    gib = 2.0**30
    lines = [
        f"{cfg.model} on pp {cfg.pp} x dp {cfg.dp} x tp {cfg.tp} = {cfg.world_size} ranks; "
        "model state per rank in GiB (activations come on top)",
        f"{'stage':>5} {'ranks':>11} {'params':>8} {'grads':>8} {'adamw':>8} {'total':>8}"
        "  collectives per micro-batch",
    ]
    per_stage = cfg.dp * cfg.tp
    for s in stages:
        ranks = f"{s['pp'] * per_stage}-{(s['pp'] + 1) * per_stage - 1}"
        comms = ", ".join(f"{k} {v}" for k, v in s["collectives"].items())
        lines.append(
            f"{s['pp']:>5} {ranks:>11} {s['param_bytes'] / gib:>8.3f} "
            f"{s['grad_bytes'] / gib:>8.3f} {s['optimizer_bytes'] / gib:>8.3f} "
            f"{s['total_bytes'] / gib:>8.3f}  {comms}"
        )
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    return config_parser(DryRunConfig, prog="python -m recipes.dry_run", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(make_parser(), DryRunConfig, argv)  # LayoutError, TPPlanError: exit 2
    report = run(cfg)
    print(format_table(cfg, report["stages"]))
    print(json.dumps(report), flush=True)  # the last stdout line: the report, for scripts
    return report


if __name__ == "__main__":
    main()
