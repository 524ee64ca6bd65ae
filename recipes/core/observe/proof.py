"""``prove``: a recipe's function run with an observer, its measurements as a ``RecipeResult``.

The observer is the one ``recipes.core.observe.registry.OBSERVERS`` registers for the recipe's
name, else ``Observer``; a recipe that trains nothing is measured by its ``PROBES`` function
instead. The recipe runs inside ``recipes.core.world.recipe_world``: in the caller's world if one
exists, else joining and leaving its own, guarded. A recipe whose idea needs more than its losses
returns a small dataclass with a ``losses`` field (amp: the loss scale of each step): its other
fields go into ``extras`` as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from recipes.core.observe.base import Observer
from recipes.core.observe.registry import EXTRAS, OBSERVERS, PROBES
from recipes.core.result import RecipeResult, peak_memory_bytes
from recipes.core.throughput import Workload
from recipes.core.world import recipe_world
from recipes.toy import MODEL_PRESETS

__all__ = ["prove"]


def prove(
    train_fn: Callable[..., Any],
    cfg: Any,
    *,
    name: str,
    keep_final_state: bool = False,
    observer: Observer | None = None,
) -> RecipeResult:
    """``train_fn(cfg, observer=...)`` measured from outside; the result every rank returns.

    ``cfg`` needs ``steps`` (unless its observer knows them: meta_init), ``model`` (a
    MODEL_PRESETS key) and ``global_batch_size`` (or ``batch_size``, for one process; neither:
    no tokens, for a recipe that trains nothing).
    ``keep_final_state``: the final parameters on CPU in ``final_state`` (tests compare them).
    ``observer``: a test's own (fault injection; it carries its own ``keep_final_state``);
    by default the one ``OBSERVERS`` registers for ``name``, else ``Observer``.
    """
    # the recipe's own join and leave, guarded (the collective timeout its config sets, if any)
    world = recipe_world(getattr(cfg, "timeout_s", 300.0))
    if name in PROBES:  # a recipe that trains nothing: no model, no steps to observe
        with world:
            return PROBES[name](train_fn, cfg)
    if observer is None:
        observer = (
            OBSERVERS[name](cfg, keep_final_state=keep_final_state)
            if name in OBSERVERS
            else Observer(cfg.steps, keep_final_state=keep_final_state)
        )
    observer.keep_final_state = observer.keep_final_state or keep_final_state
    observer.extras_fn = EXTRAS.get(name)
    try:
        with world:
            returned = train_fn(cfg, observer=observer)
    finally:
        observer.close()
    returned_extras: dict[str, Any] = {}
    if dataclasses.is_dataclass(returned):  # the losses and what the recipe's idea adds
        returned_extras = {k: v for k, v in dataclasses.asdict(returned).items() if k != "losses"}
        losses = returned.losses
    else:
        losses = returned
    if observer.param_checksum is None:
        raise RuntimeError(
            f"{name}: the recipe never called observer.step_end for its last step "
            f"({observer.steps - 1}); it ran {len(observer.durations)} step(s)"
        )
    # the devices that computed: the ranks, or the GPUs one DataParallel process drives
    devices = (
        observer.extras.get("gpus") or observer.world_size if observer.device.type == "cuda" else 1
    )
    # single_gpu: batch_size; meta_init trains nothing: no tokens per step (tokens/s and MFU 0)
    batch = getattr(cfg, "global_batch_size", None) or getattr(cfg, "batch_size", 0)
    # an observer's model_config: the FLOPs a token costs where the preset's are not them (MoE),
    # or the shapes of a model that is not a cookbook preset (a Hugging Face model)
    workload = Workload(
        getattr(observer, "model_config", None) or MODEL_PRESETS[cfg.model],
        batch,
        observer.precision,
    )
    speed = workload.measure(observer.seconds_per_step, observer.device, devices)
    if not getattr(observer, "counts_model_flops", True):  # the FLOPs formula does not fit it
        speed.update(model_tflops=0.0, mfu=None)
    return RecipeResult(
        recipe=name,
        world_size=observer.world_size,
        backend=observer.backend,
        device=str(observer.device),
        losses=list(losses),
        param_checksum=observer.param_checksum,
        seconds_per_step=observer.seconds_per_step,
        peak_memory_bytes=peak_memory_bytes(observer.device),
        extras={"memory_per_rank": observer.memory_per_rank, **observer.extras, **returned_extras},
        final_state=observer.final_state,
        **{
            **speed,
            # where the forward's dtype is not the whole story (float8: bf16 outputs, bf16 peak)
            **({"precision": observer.precision_label} if observer.precision_label else {}),
        },
    )
