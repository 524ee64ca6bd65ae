"""Per-device model-state memory of DDP and ZeRO-1/2/3, with and without CPU offload: the ZeRO
paper's arithmetic.

    python -m recipes.memory_estimate --params 7.5e9 --world-size 64
    python -m recipes.memory_estimate --params 7e9 --world-size 8 --optimizer adam-fp32

Before choosing a sharding strategy, count. Model state is parameters + gradients + optimizer state;
with Adam it is 16 bytes per parameter whichever way it is split:

- mixed-precision Adam (the ZeRO paper's case): fp16/bf16 parameters (2) + fp16/bf16 gradients (2) +
  fp32 master parameters, momentum and variance (K = 12);
- plain fp32 Adam: fp32 parameters (4) + fp32 gradients (4) + momentum and variance (K = 8).

Each ZeRO stage shards one more of the three over the N data-parallel ranks (Rajbhandari et al.
2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sections 3 and 5),
with Psi parameters:

    DDP                  (2 + 2 + K) * Psi             every rank holds everything
    ZeRO-1   (P_os)      (2 + 2) * Psi + K * Psi / N   optimizer state sharded
    ZeRO-2   (P_os+g)    2 * Psi + (2 + K) * Psi / N   ... and gradients
    ZeRO-3   (P_os+g+p)  (2 + 2 + K) * Psi / N         ... and parameters

CPU offload moves what is sharded to host memory and leaves what is replicated on the device
(ZeRO-1/2 with DeepSpeed's offload_optimizer, i.e. ZeRO-Offload; ZeRO-3 with FSDP's CPUOffload or
fully_shard's CPUOffloadPolicy, where the device keeps no model state between uses). DDP has no
offload.

What the figures leave out, on purpose: activations (they depend on batch, sequence length and
activation checkpointing, not on the sharding), communication buffers (DDP's gradient buckets,
FSDP's all-gather of the one unit being computed), allocator fragmentation and the framework's own
few GB. Treat the result as the floor that the sharding decides, not a peak-memory prediction.
tests/test_memory_estimate.py checks the formulas on the paper's own example and against bytes
measured on a real 2-rank world (recipes.core.memory).

Pure arithmetic: no torch, no world. The last stdout line is the same figures as one JSON object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from recipes.core.config import Config, RecipeError, exit_with, opt, parse_config

__all__ = [
    "EstimateConfig",
    "LAYOUTS",
    "STAGES",
    "model_state_per_rank",
    "estimate",
    "format_table",
    "main",
]


@dataclass
class EstimateConfig(Config):
    params: float = opt(
        7.5e9, "number of model parameters (Psi); 7.5e9 is the ZeRO paper's example", gt=0
    )
    world_size: int = opt(64, "data-parallel ranks (N) the model state is sharded over", ge=1)
    optimizer: Literal["both", "adam-mixed", "adam-fp32"] = opt(
        "both",
        "adam-mixed: 2+2+12 bytes/param (fp16 params and grads, fp32 master+m+v); adam-fp32: 4+4+8",
    )
    unit: Literal["GB", "GiB"] = opt("GB", "GB = 1e9 bytes (the paper's unit), GiB = 2**30 bytes")


@dataclass(frozen=True)
class OptimizerLayout:
    """Bytes per parameter of each part of the model state."""

    description: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # the paper's K


LAYOUTS: dict[str, OptimizerLayout] = {
    "adam-mixed": OptimizerLayout(
        "mixed-precision Adam: fp16 params + fp16 grads + fp32 master, momentum, variance",
        param_bytes=2,
        grad_bytes=2,
        optimizer_bytes=12,
    ),
    "adam-fp32": OptimizerLayout(
        "fp32 Adam: fp32 params + fp32 grads + momentum, variance",
        param_bytes=4,
        grad_bytes=4,
        optimizer_bytes=8,
    ),
}

UNITS = {"GB": 1e9, "GiB": 2.0**30}


@dataclass(frozen=True)
class Stage:
    label: str
    shards: tuple[str, ...]  # which parts are divided by N
    setting: str  # what to write in PyTorch / Lightning / DeepSpeed to get it
    offload_setting: str  # ... and with CPU offload ("" = not offered)


# --8<-- [start:stages]
STAGES: dict[str, Stage] = {
    "ddp": Stage("DDP", (), "DistributedDataParallel; Lightning strategy='ddp'", ""),
    "zero1": Stage(
        "ZeRO-1 (P_os)",
        ("optimizer",),
        "DDP + ZeroRedundancyOptimizer; DeepSpeed stage 1; Lightning strategy='deepspeed_stage_1'",
        "DeepSpeed stage 1 + offload_optimizer (ZeRO-Offload)",
    ),
    "zero2": Stage(
        "ZeRO-2 (P_os+g)",
        ("optimizer", "grad"),
        "FSDP ShardingStrategy.SHARD_GRAD_OP; fully_shard(reshard_after_forward=False); "
        "Lightning FSDPStrategy(sharding_strategy='SHARD_GRAD_OP'); DeepSpeed stage 2",
        "DeepSpeed stage 2 + offload_optimizer (ZeRO-Offload); Lightning "
        "strategy='deepspeed_stage_2_offload'",
    ),
    "zero3": Stage(
        "ZeRO-3 (P_os+g+p)",
        ("optimizer", "grad", "param"),
        "FSDP ShardingStrategy.FULL_SHARD; fully_shard(reshard_after_forward=True); "
        "Lightning FSDPStrategy(sharding_strategy='FULL_SHARD'); DeepSpeed stage 3",
        "FSDP CPUOffload(offload_params=True); fully_shard(offload_policy=CPUOffloadPolicy()); "
        "Lightning FSDPStrategy(cpu_offload=True); DeepSpeed stage 3 + "
        "offload_param/offload_optimizer",
    ),
}


def model_state_per_rank(
    params: float, world_size: int, stage: str, layout: OptimizerLayout, *, offload: bool = False
) -> dict[str, dict[str, float]]:
    """Bytes of params / grads / optimizer state one rank holds, on the device and (offloaded) on
    the host.

    The ZeRO paper's rule: a part that the stage shards costs bytes_per_param * Psi / N on each
    rank, a part it does not shard costs bytes_per_param * Psi. Offload moves the sharded parts to
    the host.
    """
    spec = STAGES[stage]
    if offload and not spec.offload_setting:
        raise RecipeError(
            f"{spec.label} has no CPU offload; offload exists for ZeRO-1, ZeRO-2 and ZeRO-3"
        )
    device = {"param_bytes": 0.0, "grad_bytes": 0.0, "optimizer_bytes": 0.0}
    host = dict(device)
    for part, per_param in (
        ("param", layout.param_bytes),
        ("grad", layout.grad_bytes),
        ("optimizer", layout.optimizer_bytes),
    ):
        sharded = part in spec.shards
        nbytes = per_param * params / world_size if sharded else per_param * params
        (host if offload and sharded else device)[f"{part}_bytes"] = nbytes
    device["total_bytes"] = sum(device.values())
    host["total_bytes"] = sum(host.values())
    return {"device": device, "host": host}
# --8<-- [end:stages]


def estimate(cfg: EstimateConfig) -> dict[str, Any]:
    """Every (optimizer layout, stage, offload) row, as one JSON-able dict."""
    layouts = list(LAYOUTS) if cfg.optimizer == "both" else [cfg.optimizer]
    rows = []
    for layout_name in layouts:
        for stage_name, stage in STAGES.items():
            for offload in (False, True):
                if offload and not stage.offload_setting:
                    continue
                figures = model_state_per_rank(
                    cfg.params, cfg.world_size, stage_name, LAYOUTS[layout_name], offload=offload
                )
                rows.append(
                    {
                        "optimizer": layout_name,
                        "stage": stage_name,
                        "offload": offload,
                        "setting": stage.offload_setting if offload else stage.setting,
                        **figures,
                    }
                )
    return {
        "recipe": "memory_estimate",
        "params": cfg.params,
        "world_size": cfg.world_size,
        "layouts": {name: vars(LAYOUTS[name]) for name in layouts},
        "rows": rows,
    }


def format_table(result: dict[str, Any], unit: str = "GB") -> str:
    """The human-readable table: one block per optimizer layout, one line per stage, then the
    settings."""
    scale = UNITS[unit]
    lines = [
        (f"Model-state memory per rank: {result['params']:.4g} parameters, {result['world_size']} "
        "data-parallel "
        f"ranks, in {unit} ({scale:.0f} bytes). Activations and buffers come on top.")
    ]
    header = f"{'strategy':<28}{'params':>9}{'grads':>9}{'optim':>9}{'device':>10}{'host':>9}"
    for layout_name, layout in result["layouts"].items():
        lines += [
            "",
            (f"{layout_name}: {layout['description']} "
            f"({layout['param_bytes']}+{layout['grad_bytes']}+{layout['optimizer_bytes']} "
            "bytes/param)"),
            header,
            "-" * len(header),
        ]
        for row in (r for r in result["rows"] if r["optimizer"] == layout_name):
            device, host = row["device"], row["host"]
            # Each part is shown where it lives; "h" marks a part held in host memory.
            cells = [
                f"{(device[k] or host[k]) / scale:.2f}{'h' if host[k] else ' '}"
                for k in ("param_bytes", "grad_bytes", "optimizer_bytes")
            ]
            lines.append(
                f"{_label(row):<28}{cells[0]:>9}{cells[1]:>9}{cells[2]:>9}"
                f"{device['total_bytes'] / scale:>9.2f} {host['total_bytes'] / scale:>8.2f}"
            )
    lines += [
        "",
        "h = held in host (CPU) memory. device / host = the rank's total on each.",
        "",
        "Which setting gives each row:",
    ]
    for row in result["rows"]:
        if row["optimizer"] == next(iter(result["layouts"])):
            lines.append(f"  {_label(row):<30}{row['setting']}")
    return "\n".join(lines)


def _label(row: dict[str, Any]) -> str:
    return STAGES[row["stage"]].label + (" + offload" if row["offload"] else "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(EstimateConfig, argv, (__doc__ or "").strip().split("\n\n")[0])
    try:
        result = estimate(cfg)
    except RecipeError as exc:
        exit_with(str(exc))
    print(format_table(result, cfg.unit))
    print(json.dumps(result), flush=True)  # like every recipe: the last stdout line is the JSON
    return result


if __name__ == "__main__":
    main()
