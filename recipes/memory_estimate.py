"""Per-device model-state memory of DDP and ZeRO-1/2/3, with and without CPU offload: the ZeRO
paper's arithmetic; and one strategy's bytes per GPU, activations included, against the GPU.

    python -m recipes.memory_estimate --params 7.5e9 --world-size 64
    python -m recipes.memory_estimate --params 7e9 --world-size 8 --optimizer adam-fp32
    python -m recipes.memory_estimate --model llama3-70b --world-size 16 --tp 4 --pp 2 \\
        --strategy zero3 --seq-len 8192 --checkpointing full --gpu-memory-gib 80

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

The per-GPU figure (`gpu_memory`, the docs' calculator) takes one strategy and adds, per GPU:
tensor parallelism over `tp` ranks and pipeline stages over `pp` ranks divide the parameters first
(`params / (tp * pp)` on each, the embeddings assumed split like the rest), then the stage shards
that over the data-parallel ranks (`world_size`; HSDP: over `shard_size` of them, replicated across
the groups). Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", section 4), per layer and micro-batch, for 16-bit activations:

    no TP                    s*b*h * (34 + 5*a*s/h)
    TP over t ranks          s*b*h * (10 + 24/t + 5*a*s/(h*t))
    TP + sequence parallel   s*b*h * (34/t + 5*a*s/(h*t))
    flash attention or selective recomputation: the 5*a*s/(h*t) term (the s x s scores) is gone
    full recomputation: 2*s*b*h (/t with sequence parallel) per layer, plus one layer's full
    activations while it is recomputed

with s the sequence length, b the micro-batch, h the hidden size, a the heads; fp32 activations
cost twice as much. The logits the loss reads add 4*s*b*V/t (fp32). Under 1F1B the first stage
holds pp micro-batches of its L/pp layers, the last stage one micro-batch plus the logits: the
figure is the larger of the two.

What the figures leave out, on purpose: communication buffers (DDP's gradient buckets,
FSDP's all-gather of the one unit being computed), allocator fragmentation and the framework's own
few GB. Treat the result as the floor that the sharding decides, not a peak-memory prediction.
tests/test_memory_estimate.py checks the formulas on the paper's own example and against bytes
measured on a real 2-rank world.

Copy with it: recipes/options.py (the command line, from the config). Pure arithmetic on the
standard library: no torch, no world. The last stdout line is the same figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config

__all__ = [
    "EstimateConfig",
    "EstimateError",
    "LAYOUTS",
    "MODEL_PRESETS",
    "PRECISIONS",
    "STAGES",
    "activation_bytes",
    "gpu_memory",
    "model_state_per_rank",
    "estimate",
    "format_table",
    "make_parser",
    "main",
]


class EstimateError(ValueError):
    """Input the arithmetic cannot take: one line that names the option and the fix."""


# Published shapes (params, layers L, hidden h, heads a, vocab V): 100m is recipes.toy's benchmark
# model; the others from their configs (GPT-2 XL; Llama 2 13B; Llama 3.1 8B/70B/405B).
MODEL_PRESETS: dict[str, dict[str, float]] = {
    "100m": dict(params=110_578_176, layers=12, hidden=768, heads=12, vocab=16384),
    "gpt2-xl": dict(params=1.558e9, layers=48, hidden=1600, heads=25, vocab=50257),
    "llama3-8b": dict(params=8.03e9, layers=32, hidden=4096, heads=32, vocab=128256),
    "llama2-13b": dict(params=13.0e9, layers=40, hidden=5120, heads=40, vocab=32000),
    "llama3-70b": dict(params=70.6e9, layers=80, hidden=8192, heads=64, vocab=128256),
    "llama3-405b": dict(params=405.9e9, layers=126, hidden=16384, heads=128, vocab=128256),
}


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
# precision -> (model-state layout, bytes per activation element)
PRECISIONS: dict[str, tuple[str, int]] = {
    "mixed": ("adam-mixed", 2),
    "autocast": ("adam-fp32", 2),
    "fp32": ("adam-fp32", 4),
}


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
        raise EstimateError(
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


# Two help texts too long for a field's line (the API reference shows each field's default)
_STRATEGY_HELP = (
    "per-GPU figure: zero3 = FSDP FULL_SHARD, zero2 = SHARD_GRAD_OP, hsdp = ZeRO-3 "
    "over shard_size ranks, replicated across the groups"
)
_PRECISION_HELP = (
    "per-GPU figure: mixed = 2+2+12 bytes/param, bf16 activations; autocast = "
    "fp32 params (4+4+8), bf16 activations; fp32 = 4+4+8, fp32 activations"
)


@dataclass
class EstimateConfig:
    params: float = option(
        7.5e9, "number of model parameters (Psi); 7.5e9 is the ZeRO paper's example", above=0
    )
    world_size: int = option(
        64, "data-parallel ranks (N) the model state is sharded over", at_least=1
    )
    optimizer: str = option(
        "both",
        "adam-mixed: 2+2+12 bytes/param (fp16 params and grads, fp32 master+m+v); adam-fp32: 4+4+8",
        choices=["both", *LAYOUTS],
    )
    unit: str = option(
        "GB", "GB = 1e9 bytes (the paper's unit), GiB = 2**30 bytes", choices=list(UNITS)
    )
    # The per-GPU figure of one strategy (gpu_memory; the docs' calculator asks the same).
    model: str = option(
        "custom",
        "a preset sets params, layers, hidden, heads and vocab (custom: the options)",
        choices=["custom", *MODEL_PRESETS],
    )
    layers: int = option(32, "transformer layers (L)", at_least=1)
    hidden: int = option(4096, "hidden size (h)", at_least=1)
    heads: int = option(32, "attention heads (a)", at_least=1)
    vocab: int = option(32000, "vocabulary size (V)", at_least=1)
    strategy: str = option("zero3", _STRATEGY_HELP, choices=[*STAGES, "hsdp"])
    shard_size: int = option(8, "hsdp only: data-parallel ranks in one sharding group", at_least=1)
    offload: bool = option(False, "per-GPU figure: CPU offload of the sharded parts (not for ddp)")
    tp: int = option(1, "tensor-parallel degree (t); GPUs = world_size * tp * pp", at_least=1)
    pp: int = option(1, "pipeline-parallel degree (stages, 1F1B schedule)", at_least=1)
    sequence_parallel: bool = option(
        True, "with tp > 1: norms and dropout sharded over the sequence"
    )
    precision: str = option("mixed", _PRECISION_HELP, choices=list(PRECISIONS))
    seq_len: int = option(4096, "sequence length (s)", at_least=1)
    micro_batch: int = option(1, "sequences per micro-batch on each GPU (b)", at_least=1)
    checkpointing: str = option(
        "none",
        "activation checkpointing: selective recomputes attention, full keeps layer inputs",
        choices=["none", "selective", "full"],
    )
    flash_attention: bool = option(True, "SDPA/flash attention: no s x s scores stored")
    gpu_memory_gib: float = option(80.0, "memory of one GPU in GiB (24, 40, 80, 141, ...)", above=0)

    def __post_init__(self) -> None:
        # Checked here, not only on the command line: a caller in Python gets the same one line
        # (nan parameters once printed a table of nan).
        try:
            check_options(self)  # the ranges and choices above
        except ValueError as exc:
            raise EstimateError(str(exc)) from None
        if self.model != "custom":  # the preset's shape wins over the single options
            for name, value in MODEL_PRESETS[self.model].items():
                setattr(self, name, value)
        for name, divisor in (("layers", "pp"), ("heads", "tp")):
            if getattr(self, name) % getattr(self, divisor):
                raise EstimateError(
                    f"{name}={getattr(self, name)} must divide by {divisor}="
                    f"{getattr(self, divisor)}; pick a {divisor} that divides it"
                )
        if self.strategy == "hsdp" and self.world_size % self.shard_size:
            raise EstimateError(
                f"shard_size={self.shard_size} must divide world_size={self.world_size} "
                "(hsdp replicates whole sharding groups)"
            )
        if self.offload and self.strategy == "ddp":
            raise EstimateError("DDP has no CPU offload; use --no-offload or a zero strategy")


# --8<-- [start:activations]
def activation_bytes(cfg: EstimateConfig) -> float:
    """Peak activation bytes on one GPU for one micro-batch in flight per stage under 1F1B
    (Korthikanti et al. 2022, section 4; see the module docstring)."""
    s, b, h, a, t = cfg.seq_len, cfg.micro_batch, cfg.hidden, cfg.heads, cfg.tp
    scale = PRECISIONS[cfg.precision][1] / 2  # the paper counts 16-bit activations
    sp = cfg.sequence_parallel and t > 1
    scores = 0.0 if cfg.flash_attention else 5 * a * s / (h * t)  # softmax, its dropout
    linear = 34 / t if sp else (10 + 24 / t if t > 1 else 34)  # what TP (and SP) split
    full_layer = s * b * h * (linear + scores) * scale
    if cfg.checkpointing == "none":
        per_layer, recompute = full_layer, 0.0
    elif cfg.checkpointing == "selective":  # attention's scores recomputed: never stored
        per_layer, recompute = s * b * h * linear * scale, 0.0
    else:  # full: each layer keeps its input; one layer's activations live while recomputed
        per_layer, recompute = 2 * s * b * h / (t if sp else 1) * scale, full_layer
    layers_per_stage = cfg.layers // cfg.pp
    logits = 4 * s * b * cfg.vocab / t  # fp32 logits for the loss, on the last stage
    first = cfg.pp * layers_per_stage * per_layer + recompute  # 1F1B: pp micro-batches in flight
    last = layers_per_stage * per_layer + recompute + logits
    return max(first, last)


def gpu_memory(cfg: EstimateConfig) -> dict[str, Any]:
    """One strategy's bytes per GPU: model state after TP/PP and sharding, plus activations."""
    layout_name, _ = PRECISIONS[cfg.precision]
    stage = "zero3" if cfg.strategy == "hsdp" else cfg.strategy
    shard_over = cfg.shard_size if cfg.strategy == "hsdp" else cfg.world_size
    params_per_gpu = cfg.params / (cfg.tp * cfg.pp)  # TP and PP split the model before sharding
    state = model_state_per_rank(
        params_per_gpu, shard_over, stage, LAYOUTS[layout_name], offload=cfg.offload
    )
    device = {k: v for k, v in state["device"].items() if k != "total_bytes"}
    device["activation_bytes"] = activation_bytes(cfg)
    device["total_bytes"] = sum(device.values())
    capacity = cfg.gpu_memory_gib * 2.0**30
    return {
        "strategy": cfg.strategy,
        "precision": cfg.precision,
        "optimizer": layout_name,
        "gpus": cfg.world_size * cfg.tp * cfg.pp,
        "data_parallel": cfg.world_size,
        "shard_over": shard_over,
        "params_per_gpu": params_per_gpu,
        "device": device,
        "host_bytes": state["host"]["total_bytes"],
        "gpu_bytes": capacity,
        "fits": device["total_bytes"] <= capacity,
    }


