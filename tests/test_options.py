"""recipes/options.py: a config checks its declared limits and types in code; the command line is
derived from it (flags, help with the range, booleans, sequences) and refuses in one line, exit 2,
printed once per node; a ValueError every rank raises becomes one line and exit 2."""

from __future__ import annotations

import dataclasses

import pytest

from recipes.options import (
    check_options,
    config_parser,
    exit_on_bad_input,
    option,
    parse_config,
)


@dataclasses.dataclass
class Example:
    steps: int = option(4, "optimizer steps", at_least=1)
    lr: float = option(1e-3, "learning rate", above=0, at_most=1)
    capacity: float = option(float("inf"), "inf: unlimited", above=0, finite=False)
    mode: str = option("a", "which mode", choices=["a", "b"])
    compile: bool = option(False, "compile the model")
    save_path: str | None = option(None, "where to save")
    mesh: tuple[int, ...] = option((2,), "mesh shape")
    ranks: list[int] = option([0], "ranks to watch")

    def __post_init__(self):
        check_options(self)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"steps": 0}, "steps must be a whole number >= 1, got 0"),
        ({"steps": 2.5}, "steps must be a whole number >= 1, got 2.5"),
        ({"steps": True}, "steps must be a whole number >= 1, got True"),
        ({"lr": 0.0}, "lr must be a finite number > 0 and <= 1, got 0.0"),
        ({"lr": 1.5}, "lr must be a finite number > 0 and <= 1, got 1.5"),
        ({"lr": float("nan")}, "lr must be a finite number > 0 and <= 1, got nan"),
        ({"lr": "fast"}, "lr must be a finite number > 0 and <= 1, got 'fast'"),
        ({"capacity": 0.0}, "capacity must be a number > 0, got 0.0"),
        ({"mode": "c"}, "mode must be one of a, b, got 'c'"),
    ],
)
def test_a_value_outside_its_declared_limits_is_one_valueerror_line(changes, message):
    with pytest.raises(ValueError) as refused:
        Example(**changes)
    assert str(refused.value) == message


def test_valid_values_pass_and_mutable_defaults_are_not_shared():
    a, b = Example(capacity=float("inf"), save_path=None, ranks=[]), Example()
    assert a.ranks == [] and b.ranks == [0]
    b.ranks.append(1)
    assert Example().ranks == [0], "a list default must be built fresh for each config"
    Example(lr=1, steps=3)  # an int where a float is declared is a number


def test_the_command_line_is_derived_from_the_config(capsys):
    parser = config_parser(Example, prog="python -m example", doc="Example.\n\nMore.")
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    assert {"--steps", "--lr", "--capacity", "--mode", "--compile", "--save-path"} <= flags
    cfg = parse_config(
        parser, Example, ["--steps", "7", "--compile", "--mesh", "2", "2", "--ranks", "1", "3"]
    )
    assert (cfg.steps, cfg.compile, cfg.mesh, cfg.ranks) == (7, True, (2, 2), [1, 3])
    assert parse_config(parser, Example, ["--capacity", "inf"]).capacity == float("inf")
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "Example." in out and "optimizer steps (>= 1) (default: 4)" in out
    assert "learning rate (> 0, <= 1)" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "error: steps must be a whole number >= 1, got 0"),
        (["--lr", "nan"], "error: lr must be a finite number > 0 and <= 1, got nan"),
        (["--steps", "x"], "error: argument --steps: invalid int value: 'x'"),
        (["--mode", "c"], "error: argument --mode: invalid choice: 'c'"),
        (["--stpes", "3"], "error: unrecognized arguments: --stpes 3"),
        (["--ste", "3"], "error: unrecognized arguments: --ste 3"),  # no abbreviations
    ],
)
def test_a_bad_command_line_is_usage_one_line_and_exit_2(argv, message, capsys):
    parser = config_parser(Example, prog="python -m example", doc=None)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(parser, Example, argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage:") and message in lines[-1], lines
    assert sum("error:" in line for line in lines) == 1


def test_only_the_first_process_of_a_node_prints_but_every_rank_exits_2(monkeypatch, capsys):
    parser = config_parser(Example, prog="python -m example", doc=None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        parse_config(parser, Example, ["--steps", "0"])
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as exit_info, exit_on_bad_input():
        raise ValueError("global_batch_size=9 does not divide across 2 ranks")
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as exit_info, exit_on_bad_input():
        raise ValueError("global_batch_size=9 does not divide across 2 ranks")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: global_batch_size=9 does not divide across 2 ranks\n"


def test_an_error_that_is_not_bad_input_is_not_hidden():
    with pytest.raises(RuntimeError), exit_on_bad_input():
        raise RuntimeError("a broken collective keeps its traceback")
