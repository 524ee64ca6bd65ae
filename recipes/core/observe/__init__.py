"""Measure a copyable recipe from outside: the observer it calls, and ``prove``, which runs the
recipe's function with one and returns a ``RecipeResult``.

- ``base``: ``Observer``, what every recipe's proof measures (the recipe calls
  ``observer.model_ready(model, optimizer)`` and ``observer.step_end(step, loss)``);
- one module per family of recipes, each an ``Observer`` subclass per recipe that needs more:
  ``sharding`` (fsdp2, fsdp, sharded_accumulation, zero), ``model_parallel`` (tensor, hybrid,
  context and expert parallel), ``pipeline``, ``training`` (one idea added to the DDP loop:
  accumulation, clipping, activation checkpointing, float8, performance), ``checkpoints``
  (meta_init, sharded_checkpoint, hf_checkpoint), ``finetune``, ``runs`` (ddp_spawn,
  lightning_fabric, hang_diagnosis; collectives' probe) and ``lightning`` (a Lightning Callback);
- ``registry``: the one table from a recipe's name to its observer;
- ``proof``: ``prove``.

What a subclass measures lands in ``extras``, which ``prove`` adds to the result's. A test that
injects a fault passes its own subclass to ``prove``: the recipe has no option for it.
"""

from recipes.core.observe.base import Observer
from recipes.core.observe.proof import prove
from recipes.core.observe.runs import ResumableObserver
from recipes.core.observe.sharding import ClassicFSDPObserver, ShardedObserver

# what the tests and scripts import by these names
__all__ = ["ClassicFSDPObserver", "Observer", "ResumableObserver", "ShardedObserver", "prove"]
