"""Compare two runs' per-step losses: the largest difference, the first step where they part, and
the steps only one of them has.

    python -m recipes.loss_compare A B
    python -m recipes.loss_compare results/ddp_torchrun.json results/zero.json --assert-equal \\
        --atol 1e-5

Copy with it: recipes/options.py (the command line, from the config). It needs only the standard
library (no torch: it runs wherever the logs are).
Modelled on torchtitan's scripts/loss_compare.py, which runs two commits and compares their logs;
this one compares files you already have. Each of A and B may be, detected from its content:

- a recipe's result: its stdout or log (the last JSON line with "losses"), or a results/*.json
  file ({"result": {"losses": [...]}}); the list's index is the step;
- a training log with lines like ``step 3 loss 2.3456`` (our recipes) or ``step: 3  loss: 2.3456``
  (torchtitan); colour codes are stripped;
- a CSV file with columns ``step,loss``, or JSON lines ``{"step": 3, "loss": 2.3456}``.

``--assert-equal`` exits with 1 when the runs differ beyond ``--atol``/``--rtol`` (default: 0,
bitwise equal, as torchtitan's check) or cover different steps: a CI check that a refactor, a new
parallelism or another world size leaves the losses as they were.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import sys
from dataclasses import dataclass

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config


@dataclass
class CompareConfig:
    # the two files are positional on the command line (A B), named here
    baseline: str | None = option(None, "the reference run: a log, results JSON, CSV or JSONL file")
    test: str | None = option(None, "the run compared with A, in any such format")
    # default 0 and 0: bitwise equal, the check for a deterministic change
    atol: float = option(0.0, "absolute tolerance per step (0: bitwise equal)", at_least=0)
    rtol: float = option(0.0, "relative tolerance per step, of A's loss", at_least=0)
    assert_equal: bool = option(
        False, "exit with 1 unless both runs have the same steps, each within the tolerance"
    )

    def __post_init__(self) -> None:
        check_options(self)  # the ranges above (nan too): one line each
        for name in ("baseline", "test"):
            path = getattr(self, name)
            if path is None:
                raise ValueError(
                    f"{name}: name the file of run {'A' if name == 'baseline' else 'B'}"
                )
            if os.path.isdir(path):
                raise ValueError(
                    f"{name} {path} is a folder; name a log, results JSON, CSV or JSONL file"
                )


class LossFileError(ValueError):
    """A file that cannot be read, or holds no losses in any of the known formats."""


# --8<-- [start:read]
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes: torchtitan's logs have them
NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"
# "step 3 loss 2.34" (our recipes), "step: 3  loss: 2.34" (torchtitan); not "5 steps ... loss"
LOG_LINE = re.compile(rf"\bstep[:=]?\s*(\d+)\b.*?\bloss[:=]?\s*({NUMBER})", re.I)


def read_losses(path: str) -> tuple[dict[int, float], str]:
    """{step: loss} and the format it was found in; LossFileError if there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise LossFileError(
            f"{path}: no such file; give the path of a log, results JSON, CSV or JSONL file"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LossFileError(
            f"{path}: cannot read it as text ({type(exc).__name__}); give a log, "
            "results JSON, CSV or JSONL file"
        ) from None
    lines = [ANSI.sub("", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    for name, reader in (
        ("JSON", _whole_json),
        ("JSON lines", _json_lines),
        ("CSV", _csv),
        ("recipe output", _last_json_line),
        ("log", _log_lines),
    ):
        losses = reader(text, lines, path)
        if losses:
            return losses, name
    raise LossFileError(
        f'{path}: no losses found; expected a recipe\'s JSON result ("losses"), log lines like '
        '\'step 3 loss 2.3456\', a CSV with columns step,loss, or JSON lines {"step", "loss"}'
    )


def _losses_list(value) -> dict[int, float] | None:
    """A recipe result's "losses" (a results file has it under "result"): index = step."""
    if isinstance(value, dict):
        value = value.get(
            "losses",
            (value.get("result") or {}).get("losses")
            if isinstance(value.get("result"), dict)
            else None,
        )
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        return {step: float(v) for step, v in enumerate(value)}
    return None


def _whole_json(text, lines, path):
    try:
        return _losses_list(json.loads(text))
    except ValueError:
        return None


def _json_lines(text, lines, path):
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            return None
        if not (isinstance(record, dict) and {"step", "loss"} <= record.keys()):
            return None
        records.append(record)
    try:
        return {int(r["step"]): float(r["loss"]) for r in records}
    except (TypeError, ValueError):
        raise LossFileError(f"{path}: a JSON line's step or loss is not a number") from None


def _csv(text, lines, path):
    if not lines or "," not in lines[0]:
        return None
    rows = csv.DictReader(io.StringIO("\n".join(lines)))
    columns = {(c or "").strip().lower(): c for c in rows.fieldnames or []}
    if not {"step", "loss"} <= columns.keys():
        return None
    losses = {}
    for number, row in enumerate(rows, start=2):
        try:
            losses[int(row[columns["step"]])] = float(row[columns["loss"]])
        except (TypeError, ValueError):
            raise LossFileError(
                f"{path}: line {number} of the CSV has no number in step or loss: {row}"
            ) from None
    return losses


def _last_json_line(text, lines, path):
    for line in reversed(lines):  # the result is the last JSON line a recipe prints
        if line.startswith("{"):
            try:
                losses = _losses_list(json.loads(line))
            except ValueError:
                continue
            if losses:
                return losses
    return None


def _log_lines(text, lines, path):
    losses = {}
    for line in lines:
        match = LOG_LINE.search(line)
        if match:  # a step logged twice (a resumed run): the later line wins
            losses[int(match[1])] = float(match[2])
    return losses


# --8<-- [end:read]


# --8<-- [start:compare]
def compare(a: dict[int, float], b: dict[int, float], *, atol: float, rtol: float) -> dict:
    """Where B differs from A (the baseline). A step parts when |B - A| > atol + rtol * |A|
    (numpy.isclose's rule, A as the reference); NaN at the same step in both runs agrees."""
    common = sorted(a.keys() & b.keys())
    worst_abs = worst_rel = (0.0, common[0] if common else None)
    first_parted = None
    for step in common:
        x, y = a[step], b[step]
        if math.isnan(x) and math.isnan(y):
            continue
        diff = abs(y - x) if not (math.isnan(x) or math.isnan(y)) else math.inf
        rel = diff / abs(x) if x != 0 else (0.0 if diff == 0 else math.inf)
        worst_abs = max(worst_abs, (diff, step), key=lambda t: t[0])
        worst_rel = max(worst_rel, (rel, step), key=lambda t: t[0])
        if first_parted is None and not diff <= atol + rtol * abs(x):
            first_parted = step
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    return {
        "common_steps": len(common),
        "max_abs_diff": worst_abs[0],
        "max_abs_diff_step": worst_abs[1],
        "max_rel_diff": worst_rel[0],
        "max_rel_diff_step": worst_rel[1],
        "first_parted_step": first_parted,
        "only_in_a": only_a,
        "only_in_b": only_b,
        # equal: the same steps, each within the tolerance
        "equal": first_parted is None and not only_a and not only_b and bool(common),
    }


# --8<-- [end:compare]


def run(cfg: CompareConfig) -> dict:
    """Read both files, compare them, print the report; returns the comparison."""
    a, format_a = read_losses(cfg.baseline)
    b, format_b = read_losses(cfg.test)
    result = compare(a, b, atol=cfg.atol, rtol=cfg.rtol)
    print(f"A: {cfg.baseline} ({format_a}, {len(a)} steps)")
    print(f"B: {cfg.test} ({format_b}, {len(b)} steps)")
    if result["common_steps"]:
        print(
            f"largest absolute difference: {result['max_abs_diff']:.6g} at step "
            f"{result['max_abs_diff_step']}"
        )
        print(
            f"largest relative difference: {result['max_rel_diff']:.6g} at step "
            f"{result['max_rel_diff_step']}"
        )
    else:
        print("no step in common: nothing to compare")
    step = result["first_parted_step"]
    tolerance = f"atol={cfg.atol:g}, rtol={cfg.rtol:g}"
    if step is None:
        print(
            f"first step that parts ({tolerance}): none, on {result['common_steps']} common steps"
        )
    else:
        print(f"first step that parts ({tolerance}): step {step}: A {a[step]!r}, B {b[step]!r}")
    for label, steps in (("A", result["only_in_a"]), ("B", result["only_in_b"])):
        if steps:
            print(f"steps only in {label}: {_ranges(steps)}")
    return {**result, "format_a": format_a, "format_b": format_b}


def _ranges(steps: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], steps[0]
    for prev, cur in zip(steps, steps[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def make_parser() -> argparse.ArgumentParser:
    doc = " ".join((__doc__ or "").split("\n\n")[0].split())  # the first paragraph, one line
    parser = config_parser(CompareConfig, prog="python -m recipes.loss_compare", doc=doc)
    files = [action for action in parser._actions if action.dest in ("baseline", "test")]
    for action, metavar in zip(files, "AB"):  # the files are positional, A B: not --baseline
        parser.add_argument(action.dest, metavar=metavar, help=action.help)
        action.help = argparse.SUPPRESS
    return parser


# (no @record: this recipe must run without torch)
def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(make_parser(), CompareConfig, argv)
    with exit_on_bad_input():  # a file that is missing, unreadable or holds no losses: one line
        result = run(cfg)
    print(json.dumps({"recipe": "loss_compare", **result}))
    if cfg.assert_equal and not result["equal"]:
        reasons = []
        if result["first_parted_step"] is not None:
            reasons.append(f"they part at step {result['first_parted_step']}")
        if result["only_in_a"] or result["only_in_b"]:
            reasons.append("their steps differ")
        print(
            f"loss_compare: the runs differ: {'; '.join(reasons) or 'no step in common'}",
            file=sys.stderr,
        )
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
