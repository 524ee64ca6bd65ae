"""Which observer measures which recipe: one table, read by ``prove``.

``OBSERVERS``: the recipes whose proof measures more than ``Observer`` does, name -> the class
(or factory) made as ``cls(cfg, keep_final_state=...)``. ``EXTRAS``: what a recipe reports beyond
the common figures, read from its model and optimizer at the last step (while its process group
exists; a collective where it gathers from every rank). ``PROBES``: the recipes that train
nothing, name -> ``fn(recipe's function, cfg) -> RecipeResult``, called instead of observing
steps. A recipe in none of them is measured by ``Observer`` alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from recipes.core.observe.base import Observer
from recipes.core.observe.checkpoints import (
    CheckpointObserver,
    HFCheckpointObserver,
    MetaInitObserver,
)
from recipes.core.observe.finetune import FinetuneObserver
from recipes.core.observe.model_parallel import (
    ContextParallelObserver,
    ExpertParallelObserver,
    HybridObserver,
    TensorParallelObserver,
)
from recipes.core.observe.pipeline import PipelineObserver
from recipes.core.observe.runs import (
    HangObserver,
    ResumableObserver,
    SpawnedObserver,
    probe_collectives,
)
from recipes.core.observe.sharding import (
    AccumulationObserver,
    ClassicFSDPObserver,
    ShardedObserver,
    zero_extras,
)
from recipes.core.observe.training import (
    CheckpointingObserver,
    ClippingObserver,
    Float8Observer,
    GradAccumulationObserver,
    LocalSGDObserver,
    PerformanceObserver,
    data_parallel_extras,
)

__all__ = ["EXTRAS", "OBSERVERS", "PROBES"]


def lightning_observer(cfg: Any, *, keep_final_state: bool = False) -> Observer:
    """recipes/lightning_trainer.py's: a Lightning Callback (``observe.lightning``), imported only
    when asked for: Lightning takes seconds to import."""
    from recipes.core.observe.lightning import LightningObserver

    return LightningObserver(cfg, keep_final_state=keep_final_state)


OBSERVERS: dict[str, Callable[..., Observer]] = {
    "activation_checkpointing": CheckpointingObserver,
    "context_parallel": ContextParallelObserver,
    "ddp_spawn": SpawnedObserver,
    "expert_parallel": ExpertParallelObserver,
    "finetune": FinetuneObserver,
    "float8": Float8Observer,
    "fsdp": ClassicFSDPObserver,
    "fsdp2": ShardedObserver,
    "grad_accumulation": GradAccumulationObserver,
    "grad_clipping": ClippingObserver,
    "hang_diagnosis": HangObserver,
    "hf_checkpoint": HFCheckpointObserver,
    "hybrid_parallel": HybridObserver,
    "lightning_fabric": ResumableObserver,
    "lightning_trainer": lightning_observer,
    "local_sgd": LocalSGDObserver,
    "meta_init": MetaInitObserver,
    "performance": PerformanceObserver,
    "pipeline_parallel": PipelineObserver,
    "sharded_accumulation": AccumulationObserver,
    "sharded_checkpoint": CheckpointObserver,
    "tensor_parallel": TensorParallelObserver,
}

EXTRAS: dict[str, Callable[..., dict[str, Any]]] = {
    "data_parallel": data_parallel_extras,
    "zero": zero_extras,
}

PROBES: dict[str, Callable[..., Any]] = {"collectives": probe_collectives}
