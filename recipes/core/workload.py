"""The data-loading helpers the tests share; the model and data live in ``recipes.toy``.

``distributed_loader`` and ``iterate_steps`` give each rank a disjoint share of every epoch; the
model, the dataset and the loss are re-exported from ``recipes.toy``, the module a user copies.
"""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from recipes.toy import (  # noqa: F401  (re-exported: the tests import them from here)
    MODEL_PRESETS,
    Block,
    ModelConfig,
    SyntheticTokens,
    TransformerLM,
    build_model,
    lm_loss,
    make_dataset,
)

__all__ = [
    "ModelConfig",
    "MODEL_PRESETS",
    "TransformerLM",
    "Block",
    "build_model",
    "lm_loss",
    "SyntheticTokens",
    "make_dataset",
    "distributed_loader",
    "iterate_steps",
]


# --8<-- [start:distributed_loader]
def distributed_loader(
    dataset: Dataset,
    *,
    rank: int,
    world_size: int,
    per_rank_batch_size: int,
    seed: int = 0,
    pin_memory: bool = False,
) -> tuple[DataLoader, DistributedSampler]:
    """Each rank reads a disjoint 1/world_size of every epoch.

    With the same ``seed``, global step ``s`` covers the same samples on every world size: the
    sampler shuffles all indices with ``seed + epoch`` and deals them round-robin, so the union of
    the ranks' batches is the single-process batch. ``drop_last`` keeps every step's global batch
    full.
    """
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    # pinned host memory: asynchronous copies to the GPU
    loader = DataLoader(
        dataset,
        batch_size=per_rank_batch_size,
        sampler=sampler,
        drop_last=True,
        pin_memory=pin_memory,
    )
    return loader, sampler


def iterate_steps(loader: DataLoader, sampler: DistributedSampler, num_steps: int):
    """Yield ``(step, batch)`` for ``num_steps`` steps, across as many epochs as that takes.

    Pitfall: without ``sampler.set_epoch(epoch)`` every epoch repeats the first epoch's order.
    """
    step, epoch = 0, 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step == num_steps:
                return
            yield step, batch
            step += 1
        epoch += 1


# --8<-- [end:distributed_loader]