# --8<-- [end:activations]


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
        "per_gpu": gpu_memory(cfg),
    }


def format_table(result: dict[str, Any], unit: str = "GB") -> str:
    """The human-readable table: one block per optimizer layout, one line per stage, then the
    settings."""
    scale = UNITS[unit]
    lines = [
        (
            f"Model-state memory per rank: {result['params']:.4g} parameters, "
            f"{result['world_size']} data-parallel ranks, in {unit} ({scale:.0f} bytes). "
            "Activations and buffers come on top."
        )
    ]
    header = f"{'strategy':<28}{'params':>9}{'grads':>9}{'optim':>9}{'device':>10}{'host':>9}"
    for layout_name, layout in result["layouts"].items():
        lines += [
            "",
            (
                f"{layout_name}: {layout['description']} "
                f"({layout['param_bytes']}+{layout['grad_bytes']}+{layout['optimizer_bytes']} "
                "bytes/param)"
            ),
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
    gpu = result["per_gpu"]
    dev = gpu["device"]
    lines += [
        "",
        (
            f"Per GPU with {gpu['strategy']} ({gpu['precision']} precision) on {gpu['gpus']} GPUs "
            f"({gpu['data_parallel']} data-parallel, sharded over {gpu['shard_over']}), in {unit}:"
        ),
        "  "
        + ", ".join(
            f"{name} {dev[key] / scale:.2f}"
            for name, key in (
                ("params", "param_bytes"),
                ("grads", "grad_bytes"),
                ("optim", "optimizer_bytes"),
                ("activations", "activation_bytes"),
                ("total", "total_bytes"),
            )
        ),
        (
            f"  of {gpu['gpu_bytes'] / scale:.2f} on the GPU: "
            + ("fits" if gpu["fits"] else "does not fit")
            + (f"; {gpu['host_bytes'] / scale:.2f} in host memory" if gpu["host_bytes"] else "")
        ),
    ]
    return "\n".join(lines)


def _label(row: dict[str, Any]) -> str:
    return STAGES[row["stage"]].label + (" + offload" if row["offload"] else "")


def make_parser() -> argparse.ArgumentParser:
    """One option per field of EstimateConfig: --world-size 64, --offload/--no-offload."""
    doc = " ".join((__doc__ or "").split("\n\n")[0].split())  # the first paragraph, one line
    return config_parser(EstimateConfig, prog="python -m recipes.memory_estimate", doc=doc)


# (no @record: this recipe must run without torch)
def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(make_parser(), EstimateConfig, argv)  # ranges, choices, divisibility
    with exit_on_bad_input():  # anything estimate() refuses: one line, exit 2
        result = estimate(cfg)
    print(format_table(result, cfg.unit))
    print(json.dumps(result), flush=True)  # the last stdout line: the same figures, for scripts
    return result


if __name__ == "__main__":
    main()
