"""Config dataclasses, their validation, and the command line that maps onto them field by field.

Every recipe's config is a dataclass that subclasses ``Config`` (training recipes through
``TrainConfig``). ``Literal[...]`` annotations are the valid values, and a number declares its
range next to its default and help: ``opt(1e-3, "learning rate", gt=0)``. ``Config.__post_init__``
checks both for every field, for callers in Python and the command line alike, with one line that
says what is valid ("lr must be a finite number > 0, got nan"). A float must be finite unless its
field says ``finite=False``. ``--help`` and the docs' option tables show each range after the help.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

__all__ = [
    "RecipeError",
    "is_user_error",
    "Config",
    "TrainConfig",
    "CompileOption",
    "parse_config",
    "per_rank_batch_size",
    "check_step_reached",
    "opt",
    "range_text",
]


class RecipeError(ValueError):
    """Bad input that the user can fix: the message is one line and names the fix."""


def is_user_error(exc: BaseException) -> bool:
    """Bad input the user can fix: a RecipeError, or a ValueError subclass that a recipe module
    defines beside the function a user copies (``ShardingError`` beside ``apply_fully_shard``...):
    those functions stand alone, so they cannot raise RecipeError. A recipe run as ``python -m
    recipes.X`` defines its classes in ``__main__``: its import name comes from ``__spec__``."""
    if isinstance(exc, RecipeError):
        return True
    if not isinstance(exc, ValueError):
        return False
    module_name = type(exc).__module__
    spec = getattr(sys.modules.get(module_name), "__spec__", None)
    return (getattr(spec, "name", None) or module_name).startswith("recipes.")


# The bounds a number can declare, as opt's keywords, with how they read and how they are checked.
_BOUNDS = {
    "ge": (">=", operator.ge),
    "gt": (">", operator.gt),
    "le": ("<=", operator.le),
    "lt": ("<", operator.lt),
}


def opt(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    finite: bool = True,
) -> Any:
    """A dataclass field with a help text for ``--help`` (and the docs' option tables) and, for a
    number, its range: ``ge``/``gt``/``le``/``lt`` are bounds (>=, >, <=, <); a float must also be
    finite (no nan or inf) unless ``finite=False``. ``Config.__post_init__`` checks every field."""
    given = {"ge": ge, "gt": gt, "le": le, "lt": lt}
    bounds = {name: value for name, value in given.items() if value is not None}
    metadata = {"help": help, "bounds": bounds, "finite": finite}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def range_text(f: dataclasses.Field, annotation: Any) -> str:
    """A numeric field's range as ``--help`` and the docs show it (">= 1", "> 0, finite"), or ""."""
    if annotation not in (int, float):
        return ""
    bounds = f.metadata.get("bounds", {})
    parts = [f"{_BOUNDS[name][0]} {value:g}" for name, value in bounds.items()]
    if annotation is float and f.metadata.get("finite", True):
        parts.append("finite")
    return ", ".join(parts)


def _range_problem(f: dataclasses.Field, annotation: Any, value: Any) -> str | None:
    """None if ``value`` lies in the field's declared range, else one line that says what does."""
    if annotation not in (int, float):
        return None
    bounds = f.metadata.get("bounds", {})
    limits = " and ".join(f"{_BOUNDS[name][0]} {bound:g}" for name, bound in bounds.items())
    finite = annotation is float and f.metadata.get("finite", True)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    shown = f"{value:g}" if isinstance(value, float) else repr(value)  # -1, nan: as typed
    if not is_number or (annotation is int and not whole):
        what = "a whole number" if annotation is int else "a number"
        return f"{f.name} must be {what} {limits}".rstrip() + f", got {shown}"
    in_range = all(_BOUNDS[name][1](value, bound) for name, bound in bounds.items())
    if in_range and not (finite and not math.isfinite(value)):
        return None
    what = ("a finite number " if finite else "") + limits
    return f"{f.name} must be {what.strip()}, got {shown}"


@dataclass
class Config:
    """The base of every recipe's config: ``__post_init__`` checks each field's Literal choices and
    declared range (see ``opt``). A subclass adds the checks that relate two fields after
    ``super().__post_init__()``; what a field's range says is not checked twice."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            valid = _literal_choices(hints.get(f.name))
            value = getattr(self, f.name)
            if valid is not None and value not in valid:
                raise RecipeError(
                    f"unknown {f.name}={value!r}; valid values: {', '.join(map(str, valid))}"
                )
            problem = _range_problem(f, hints.get(f.name), value)
            if problem:
                raise RecipeError(problem)


@dataclass
class TrainConfig(Config):
    """Fields every training recipe shares. Defaults are tiny so that every recipe runs in seconds
    on CPU."""

    model: Literal["tiny", "small", "100m"] = opt(
        "tiny", "model size preset (see recipes.core.workload.MODEL_PRESETS)"
    )
    steps: int = opt(6, "optimizer steps to run", ge=1)
    global_batch_size: int = opt(12, "sequences per optimizer step, summed over all ranks", ge=1)
    lr: float = opt(1e-3, "AdamW learning rate", gt=0)
    seed: int = opt(
        0, "seed for model init and data order; same seed -> same losses on any world size", ge=0
    )
    backend: Literal["auto", "gloo", "nccl"] = opt(
        "auto",
        "process-group backend; auto = nccl with one GPU per local rank, else gloo (env "
        "RECIPES_BACKEND)",
    )
    timeout_s: float = opt(
        300.0, "collective timeout in seconds: a stuck rank errors out instead of hanging", gt=0
    )
    keep_final_state: bool = opt(
        False, "return the final full state dict in the result (tests compare it)"
    )
    precision: Literal["auto", "fp32", "tf32", "bf16", "fp16"] = opt(
        "auto",
        "auto = bf16 on a GPU, fp32 on CPU; fp32 = true fp32 (TF32 off); "
        "tf32 = TF32 matmuls (CUDA); "
        "bf16/fp16 = mixed precision (fp16 with a loss scaler)",
    )


@dataclass
class CompileOption:
    """Mixed into the configs of the recipes that can ``torch.compile`` their blocks."""

    compile: bool = opt(
        False, "torch.compile each transformer block (after checkpointing, before sharding)"
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = opt(
        "inductor",
        "torch.compile backend: inductor generates kernels (the fast one); aot_eager traces "
        "forward and backward without generating code (the tests use it: no C++ compiler needed)",
    )


def _literal_choices(annotation: Any) -> tuple | None:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    return None


def per_rank_batch_size(global_batch_size: int, world_size: int, micro_batches: int = 1) -> int:
    """Each rank's share of a global batch, or a RecipeError that names the sizes that would
    work."""
    parts = world_size * micro_batches
    if global_batch_size % parts:
        lower = max(parts, global_batch_size - global_batch_size % parts)
        what = f"{world_size} ranks" + (
            f" x {micro_batches} micro-batches" if micro_batches > 1 else ""
        )
        raise RecipeError(
            f"global_batch_size={global_batch_size} does not divide across {what}; "
            f"use a multiple of {parts}, e.g. {lower} or {lower + parts}"
        )
    return global_batch_size // parts


def check_step_reached(name: str, step: int, steps: int) -> None:
    """A step option (steps count from 0) at or past ``steps`` would never act, and the run would
    pass for one where it did: a RecipeError that names the steps there are."""
    if step >= steps:
        flag = "--" + name.replace("_", "-")
        raise RecipeError(
            f"{name}={step} is never reached: the steps are 0 to {steps - 1}; use "
            f"{flag} {steps - 1} or less, or --steps {step + 1} or more"
        )


C = TypeVar("C")


def parse_config(
    config_cls: type[C], argv: Sequence[str] | None = None, description: str | None = None
) -> C:
    """Build argparse from the dataclass: ``--global-batch-size 12``, ``--flag/--no-flag``, choices
    from Literal."""
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        missing = f.default is dataclasses.MISSING
        default = f.default_factory() if missing else f.default  # type: ignore[misc]
        kwargs: dict[str, Any] = {"default": default, "help": _help(f, kind) or " ", "dest": f.name}
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
    """(flag, default, help) for each field: the docs' option tables are generated from this.
    The help ends with the field's range, as in ``--help``: "optimizer steps to run (>= 1)"."""
    hints = typing.get_type_hints(config_cls)
    rows = []
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        rows.append(("--" + f.name.replace("_", "-"), default, _help(f, hints.get(f.name))))
    return rows


def _help(f: dataclasses.Field, annotation: Any) -> str:
    help_text, limits = f.metadata.get("help", ""), range_text(f, annotation)
    return f"{help_text} ({limits})" if limits else help_text


def exit_with(message: str, code: int = 2) -> typing.NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)
