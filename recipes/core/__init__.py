"""The proof harness: it measures the copyable recipes from outside, and no recipe imports it.

- ``observe``: the observer a recipe calls (``model_ready``, ``step_end``), one observer per
  family of recipes, the registry, and ``prove``, which returns a ``RecipeResult``;
- ``prove``: ``python -m recipes.core.prove ddp_torchrun`` prints that result as JSON;
- ``world``: ``join_world`` (``recipes.dist_setup.setup_distributed`` as a with-block) and
  ``recipe_world``, the guard around a recipe's own join; ``liveness``: naming a dead peer;
- ``spawn``: ``spawn_world``, a world of N processes for the tests that cannot hang;
- ``result``, ``throughput``, ``memory``, ``state``, ``counting``: the measurements;
- ``errors``: bad input and failures as one line; ``log``: the rank-0 logger;
- ``workload``: the toy model and data (``recipes.toy``) and the loaders the tests share.
"""
