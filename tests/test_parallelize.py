"""recipes/parallelize.py, the file users copy: torch only, every refusal a ValueError subclass of
its own in one line naming what the model has, and each function leaving the numbers alone on the
cookbook's model (parity on HF models and multi-rank worlds: tests/test_third_party_models.py,
the recipes' tests; each function copied alone: tests/test_standalone.py)."""

import ast
import inspect
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from recipes import parallelize, toy

ERRORS = [
    parallelize.CheckpointingError,
    parallelize.CompileTargetError,
    parallelize.ShardingError,
    parallelize.FSDPWrapError,
    parallelize.TPPlanError,
]


def test_the_file_imports_torch_and_nothing_of_ours():
    tree = ast.parse(Path(inspect.getfile(parallelize)).read_text())
    modules = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert all(
        m.split(".")[0]
        in {"torch", "fnmatch", "functools", "itertools", "re", "math", "collections", "__future__"}
        for m in modules
    ), modules
    for error in ERRORS:
        assert (
            issubclass(error, ValueError)
            and error.__doc__
            and error.__module__ == parallelize.__name__
        )


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def one_step(model):
    tokens = toy.make_dataset("tiny", 2)[0][0].unsqueeze(0).repeat(2, 1)
    loss = toy.lm_loss(model(tokens), tokens)
    loss.backward()
    return loss.item()


@pytest.mark.parametrize(
    "call, error, names",
    [
        (
            lambda mesh: parallelize.apply_fully_shard(
                nn.Sequential(nn.Linear(2, 2)), mesh, block_types=(toy.Block,)
            ),
            parallelize.ShardingError,
            "Linear",
        ),
        (
            lambda mesh: parallelize.apply_activation_checkpointing(
                nn.Sequential(nn.Linear(2, 2)), block_types=(toy.Block,)
            ),
            parallelize.CheckpointingError,
            "Linear",
        ),
        (
            lambda mesh: parallelize.apply_compile(
                nn.Sequential(nn.Linear(2, 2)), block_types=(toy.Block,)
            ),
            parallelize.CompileTargetError,
            "Linear",
        ),
        (
            lambda mesh: parallelize.apply_tp(
                toy.build_model("tiny"), mesh, plan={"nowhere": parallelize.ReplicateParallel()}
            ),
            parallelize.TPPlanError,
            "nowhere",
        ),
    ],
)
def test_a_request_that_matches_nothing_is_refused_in_one_line(world_of_one, call, error, names):
    with pytest.raises(error) as refused:
        call(world_of_one)
    assert "\n" not in str(refused.value) and names in str(refused.value)


def test_each_function_leaves_the_first_step_loss_unchanged(world_of_one):
    expected = one_step(toy.build_model("tiny"))
    checkpointed = toy.build_model("tiny")
    assert (
        len(parallelize.apply_activation_checkpointing(checkpointed, block_types=(toy.Block,))) == 2
    )
    compiled = parallelize.apply_compile(
        toy.build_model("tiny"), block_types=(toy.Block,), backend="eager"
    )
    sharded = parallelize.apply_fully_shard(
        toy.build_model("tiny"), world_of_one, block_types=(toy.Block,)
    )
    split = parallelize.apply_tp(
        toy.build_model("tiny"), world_of_one, plan=parallelize.transformer_lm_plan()
    )
    for model in (checkpointed, compiled, sharded, split):
        assert one_step(model) == pytest.approx(expected, abs=1e-6)
    names = {name for name, _ in toy.build_model("tiny").named_parameters()}
    assert {name for name, _ in compiled.named_parameters()} == names  # compile renames nothing
