"""Cutting YOUR model into pipeline stages by module names, and placing them on the ranks: the
second idea of recipes/pipeline_parallel.py, in a file of its own (copy it with the recipe; it
imports torch only).

A split is in the model's own module names, nothing looked up behind the user's back: split points
(``["layers.2"]``: a stage begins at each), or per-stage lists in execution order
(``[["embed", "layers.0"], ["layers.1", "norm", "head"]]``). A stage runs its modules in order,
each on the previous one's output; a ``StageWiring`` names what a plain chain cannot express:
position embeddings added to the first module's output, a rotary embedding every block receives
(Hugging Face's Llama and relatives), the blocks' container. Ready-made: ``TRANSFORMER_LM``,
``LLAMA``, ``GPT2``. The stage keeps its modules under their names in the model, so checkpoints move
between layouts. Weights tied across stages (GPT-2's ``lm_head`` and ``wte``) are handled as
Megatron does: each end stage keeps its own copy and, every step, the copies' gradients are summed
across the pipeline (``sync_tied_grads``). A split the model cannot take is refused with one line
naming what the model has: ``PipelineSplitError``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = [
    "PipelineSplitError",
    "StageWiring",
    "TRANSFORMER_LM",
    "LLAMA",
    "GPT2",
    "even_split",
    "stage_modules",
    "StageModule",
    "sync_tied_grads",
    "stage_placement",
    "bubble_fraction",
    "SINGLE_STAGE_SCHEDULES",
    "V_SCHEDULES",
]


SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # the schedules' names in recipes.pipeline_parallel
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")  # 2 stages per rank, placed in a V


class PipelineSplitError(ValueError):
    """A split or placement the model or the schedule cannot take, in one line with the fix.

    A ValueError of this module's own, so that it copies without the cookbook's package.
    """


@dataclass(frozen=True)
class StageWiring:
    """What a chain of modules cannot say: ``blocks`` is the container of the repeated blocks;
    ``position_embeddings`` are called on positions 0..seq-1 and added to the first module's output;
    ``rotary`` (no parameters, on every stage) is called as ``rotary(hidden, position_ids)`` and its
    result passed to each block as ``position_embeddings=``, Hugging Face's convention."""

    blocks: str
    position_embeddings: tuple[str, ...] = ()
    rotary: str | None = None


# --8<-- [start:wirings]
TRANSFORMER_LM = StageWiring("layers", position_embeddings=("pos_embeddings",))
LLAMA = StageWiring("model.layers", rotary="model.rotary_emb")  # HF Llama, Mistral, Qwen2, ...
GPT2 = StageWiring("transformer.h", position_embeddings=("transformer.wpe",))
# --8<-- [end:wirings]


def _module(model: nn.Module, name: str) -> nn.Module:
    """``model.get_submodule(name)``, or one line naming the modules that exist where it looked."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        parent = name.rpartition(".")[0]
        while parent:
            try:
                found = [n for n, _ in model.get_submodule(parent).named_children()]
                break
            except AttributeError:
                parent = parent.rpartition(".")[0]
        else:
            found = [n for n, _ in model.named_children()]
        where = f"{parent}." if parent else ""
        raise PipelineSplitError(
            f"the split names {name!r}, which is not a module of "
            f"{type(model).__name__}; its modules there: "
            f"{', '.join(where + n for n in found)}"
        ) from None


def even_split(model: nn.Module, wiring: StageWiring, num_stages: int) -> list[str]:
    """Split points giving each stage an even share of the blocks (earlier stages take the rest)."""
    blocks = [f"{wiring.blocks}.{n}" for n, _ in _module(model, wiring.blocks).named_children()]
    if len(blocks) < num_stages:
        raise PipelineSplitError(
            f"{len(blocks)} blocks cannot fill {num_stages} pipeline stages; "
            f"use a model with {num_stages} blocks or more, or fewer stages"
        )
    base, extra = divmod(len(blocks), num_stages)
    starts = [s * base + min(s, extra) for s in range(num_stages)]
    return [blocks[start] for start in starts[1:]]


def _units(model: nn.Module, points: Sequence[str], wiring: StageWiring) -> list[str]:
    """The model's modules in registration order, opened down to each split point and block."""

    def walk(module: nn.Module, prefix: str) -> list[str]:
        names = []
        for child_name, child in module.named_children():
            name = prefix + child_name
            if name == wiring.rotary:
                continue  # shared by every stage, not owned by one
            # opened: a split point is inside, or it holds the blocks (a ModuleList, no forward)
            inside = any(p.startswith(name + ".") for p in [*points, wiring.blocks + "."])
            names += walk(child, name + ".") if inside else [name]
        return names

    return walk(model, "")


