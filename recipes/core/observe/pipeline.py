"""The observer of recipes/pipeline_parallel.py: each rank's timeline and idle time, read by
wrapping torch's pipelining classes for the run, and the stages' state gathered whole.

It reads the recipe's public schedule table and checks (``SCHEDULES``, ``check_config_fits``...)
to name the schedules and say why one does not run here: what the recipe refuses, the table shows.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.pipelining import schedules, stage

from recipes import pipeline_parallel
from recipes.core.observe.base import Observer
from recipes.core.result import param_checksum
from recipes.core.state import all_ranks
from recipes.toy import TransformerLM

__all__ = ["PipelineObserver"]


class PipelineObserver(Observer):
    """recipes/pipeline_parallel.py: each rank's timeline and idle time, the layout, and the whole
    model's final state gathered from the stages (into ``extras``).

    From ``model_ready`` to the end of each run it wraps torch's pipelining classes (every schedule
    calls them): each stage's ``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or I when the
    schedule splits the backward) and ``backward_weight_one_chunk`` (W), timed within the window of
    the schedule's ``step``; the waits for a neighbour happen outside them: the gaps are the idle
    time. Per run (the recipe's ``--schedule``, then with ``--compare`` each other schedule in
    turn, told apart by the schedule's class): ``idle_fraction_measured_per_rank`` (1 - busy /
    window, the mean over the steps after the first), the last step's ``timeline_per_rank``
    ([kind, stage, micro-batch, start ms, end ms]) and ``step_window_ms_per_rank``; the first
    run's also as the result's own figures, with ``stage_ids_per_rank``, ``num_stages``,
    ``split_points`` and the theoretical bubble; with ``compare``, ``schedule_table``: a row per
    schedule, measured, or refused with the recipe's reason. The model the recipe hands over is
    its stages' modules (an ``nn.ModuleList``); the final state is every stage's, from the ranks
    that hold them, in stage order (a collective).
    """

    def __init__(self, cfg: Any, *, keep_final_state: bool = False):
        super().__init__(cfg.steps, keep_final_state=keep_final_state)
        self.cfg, self._recipe = cfg, pipeline_parallel
        self.model_config = pipeline_parallel.model_config(cfg.model, cfg.n_layers)
        self._names = {cls: name for name, cls in pipeline_parallel.SCHEDULES.items()}
        self.rows: dict[str, dict[str, Any]] = {}
        self._runs = 0
        self._saved: list[tuple[type, str, Any]] = []
        self._index_of: dict[int, int] = {}  # id(stage module) -> stage index
        self._stage_ids: set[int] = set()
        self._num_stages = 0
        self._schedule: str | None = None
        self._actions: list[tuple[str, int, int, float, float]] = []
        self._began = self._window = 0.0
        self._depth = 0
        self._idle: list[float] = []
        self._run_durations: list[float] = []
        self._run_last = 0.0

    def model_ready(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._runs += 1
        self._stage_ids, self._idle, self._run_durations = set(), [], []
        self._patch()
        if self._runs == 1:  # the recipe's own schedule: measured in full
            super().model_ready(model, optimizer)
            self._hook.remove()  # a ModuleList runs no forward: its first stage's output tells
            self._hook = model[0].register_forward_hook(self._record_dtype)
        self._model_of_run = model
        self._run_last = time.perf_counter()

    def _patch(self) -> None:
        if self._saved:
            return
        for cls, name in [
            (stage._PipelineStageBase, m)
            for m in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
        ] + [(schedules.PipelineScheduleSingle, "step"), (schedules.PipelineScheduleMulti, "step")]:
            original = cls.__dict__[name]
            self._saved.append((cls, name, original))
            wrap = self._timed_step if name == "step" else self._timed_action
            setattr(cls, name, wrap(original, name))

    def _unpatch(self) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved = []

    def _timed_step(self, original: Callable[..., Any], _: str) -> Callable[..., Any]:
        observer = self

        def step(schedule: Any, *args: Any, **kwargs: Any) -> Any:
            observer._depth += 1
            if observer._depth == 1:  # the outermost step: a new window
                observer._schedule = observer._names.get(type(schedule).__name__)
                observer._actions, observer._began = [], time.perf_counter()
            try:
                return original(schedule, *args, **kwargs)
            finally:
                observer._depth -= 1
                if observer._depth == 0:
                    observer._window = time.perf_counter() - observer._began
                    busy = sum(end - start for *_, start, end in observer._actions)
                    observer._idle.append(1.0 - busy / observer._window)

        return step

    def _timed_action(self, original: Callable[..., Any], name: str) -> Callable[..., Any]:
        observer = self

        def timed(stage: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            observer._index_of[id(stage.submod)] = stage.stage_index
            observer._stage_ids.add(stage.stage_index)
            observer._num_stages = stage.num_stages
            start = time.perf_counter()
            try:
                return original(stage, chunk, *args, **kwargs)
            finally:
                kind = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}.get(name)
                if kind is None:  # backward_one_chunk(chunk, loss, full_backward, ...)
                    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                    kind = "B" if full else "I"
                observer._actions.append(
                    (
                        kind,
                        stage.stage_index,
                        chunk,
                        start - observer._began,
                        time.perf_counter() - observer._began,
                    )
                )

        return timed

    def step_end(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        self._run_durations.append(now - self._run_last)
        if step == self.steps - 1:
            self._end_run()
        if self._runs == 1:
            super().step_end(step, loss)
        elif step == self.steps - 1:
            self._unpatch()
        self._run_last = time.perf_counter()

    def _end_run(self) -> None:
        """The run's figures, from every rank (collectives: every rank ends every run)."""
        steady = self._idle[1:] or self._idle  # after the first (warm-up) step
        actions = [
            [kind, s, mb, round(a * 1e3, 3), round(b * 1e3, 3)]
            for kind, s, mb, a, b in self._actions
        ]
        stages = sorted(self._stage_ids)
        pp_size = dist.get_world_size()
        timings = statistics.median(self._run_durations[1:] or self._run_durations)
        # one collective for every per-rank figure: (idle, actions, stage ids, window) per rank
        idle, timeline, stage_ids, windows = map(
            list,
            zip(
                *all_ranks(
                    (sum(steady) / len(steady), actions, stages, round(self._window * 1e3, 3))
                )
            ),
        )
        row = {
            "schedule": self._schedule,
            "stages_per_rank": len(stages),
            "bubble_fraction_theory": _bubble(pp_size, self.cfg.microbatches, len(stages)),
            "idle_fraction_measured_per_rank": idle,
            "timeline_per_rank": timeline,
            "seconds_per_step": timings,
        }
        self.rows[self._schedule] = row
        if self._runs == 1:
            split_points = self._recipe.even_split(
                _meta_model(self.model_config), self._recipe.TRANSFORMER_LM, self._num_stages
            )
            self.extras.update(
                schedule=self._schedule,
                split=self.cfg.split,
                pp_size=pp_size,
                num_stages=self._num_stages,
                stages_per_rank=len(stages),
                microbatches=self.cfg.microbatches,
                n_layers=self.model_config.n_layers,
                split_points=split_points,
                stage_ids_per_rank=stage_ids,
                bubble_fraction_theory=row["bubble_fraction_theory"],
                idle_fraction_measured_per_rank=idle,
                step_window_ms_per_rank=windows,
                timeline_per_rank=timeline,
            )
        if self.cfg.compare:
            self.extras["schedule_table"] = [
                self.rows.get(name) or self._refused(name, pp_size)
                for name in self._recipe.SCHEDULES
            ]
            self.extras["schedule_table"] = [r for r in self.extras["schedule_table"] if r]

    def _refused(self, name: str, pp_size: int) -> dict[str, Any] | None:
        """The recipe's reason for not running ``name`` here (None: it runs, later)."""
        try:
            self._recipe.check_schedule_runs_here(name, dist.get_backend())
            self._recipe.check_config_fits(dataclasses.replace(self.cfg, schedule=name), pp_size)
        except ValueError as refused:
            return {"schedule": name, "refused": str(refused)}
        return None

    def gather_final_state(self) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)  # not every stage on 0
        local = {
            self._index_of[id(m)]: {
                n: t.detach().cpu().clone()
                for n, t in get_model_state_dict(m, options=options).items()
            }
            for m in self._model
        }
        pieces = {index: state for piece in all_ranks(local) for index, state in piece.items()}
        state = {n: t for index in sorted(pieces) for n, t in pieces[index].items()}
        self.param_checksum = param_checksum(state.values())
        if self.keep_final_state:
            self.final_state = state

    def close(self) -> None:
        self._unpatch()
        super().close()


def _bubble(pp_size: int, microbatches: int, stages_per_rank: int) -> float:
    return (pp_size - 1) / (stages_per_rank * microbatches + pp_size - 1)


def _meta_model(model_config: Any) -> nn.Module:
    with torch.device("meta"):  # the module names only
        return TransformerLM(model_config)
