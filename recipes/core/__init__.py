"""The pieces every recipe shares, each defined once.

- ``config``: ``RecipeError``, the ``Config`` and ``TrainConfig`` base dataclasses (``opt``
  declares a field's help and range), the command-line mapping.
- ``world``: join a ``torch.distributed`` world (torchrun, spawn or alone), and ``spawn_world``.
- ``workload``: the small decoder-only transformer LM and the synthetic token dataset.
- ``result``: ``RecipeResult`` and the measurements that fill it.
- ``observe``: measure a copyable recipe from outside (``Observer``, ``prove``); ``prove``:
  ``python -m recipes.core.prove ddp_torchrun`` prints its JSON result.
- ``log``: the rank-0 logger.
"""