def stage_modules(model: nn.Module, split: Sequence, wiring: StageWiring) -> list[list[str]]:
    """Per stage, the module names it owns in execution order; checks the split against the
    model."""
    if all(isinstance(s, str) for s in split):  # split points; none: one stage
        for name in split:
            _module(model, name)
        units = _units(model, split, wiring)
        cuts = [units.index(name) for name in split]
        if cuts != sorted(set(cuts)) or 0 in cuts:
            raise PipelineSplitError(
                f"split points {list(split)} must be distinct, in the "
                f"model's order, and after its first module {units[0]!r}"
            )
        stages = [units[a:b] for a, b in zip([0, *cuts], [*cuts, len(units)])]
    else:  # per-stage lists
        stages = [list(names) for names in split]
        for names in stages:
            for name in names:
                _module(model, name)
    listed = [name for names in stages for name in names]
    if len(set(listed)) != len(listed):
        twice = sorted({name for name in listed if listed.count(name) > 1})
        raise PipelineSplitError(
            f"{', '.join(twice)} named in more than one stage; name each module once"
        )
    owned = {id(p) for name in listed for p in _module(model, name).parameters()}
    missing = sorted(
        {n.rpartition(".")[0] for n, p in model.named_parameters() if id(p) not in owned}
    )
    if missing:
        raise PipelineSplitError(
            f"no stage owns the parameters of {', '.join(missing[:5])}; "
            "add these modules to a stage"
        )
    for name in wiring.position_embeddings:
        if name not in stages[0]:
            raise PipelineSplitError(
                f"position embedding {name!r} must be on the first stage, with {stages[0][0]!r}"
            )
    return stages


