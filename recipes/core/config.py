"""Config dataclasses, their validation, and the command line that maps onto them field by field.

Every recipe's config is a dataclass that subclasses ``TrainConfig``. ``Literal[...]`` annotations are
the valid values: a wrong one fails in ``__post_init__`` (for callers in Python) and in argparse
(for the command line) with a message that lists the valid ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence, TypeVar

__all__ = ["RecipeError", "TrainConfig", "CompileOption", "parse_config", "per_rank_batch_size", "opt"]


class RecipeError(ValueError):
    """Bad input that the user can fix: the message is one line and names the fix."""


def opt(default: Any, help: str) -> Any:
    """A dataclass field with a help text for ``--help`` (and for the docs' option tables)."""
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Fields every training recipe shares. Defaults are tiny so that every recipe runs in seconds on CPU."""

    model: Literal["tiny", "small", "100m"] = opt("tiny", "model size preset (see recipes.core.workload.MODEL_PRESETS)")
    steps: int = opt(6, "optimizer steps to run")
    global_batch_size: int = opt(12, "sequences per optimizer step, summed over all ranks")
    lr: float = opt(1e-3, "AdamW learning rate")
    seed: int = opt(0, "seed for model init and data order; same seed -> same losses on any world size")
    backend: Literal["auto", "gloo", "nccl"] = opt(
        "auto", "process-group backend; auto = nccl with one GPU per local rank, else gloo (env RECIPES_BACKEND)"
    )
    timeout_s: float = opt(300.0, "collective timeout in seconds: a stuck rank errors out instead of hanging")
    keep_final_state: bool = opt(False, "return the final full state dict in the result (tests compare it)")
    precision: Literal["auto", "fp32", "tf32", "bf16", "fp16"] = opt(
        "auto", "auto = bf16 on a GPU, fp32 on CPU; fp32 = true fp32 (TF32 off); tf32 = TF32 matmuls (CUDA); "
        "bf16/fp16 = mixed precision (fp16 with a loss scaler); see recipes.core.speed")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            valid = _literal_choices(hints.get(f.name))
            value = getattr(self, f.name)
            if valid is not None and value not in valid:
                raise RecipeError(f"unknown {f.name}={value!r}; valid values: {', '.join(map(str, valid))}")
        for name in ("steps", "global_batch_size"):
            if getattr(self, name) < 1:
                raise RecipeError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class CompileOption:
    """Mixed into the configs of the recipes that can ``torch.compile`` their blocks."""

    compile: bool = opt(False, "torch.compile each transformer block (after checkpointing, before sharding)")
    compile_backend: Literal["inductor", "aot_eager", "eager"] = opt(
        "inductor", "torch.compile backend: inductor generates kernels (the fast one); aot_eager traces "
        "forward and backward without generating code (the tests use it: no C++ compiler needed)")


def _literal_choices(annotation: Any) -> tuple | None:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    return None


def per_rank_batch_size(global_batch_size: int, world_size: int, micro_batches: int = 1) -> int:
    """Each rank's share of a global batch, or a RecipeError that names the sizes that would work."""
    parts = world_size * micro_batches
    if global_batch_size % parts:
        lower = max(parts, global_batch_size - global_batch_size % parts)
        what = f"{world_size} ranks" + (f" x {micro_batches} micro-batches" if micro_batches > 1 else "")
        raise RecipeError(
            f"global_batch_size={global_batch_size} does not divide across {what}; "
            f"use a multiple of {parts}, e.g. {lower} or {lower + parts}"
        )
    return global_batch_size // parts


C = TypeVar("C")


def parse_config(config_cls: type[C], argv: Sequence[str] | None = None, description: str | None = None) -> C:
    """Build argparse from the dataclass: ``--global-batch-size 12``, ``--flag/--no-flag``, choices from Literal."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False
    )
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kwargs: dict[str, Any] = {"default": default, "help": f.metadata.get("help", " "), "dest": f.name}
        choices = _literal_choices(kind)
        if choices is not None:
            kwargs.update(choices=choices, type=type(choices[0]))
        elif kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind in (int, float, str):
            kwargs["type"] = kind
        elif typing.get_origin(kind) in (list, tuple):
            (item,) = set(typing.get_args(kind)) - {Ellipsis}
            kwargs.update(type=item, nargs="*")
        else:
            kwargs["type"] = str
        parser.add_argument(flag, **kwargs)
    args = parser.parse_args(argv)
    try:
        return config_cls(**vars(args))
    except RecipeError as exc:
        parser.exit(2, f"error: {exc}\n")
        raise  # unreachable, for type checkers


def config_table(config_cls: type) -> list[tuple[str, str, str]]:
    """(flag, default, help) for each field: the docs' option tables are generated from this."""
    rows = []
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        rows.append(("--" + f.name.replace("_", "-"), default, f.metadata.get("help", "")))
    return rows


def exit_with(message: str, code: int = 2) -> typing.NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)
