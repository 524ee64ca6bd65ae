"""Compare two runs' per-step losses: the largest difference, the first step where they part, and
the steps only one of them has.

    python -m recipes.loss_compare A B
    python -m recipes.loss_compare results/ddp_torchrun.json results/zero.json --assert-equal \\
        --atol 1e-5
    python -m recipes.loss_compare before/trainer_state.json after/trainer_state.json --key val_loss

Copy with it: recipes/options.py (the command line, from the config). It needs only the standard
library (no torch: it runs wherever the logs are); TensorBoard event files need `tensorboard`.
Modelled on torchtitan's scripts/loss_compare.py, which runs two commits and compares their logs;
this one compares files you already have. Each of A and B may be, detected from its content:

- a recipe's result: its stdout or log (the last JSON line with "losses"), or a results/*.json
  file ({"result": {"losses": [...]}}); the list's index is the step (from "first_step" where the
  result has it, as the job's does);
- a training log: ours (``step 3 loss 2.3456``), torchtitan's (``step: 3  loss: 2.3456``, colour
  codes stripped), Megatron-LM's (``iteration 3/ 100 | ... | lm loss: 2.345600E+00 |``) or
  nanoGPT's (``iter 3: loss 2.3456, ...``);
- a CSV file with a ``step`` column (``step,loss``, or Lightning's CSVLogger ``metrics.csv``), or
  JSON lines ``{"step": 3, "loss": 2.3456}`` (the job's metrics.jsonl);
- a Hugging Face Trainer ``trainer_state.json`` (its ``log_history``);
- TensorBoard event files: an ``events.out.tfevents.*`` file, or the folder that holds them.

``--key`` chooses what is compared: the training loss (default), the validation loss or the
gradient norm. An evaluation line is never read as a training step: it holds a validation loss.
The report says which lines of each file were skipped, and why.

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
from dataclasses import dataclass, field

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config

KEYS = ("train_loss", "val_loss", "grad_norm")


@dataclass
class CompareConfig:
    # the two files are positional on the command line (A B), named here
    baseline: str | None = option(
        None,
        "the reference run: a log, a results JSON, CSV, JSONL or trainer_state.json file, "
        "or TensorBoard events",
    )
    test: str | None = option(None, "the run compared with A, in any such format")
    key: str = option(
        "train_loss",
        "what to compare: the training or validation loss, or the grad norm",
        choices=KEYS,
    )
    # default 0 and 0: bitwise equal, the check for a deterministic change
    atol: float = option(0.0, "absolute tolerance per step (0: bitwise equal)", at_least=0)
    rtol: float = option(0.0, "relative tolerance per step, of A's value", at_least=0)
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
            if os.path.isdir(path) and not any("tfevents" in f for f in os.listdir(path)):
                raise ValueError(
                    f"{name} {path} is a folder with no TensorBoard event file; name a log, "
                    "results JSON, CSV or JSONL file"
                )


class LossFileError(ValueError):
    """A file that cannot be read, or holds no losses in any of the known formats."""


# --8<-- [start:read]
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes: torchtitan's logs have them
NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"
# The names each --key goes by, as a CSV column, a JSON key or a TensorBoard tag (the first found
# wins): ours (loss, train/loss), Lightning's (train_loss, or train_loss_step beside the epoch's
# mean train_loss_epoch, which is no step), Hugging Face's TensorBoard callback (train/loss,
# eval/loss), torchtitan's (loss_metrics/global_avg_loss), Megatron-LM's (lm loss, grad-norm).
NAMES = {
    "train_loss": (
        "loss",
        "train_loss",
        "train_loss_step",
        "train/loss",
        "loss_metrics/global_avg_loss",
        "lm loss",
    ),
    "val_loss": (
        "val_loss",
        "val/loss",
        "eval_loss",
        "eval/loss",
        "validation_metrics/loss",
        "lm loss validation",
    ),
    "grad_norm": ("grad_norm", "train/grad_norm", "grad-norm", "grad_2.0_norm_total"),
}


@dataclass
class Found:
    """What a reader found in one file: each key's {step: value}, and what it did not read."""

    series: dict[str, dict[int, float]] = field(default_factory=dict)
    read_from: dict[int, set[str]] = field(default_factory=dict)  # line: the keys read from it
    skipped: dict[str, list[int]] = field(default_factory=dict)  # why: the lines
    unit: tuple[str, str] = ("line", "lines")  # what the numbers count, one and many

    def add(self, line: int | None, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():  # a step logged twice (a resumed run): the later wins
            self.series.setdefault(key, {})[int(step)] = float(value)
        if line is not None:
            self.read_from.setdefault(line, set()).update(values)

    def skip(self, line: int, why: str) -> None:
        self.skipped.setdefault(why, []).append(line)

    def select(self, key: str, where: str) -> tuple[dict[int, float], dict[str, list[int]]]:
        """{step: value} of ``key``, and the lines not read for it, by why."""
        if key not in self.series:
            has = ", ".join(k for k in KEYS if k in self.series)
            raise LossFileError(f"{where} has no {key}; it has {has} (choose with --key)")
        skipped = {why: list(lines) for why, lines in self.skipped.items()}
        for line, keys in self.read_from.items():
            if key not in keys:  # an evaluation line, when the training loss is compared
                skipped.setdefault(f"{', '.join(sorted(keys))} only", []).append(line)
        return self.series[key], skipped


def read_file(path: str) -> tuple[Found, str]:
    """Every metric found in the file, and its format; LossFileError if there is none."""
    if os.path.isdir(path) or ("tfevents" in os.path.basename(path) and os.path.isfile(path)):
        return _tensorboard(path), "TensorBoard events"  # binary: the name says what it is
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
    lines = [ANSI.sub("", line).strip() for line in text.splitlines()]  # lines[0] is line 1
    for name, reader in FORMATS:  # the first that finds a metric wins
        found = reader(text, lines, path)
        if found and found.series:
            return found, name
    raise LossFileError(
        f"{path}: no losses found; expected a recipe's JSON result, a log (ours, torchtitan's, "
        "Megatron-LM's, nanoGPT's), CSV or JSON lines with a step, a trainer_state.json, or "
        "TensorBoard events (events.out.tfevents.*)"
    )


def read_losses(path: str, key: str = "train_loss") -> tuple[dict[int, float], str]:
    """{step: value} of ``key`` (one of KEYS) in the file, and the format it was found in."""
    found, name = read_file(path)
    return found.select(key, f"{path} ({name})")[0], name


# --8<-- [end:read]


# --8<-- [start:formats]
def _result(value) -> Found | None:
    """A recipe's result: "losses" (a results file has it under "result"), its index the step
    from "first_step" (the job's; else 0), and the job's "val_losses", [step, loss] pairs."""
    if isinstance(value, dict) and "losses" not in value and isinstance(value.get("result"), dict):
        value = value["result"]
    value = {"losses": value} if isinstance(value, list) else value
    if not (isinstance(value, dict) and _numbers(value.get("losses"))):
        return None
    first = value.get("first_step", 0)
    first = first if isinstance(first, int) and not isinstance(first, bool) else 0
    found = Found()
    for index, loss in enumerate(value["losses"]):
        found.add(None, first + index, {"train_loss": loss})
    for pair in value.get("val_losses") or []:
        if isinstance(pair, list) and len(pair) == 2 and _numbers(pair):
            found.add(None, pair[0], {"val_loss": pair[1]})
    return found


def _numbers(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    )


def _whole_json(text, lines, path):
    try:
        return _result(json.loads(text))
    except ValueError:
        return None


# The Trainer appends to log_history {"loss", "grad_norm", "learning_rate", "epoch", "step"} every
# logging_steps, {"eval_loss", ..., "step"} at each evaluation, and at the end the run's summary,
# whose "train_loss" is the mean over the run: no step (transformers' Trainer.log, TrainerState).
TRAINER_NAMES = {"train_loss": "loss", "val_loss": "eval_loss", "grad_norm": "grad_norm"}


def _trainer_state(text, lines, path):
    try:
        history = json.loads(text).get("log_history")
    except (ValueError, AttributeError):
        return None
    if not isinstance(history, list):
        return None
    found = Found(unit=("log_history entry", "log_history entries"))
    for number, entry in enumerate(history, start=1):
        entry = entry if isinstance(entry, dict) else {}
        values = {k: entry[n] for k, n in TRAINER_NAMES.items() if _numbers([entry.get(n)])}
        if "train_runtime" in entry:
            found.skip(number, "the run's summary")
        elif values and isinstance(entry.get("step"), int):
            found.add(number, entry["step"], values)
        else:
            found.skip(number, "no loss or grad norm")
    return found


def _step_and_values(record: dict, where: str) -> tuple[int, dict[str, float]]:
    """A CSV row's or JSON line's step, and each key's value under its first name present; an
    empty cell is no value (Lightning leaves the cells of the metrics a row does not log empty)."""
    names = {k: next((n for n in NAMES[k] if record.get(n) not in (None, "")), None) for k in KEYS}
    names = {key: name for key, name in names.items() if name}
    try:
        return int(record["step"]), {key: float(record[name]) for key, name in names.items()}
    except (TypeError, ValueError):
        raise LossFileError(
            f"{where} has no number in step or {' or '.join(names.values())}: {record}"
        ) from None


def _json_lines(text, lines, path):
    found = Found()
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            return None
        if not (isinstance(record, dict) and "step" in record):
            return None
        step, values = _step_and_values(record, f"{path}: line {number} of the JSON lines")
        if values:
            found.add(number, step, values)
        else:
            found.skip(number, "no loss or grad norm")
    return found


def _csv(text, lines, path):
    if not lines or "," not in lines[0]:
        return None
    rows = csv.DictReader(io.StringIO("\n".join(lines)))
    rows.fieldnames = [(c or "").strip().lower() for c in rows.fieldnames or []]
    if "step" not in rows.fieldnames or not any(
        n in rows.fieldnames for k in KEYS for n in NAMES[k]
    ):
        return None
    found = Found()
    for row in rows:
        step, values = _step_and_values(row, f"{path}: line {rows.line_num} of the CSV")
        if values:
            found.add(rows.line_num, step, values)
        else:
            found.skip(rows.line_num, "no loss or grad norm")
    return found


def _last_json_line(text, lines, path):
    for number in range(len(lines), 0, -1):  # the result is the last JSON line a recipe prints
        if lines[number - 1].startswith("{"):
            try:
                found = _result(json.loads(lines[number - 1]))
            except ValueError:
                continue
            if found:  # its losses have every digit; the step lines above it, four decimals
                for other, line in enumerate(lines, start=1):
                    if line and other != number:
                        found.skip(other, "not the result line")
                return found
    return None


# Megatron-LM's training_log (megatron/training/training.py, NVIDIA/Megatron-LM d98e8a6, lines
# 3567-3653) prints every --log-interval iterations, the mean over them:
#   [2026-08-22 15:22:22.123456] iteration        3/     100 | consumed samples: ... |
#   ... | lm loss: 2.345600E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped ... |
# and evaluate_and_print_results (lines 5370-5400), between two lines of dashes:
#   validation loss at iteration 100 | lm loss value: 2.345600E+00 | lm loss PPL: ... |
# After training it prints "... at iteration 100 on validation set |" and "... on test set |".
MEGATRON_STEP = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|")
MEGATRON_VAL = re.compile(r"\bvalidation loss at iteration (\d+)(?: on validation set)? \|")
MEGATRON_FIELD = re.compile(rf"([a-z][\w ()/-]*?):\s*({NUMBER})", re.I)
MEGATRON_NAMES = {"train_loss": "lm loss", "grad_norm": "grad norm", "val_loss": "lm loss value"}


def _megatron_log(text, lines, path):
    found = Found()
    for number, line in enumerate(lines, start=1):
        step = MEGATRON_STEP.search(line) or MEGATRON_VAL.search(line)
        parts = [MEGATRON_FIELD.fullmatch(part.strip()) for part in line.split("|")]
        fields = dict(part.groups() for part in parts if part)
        values = {k: fields[n] for k, n in MEGATRON_NAMES.items() if n in fields}
        skipped_iterations = fields.get("number of skipped iterations", "0") != "0"
        if step and skipped_iterations and not float(values.get("train_loss", 0)):
            found.skip(number, "a skipped iteration: no loss")  # an fp16 overflow, say
        elif step and values:
            found.add(number, int(step[1]), values)
        elif line and not line.strip("-"):  # the dashes around a validation line
            continue
        elif line:
            found.skip(number, "not an iteration or validation line")
    return found


# nanoGPT's train.py (karpathy/nanoGPT 3adf61e) prints each logged step (line 327):
#   print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
# and every eval_interval (line 265), the mean over eval_iters batches of each split:
#   print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
# That "train loss" is an evaluation, not a training step: only its val loss is read.
NANOGPT_STEP = re.compile(rf"\biter (\d+): loss ({NUMBER})")
NANOGPT_EVAL = re.compile(rf"\bstep (\d+): train loss {NUMBER}, val loss ({NUMBER})")


def _nanogpt_log(text, lines, path):
    found = Found()
    for number, line in enumerate(lines, start=1):
        if match := NANOGPT_STEP.search(line):
            found.add(number, int(match[1]), {"train_loss": match[2]})
        elif match := NANOGPT_EVAL.search(line):
            found.add(number, int(match[1]), {"val_loss": match[2]})
        elif line:
            found.skip(number, "not a step line")
    return found


# "step 3 loss 2.3456" (our recipes; the job adds "grad_norm 0.412"), "step: 3  loss: 2.3456
# grad_norm: 0.4121" (torchtitan); not "5 steps ... loss". A line that names an evaluation (the
# job's "step 3 val_loss 2.3456", torchtitan's "validate step: 3  loss: 2.3456") is no step.
STEP = r"\bstep[:=]?\s*(\d+)\b.*?"
LOG_LOSS = re.compile(rf"{STEP}\bloss[:=]?\s*({NUMBER})", re.I)
LOG_GRAD_NORM = re.compile(rf"{STEP}\bgrad[_ ]norm[:=]?\s*({NUMBER})", re.I)
EVALUATION = re.compile(r"\b(?:val|validate|validation|eval|evaluation)(?:\b|_)", re.I)
LOG_VAL_LOSS = re.compile(rf"{STEP}\b(?:val|eval|validation)[_ ]loss[:=]?\s*({NUMBER})", re.I)


def _log_lines(text, lines, path):
    found = Found()
    for number, line in enumerate(lines, start=1):
        if EVALUATION.search(line):
            # "val_loss 2.34"; else the line's loss: torchtitan's "validate step: 3  loss: 2.34"
            matches = {"val_loss": LOG_VAL_LOSS.search(line) or LOG_LOSS.search(line)}
        else:
            matches = {"train_loss": LOG_LOSS.search(line), "grad_norm": LOG_GRAD_NORM.search(line)}
        values = {key: match[2] for key, match in matches.items() if match}
        if values:
            found.add(number, int(next(m for m in matches.values() if m)[1]), values)
        elif line:
            found.skip(number, "not a step line")
    return found


def _tensorboard(path: str) -> Found:
    """The scalars of an event file, or of every one in a folder: a resumed run adds a file, and
    TensorBoard drops what the first wrote past the step it resumed from (purge_step)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise LossFileError(
            f"{path}: TensorBoard events; reading them needs tensorboard: pip install tensorboard"
        ) from None
    events = EventAccumulator(path, size_guidance={"scalars": 0})  # all; by default a sample
    events.Reload()
    tags = events.Tags()["scalars"]
    found = Found()
    for key in KEYS:
        tag = next((name for name in NAMES[key] if name in tags), None)
        for event in events.Scalars(tag) if tag else ():
            found.add(None, event.step, {key: event.value})
    if not found.series:
        raise LossFileError(
            f"{path}: no TensorBoard scalar of a loss or grad norm; its scalars: "
            f"{', '.join(tags) or 'none'}"
        )
    return found


FORMATS = (  # (name, reader): tried in this order
    ("JSON", _whole_json),
    ("Hugging Face trainer_state", _trainer_state),
    ("JSON lines", _json_lines),
    ("CSV", _csv),
    ("recipe output", _last_json_line),
    ("Megatron-LM log", _megatron_log),
    ("nanoGPT log", _nanogpt_log),
    ("log", _log_lines),
)
# --8<-- [end:formats]


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
    runs = []
    for label, path in (("A", cfg.baseline), ("B", cfg.test)):
        found, name = read_file(path)
        values, skipped = found.select(cfg.key, f"{path} ({name})")
        print(f"{label}: {path} ({name}, {len(values)} steps of {cfg.key})")
        if skipped:  # what was not read, and why: an evaluation line, a line that is no step
            print(f"   skipped {_skipped(skipped, found.unit)}")
        runs.append((values, name))
    (a, format_a), (b, format_b) = runs
    result = compare(a, b, atol=cfg.atol, rtol=cfg.rtol)
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
    return {**result, "key": cfg.key, "format_a": format_a, "format_b": format_b}


def _skipped(skipped: dict[str, list[int]], unit: tuple[str, str]) -> str:
    """'3 lines: 1, 5 (val_loss only), 7 (not a step line)'."""
    total = sum(len(lines) for lines in skipped.values())
    parts = [f"{_ranges(sorted(lines), most=4)} ({why})" for why, lines in skipped.items()]
    return f"{total} {unit[0] if total == 1 else unit[1]}: {', '.join(parts)}"


def _ranges(steps: list[int], most: int | None = None) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'; past ``most`` ranges, how many more."""
    parts, start = [], steps[0]
    for prev, cur in zip(steps, steps[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    if most is not None and len(parts) > most:
        parts[most:] = [f"... ({len(parts) - most} more)"]
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
