"""tensor_parallel: the split model computes what the unsplit one does (outputs, gradients,
training).

The recipe is copyable and returns its losses; the harness (``tests.helpers.tp_result``: ``prove``
with ``recipes.core.observe.TensorParallelObserver``) measures the rest from outside: the final
weights, the bytes each rank holds, and what the split did (tp size, sequence and loss parallel)."""

import contextlib
import itertools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from recipes import tensor_parallel
from recipes.core.observe import Observer, prove
from recipes.core.world import join_world
from recipes.parallelize import TPPlanError, apply_tp, check_tp_fits, transformer_lm_plan
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset
from tests.helpers import (
    BACKENDS,
    assert_losses_close,
    assert_states_close,
    expected_tp_param_fraction,
    require_world,
    single_process_reference,
    spawn_world,
    tp_result,
    with_fields,
)

STEPS = 3
CFG = tensor_parallel.TPConfig(steps=STEPS, precision="fp32", timeout_s=120)
# Every combination of the two options: each one changes which collectives run and where.
OPTIONS = [
    dict(sequence_parallel=sp, loss_parallel=lp)
    for sp, lp in itertools.product([False, True], repeat=2)
]


def forward_backward_differences(world, options: list[dict]) -> list[dict[str, float]]:
    """On every rank: largest |TP - unsplit| of the logits and of each full gradient, per option
    set."""
    mesh = init_device_mesh(world.device.type, (world.world_size,), mesh_dim_names=("tp",))
    device = world.device
    dataset = make_dataset("tiny", 8, seed=1)
    inputs, targets = dataset.tokens[:8, :-1].to(device), dataset.tokens[:8, 1:].to(device)
    reference = build_model("tiny", seed=3, device=device)
    reference_logits = reference(inputs)
    lm_loss(reference_logits, targets).backward()
    differences = []
    for opts in options:
        model = apply_tp(
            build_model("tiny", seed=3, device=device), mesh, plan=transformer_lm_plan(**opts)
        )
        logits = model(inputs)
        assert isinstance(logits, DTensor) == opts["loss_parallel"], (
            "loss parallel keeps the logits sharded"
        )
        with loss_parallel() if opts["loss_parallel"] else contextlib.nullcontext():
            lm_loss(logits, targets).backward()
        full_logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        diffs = {"logits": (full_logits - reference_logits).abs().max().item()}
        for (name, p), (ref_name, ref_p) in zip(
            model.named_parameters(), reference.named_parameters()
        ):
            assert name == ref_name, "apply_tp keeps parameter names"
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            diffs[name] = (grad - ref_p.grad).abs().max().item()
        differences.append(diffs)
        # Every parameter is a DTensor (norms included), so the foreach AdamW that GPUs default to
        # works.
        assert all(isinstance(p, DTensor) for p in model.parameters()), "a plain parameter is left"
        torch.optim.AdamW(model.parameters(), foreach=True).step()
    return differences


def tp_world(configs, backend):
    """One spawned world: the forward/backward comparison, then a training run per config (the
    recipe joins this world: setup_distributed finds it)."""
    with join_world(backend, timeout_s=120) as world:
        return forward_backward_differences(world, OPTIONS), [tp_result(cfg) for cfg in configs]