class StageModule(nn.Module):
    """One stage: its modules under their names in the model, run in order on the previous output.

    Modules are taken, not copied: a rank builds the model, keeps its stages' modules, drops the
    rest. A module holding a weight tied to an earlier stage's (found by identity) is copied.
    """

    def __init__(
        self, model: nn.Module, stages: list[list[str]], stage_index: int, wiring: StageWiring
    ):
        super().__init__()
        # A stage passes its blocks no attention mask: HF's eager attention is then not causal
        # (sdpa and flash attention are), and the model silently trains on the future.
        if getattr(getattr(model, "config", None), "_attn_implementation", None) == "eager":
            raise PipelineSplitError(
                "a pipeline stage passes no attention mask, and "
                "attn_implementation='eager' is then not causal; use 'sdpa' "
                "(causal without a mask)"
            )
        self.stage_units, self.wiring = stages[stage_index], wiring
        self.is_first_stage = stage_index == 0
        # Weights tied across stages (lm_head.weight is transformer.wte.weight), found by identity
        # in the untouched model: every rank finds the same ties, in the same order.
        holders: dict[int, list[tuple[int, str, str, nn.Parameter]]] = {}
        for index, names in enumerate(stages):
            for unit in names:
                for name, p in _module(model, unit).named_parameters(
                    prefix=unit, remove_duplicate=False
                ):
                    holders.setdefault(id(p), []).append((index, unit, name, p))
        crossing = [h for h in holders.values() if len({index for index, *_ in h}) > 1]
        self.tied = [
            ([name for _, _, name, _ in h], torch.empty_like(h[0][3], device="meta"))
            for h in crossing
        ]  # (the copies' names, shape and dtype)
        # A later stage's unit that holds a tie is copied: its own copy of the weight, the user's
        # model untouched; sync_tied_grads sums the copies' gradients.
        copied = {
            unit for h in crossing for index, unit, *_ in h if index == stage_index != h[0][0]
        }
        for name in self.stage_units + ([wiring.rotary] if wiring.rotary else []):
            *path, leaf = name.split(".")
            parent = self
            for part in path:  # containers on the way: the names stay the model's
                if part not in parent._modules:
                    parent.add_module(part, nn.ModuleDict())
                parent = parent._modules[part]
            module = _module(model, name)
            parent.add_module(leaf, copy.deepcopy(module) if name in copied else module)
        for name, _ in model.named_children():  # what other stages own reads as None here, as a
            if name not in self._modules:  # model whose stage set its parts to None would
                setattr(self, name, None)

    # --8<-- [start:stage_forward]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        rotary = None
        for name in self.stage_units:
            if name in self.wiring.position_embeddings:
                continue  # added to the first module's output below
            module, kwargs = self.get_submodule(name), {}
            if self.wiring.rotary and name.startswith(self.wiring.blocks + "."):
                if rotary is None:
                    rotary = self.get_submodule(self.wiring.rotary)(x, positions[None])
                kwargs["position_embeddings"] = rotary
            x = module(x, **kwargs)
            x = x[0] if isinstance(x, (tuple, list)) else x  # blocks that return (hidden, ...)
            if self.is_first_stage and name == self.stage_units[0]:
                for embedding in self.wiring.position_embeddings:
                    x = x + self.get_submodule(embedding)(positions)
        return x

    # --8<-- [end:stage_forward]


# --8<-- [start:tied]
def sync_tied_grads(submods: Sequence[nn.Module], group: dist.ProcessGroup | None = None) -> None:
    """Sum tied copies' gradients over the pipeline group (after backward, before the step): equal
    at the start, equal updates. Megatron uses a group of the first and last stage; the whole group
    adds zeros here (a group of two needs every rank of the world to create it). Plain (unsharded)
    parameters only: a TP/FSDP-sharded tie is not handled."""
    ties = getattr(submods[0], "tied", []) if submods else []
    device = next(p.device for m in submods for p in m.parameters())
    for names, like in ties:
        local = [p for m in submods for n, p in m.named_parameters() if n in names]
        total = torch.zeros_like(like, device=device)
        for p in local:
            if p.grad is not None:
                total += p.grad
        dist.all_reduce(total, group=group)
        for p in local:
            p.grad = total.clone()


# --8<-- [end:tied]


def stage_placement(
    schedule: str, pp_rank: int, pp_size: int, stages_per_rank: int = 0
) -> tuple[list[int], int]:
    """(the stage indices this pipeline rank holds, the number of stages): "loop" or "v" style."""
    if stages_per_rank == 0:
        stages_per_rank = 1 if schedule in SINGLE_STAGE_SCHEDULES else 2
    if schedule in SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        raise PipelineSplitError(
            f"schedule {schedule} runs one stage per rank, got "
            f"stages_per_rank={stages_per_rank}; use --schedule "
            "interleaved_1f1b for several"
        )
    if schedule in V_SCHEDULES:
        if stages_per_rank != 2:
            raise PipelineSplitError(
                f"{schedule} places exactly 2 stages per rank (a V), got "
                f"stages_per_rank={stages_per_rank}; use --stages-per-rank "
                "2 or 0"
            )
        return [pp_rank, 2 * pp_size - 1 - pp_rank], 2 * pp_size  # rank 0: first AND last stage
    return [pp_rank + k * pp_size for k in range(stages_per_rank)], stages_per_rank * pp_size


def bubble_fraction(pp_size: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction an ideal GPipe/1F1B pipeline pays: (p-1)/(v*m+p-1), v stages per rank."""
    return (pp_size - 1) / (stages_per_rank * microbatches + pp_size - 1)