# 4 ranks in the slow set (issue 30): the split is proven at 2 ranks in the default run, and 4
# repeats it with a larger world for ~13 s of CPU (DTensor's collectives on CPU are slow).
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_equals_unsplit_model(world_size, backend):
    # Training runs every option set on 2 ranks; on 4, both options at once (the forward/backward
    # check runs every set on both world sizes).
    trained = OPTIONS if world_size == 2 else OPTIONS[-1:]
    configs = [with_fields(CFG, **opts) for opts in trained]
    require_world(backend, world_size)
    differences, results = spawn_world(tp_world, world_size, configs, backend, deadline_s=240)
    # 1. One forward + backward: the same logits and the same (all-gathered) gradient for every
    # parameter.
    for opts, diffs in zip(OPTIONS, differences):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-5, f"{opts}: {worst} differs by {diffs[worst]:.2e}"
    # 2. Training: the losses and final weights of single-process training (the DDP recipe on 1
    # process).
    reference = single_process_reference(steps=STEPS)
    seq_len = MODEL_PRESETS[CFG.model].seq_len
    for opts, result in zip(trained, results):
        assert result.extras["tp_size"] == world_size and result.backend == backend
        # Measured on the model: the final norm's input is sequence-split, the logits
        # vocabulary-split.
        assert (result.extras["sequence_parallel"], result.extras["loss_parallel"]) == tuple(
            opts.values()
        )
        # Sequence parallel: the residual stream between blocks holds 1/N of the sequence per rank.
        split = world_size if opts["sequence_parallel"] else 1
        assert result.extras["residual_seq_len_per_rank"] == seq_len // split
        assert_losses_close(result.losses, reference.losses, atol=1e-5)
        assert_states_close(result.final_state, reference.final_state, atol=1e-5)
        # 3. Each rank holds 1/N of the split weights plus the replicated norms and biases.
        assert result.extras["param_fraction_per_rank"] == pytest.approx(
            expected_tp_param_fraction(world_size)
        )
        # AdamW keeps two moments per parameter, shaped like its shard: the optimizer state is split
        # too.
        assert result.extras["optimizer_bytes_per_rank"] == pytest.approx(
            2 * result.extras["param_bytes_per_rank"], rel=0.01
        )


def test_tp_size_that_does_not_split_the_heads_is_rejected():
    # The recipe's check, as it calls it (a ValueError of recipes/parallelize.py's own: the recipe
    # copies without our package, so it cannot raise RecipeError; its main() prints the one line).
    tiny = MODEL_PRESETS["tiny"]
    with pytest.raises(
        TPPlanError, match=r"cannot split n_heads=4.*use a tensor-parallel size of 1, 2, 4$"
    ):
        check_tp_fits(
            3,
            n_heads=tiny.n_heads,
            mlp_width=tiny.mlp_ratio * tiny.dim,
            vocab_size=tiny.vocab_size,
            seq_len=tiny.seq_len,
        )


class Layout(Observer):
    """Every parameter's DTensor placements and local shape, read once the model is split."""

    def model_ready(self, model, optimizer):
        super().model_ready(model, optimizer)
        self.extras["params"] = [
            (name, type(p).__name__, getattr(p, "placements", None), tuple(p.to_local().shape))
            for name, p in model.named_parameters()
        ]


def split_both_ways(cfg):
    """tensor_parallel.train as written (its own plan, its own parallelize_module call), then with
    that call replaced by parallelize.apply_tp with transformer_lm_plan, the plan the job and
    hybrid_parallel use. Returns (losses, layout) of each, measured by the harness."""
    own = tensor_parallel.parallelize_module

    def composed(model, mesh, plan):
        options = dict(sequence_parallel=cfg.sequence_parallel, loss_parallel=cfg.loss_parallel)
        return apply_tp(model, mesh, plan=transformer_lm_plan(**options))

    runs = []
    for split in (own, composed):
        tensor_parallel.parallelize_module = split
        try:
            result = prove(
                tensor_parallel.train, cfg, name="tensor_parallel", observer=Layout(cfg.steps)
            )
        finally:
            tensor_parallel.parallelize_module = own
        runs.append((result.losses, result.extras["params"]))
    return runs


def both_ways_world(configs, backend):
    with join_world(backend, timeout_s=120):
        return [split_both_ways(cfg) for cfg in configs]


def test_the_recipes_plan_splits_as_apply_tp_with_transformer_lm_plan_does():
    """The recipe writes its plan out and calls parallelize_module itself (the lesson); the job
    and hybrid_parallel use parallelize.apply_tp(plan=transformer_lm_plan(...)). The same shard of
    every parameter and the same losses, with and without sequence and loss parallel."""
    configs = [with_fields(CFG, **opts) for opts in (OPTIONS[0], OPTIONS[-1])]
    for own, composed in spawn_world(both_ways_world, 2, configs, "gloo", deadline_s=240):
        assert own == composed
        losses, params = own
        assert len(losses) == STEPS and all(kind == "DTensor" for _, kind, _, _ in params)
        assert any(placements == (Shard(0),) for _, _, placements, _ in params)


def test_compile_and_eager_together_are_refused_in_one_line():
    with pytest.raises(ValueError, match="^compile and eager contradict each other"):
        tensor_parallel.TPConfig(compile=True, eager=True)
