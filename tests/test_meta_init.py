"""meta_init: a model built on meta, sharded and initialised shard by shard equals a normal build
with the same seed (the cookbook's model by replay and by a seed checkpoint, GPT-2 by a seed
checkpoint), and no rank ever holds the whole model.

The recipe is measured from outside (the harness's ``prove`` with
recipes.core.observe.MetaInitObserver: each rank's shard bytes, the checksum and the full initial
state gathered to rank 0, read before the model's first forward)."""

from __future__ import annotations

import os

import pytest
import torch

from recipes import meta_init
from recipes.parallelize import build_sharded_on_meta
from recipes.toy import build_model, lm_loss, make_dataset
from tests.helpers import PYTHON, last_json, run_cli, run_world

SEED = 3
CFG = meta_init.MetaInitConfig(seed=SEED, backend="gloo", timeout_s=60)


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)


def gpt2_sharded_from_seed_checkpoint(path: str):
    """Rank side: GPT-2 on meta, fully_shard per GPT2Block, to_empty, load the seed checkpoint."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from recipes.core.memory import model_state_bytes
    from recipes.core.state import all_ranks, full_state_on_rank0

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_sharded_on_meta(
        lambda: GPT2LMHeadModel(gpt2_config()),
        mesh,
        block_types=(GPT2Block,),
        device=torch.device("cpu"),
    )
    meta_init.load_seed_checkpoint(model, path)
    tied = model.lm_head.weight is model.transformer.wte.weight
    shard_bytes = all_ranks(model_state_bytes(model)["param_bytes"])
    return full_state_on_rank0(model)[0], shard_bytes, tied


def dtensor_random_init_on_cpu() -> torch.Tensor:
    """Rank side: nn.init.normal_ straight on a sharded DTensor, both ranks seeded alike."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    param = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    torch.manual_seed(0)
    torch.nn.init.normal_(param)
    return param.full_tensor()


def proven(cfg):
    """meta_init.run(cfg) measured by the harness, with the full initial state on rank 0."""
    from recipes.core.observe import prove

    return prove(meta_init.run, cfg, name="meta_init", keep_final_state=True)


def rank_main(paths: tuple[str, str]):
    """Everything on one world of 2 (run_world has joined it): one spawn for the whole test."""
    seed_dir, gpt2_dir = paths
    replay = proven(CFG)
    seeded = proven(
        meta_init.MetaInitConfig(
            seed=SEED,
            method="seed_checkpoint",
            seed_checkpoint_dir=seed_dir,
            backend="gloo",
            timeout_s=60,
        )
    )
    return replay, seeded, gpt2_sharded_from_seed_checkpoint(gpt2_dir), dtensor_random_init_on_cpu()


def assert_equal_states(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), f"{name} differs from the normal build"


# The seed checkpoints are written outside any world, as the recipe's first step is: DCP warns
# that it saves in one process even when told so (no_dist=True).
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_meta_init_equals_a_normal_build_and_no_rank_holds_the_model(tmp_path):
    from transformers import GPT2LMHeadModel

    # The seed checkpoints: the one full build of that method, here in the test's own process.
    reference = build_model("tiny", seed=SEED)
    meta_init.write_seed_checkpoint(reference, str(tmp_path / "seed"))
    torch.manual_seed(SEED)
    gpt2 = GPT2LMHeadModel(gpt2_config())
    meta_init.write_seed_checkpoint(gpt2, str(tmp_path / "gpt2"))

    paths = (str(tmp_path / "seed"), str(tmp_path / "gpt2"))
    per_rank = run_world(rank_main, 2, [paths], deadline_s=170)
    replay, seeded, (gpt2_state, gpt2_bytes, tied), random_init = per_rank[0]

    expected = reference.state_dict()
    tokens = make_dataset("tiny", 2, seed=SEED).tokens[:2]
    with torch.no_grad():
        expected_loss = lm_loss(reference(tokens[:, :-1]), tokens[:, 1:]).item()
    for result in (replay, seeded):
        assert_equal_states(result.final_state, expected)  # bit for bit
        assert result.losses == pytest.approx([expected_loss], abs=1e-6)
        checksum = sum(t.double().sum().item() for t in expected.values())
        assert result.param_checksum == pytest.approx(checksum, abs=1e-6)
        full = result.extras["full_model_bytes"]
        # Each rank holds half of the parameters, and at most one module more in full (replay).
        assert result.extras["param_bytes_per_rank"] == [full // 2, full // 2]
    # what replay_init returned on each rank (the recipe's MetaInitRun)
    largest = [rank_results[0].extras["largest_module_bytes"] for rank_results in per_rank]
    assert all(0 < extra and full // 2 + extra < full for extra in largest), largest

    # GPT-2 (tied lm_head / wte, Conv1D) through a seed checkpoint: equal, tie kept, half per rank.
    assert_equal_states(gpt2_state, gpt2.state_dict())
    assert tied
    gpt2_full = sum(p.numel() * p.element_size() for p in gpt2.parameters())
    assert gpt2_bytes == [gpt2_full // 2, gpt2_full // 2]

    # Pitfall: DTensor random init on a CPU mesh draws each shard from the rank's own generator,
    # so rank 1's rows repeat rank 0's: not the full tensor a normal build draws.
    assert torch.equal(random_init[:4], random_init[4:])


def test_missing_seed_checkpoint_is_one_line_and_exit_2(tmp_path):
    missing = str(tmp_path / "nothing")
    with pytest.raises(ValueError, match="create it once with"):
        meta_init.run(
            meta_init.MetaInitConfig(method="seed_checkpoint", seed_checkpoint_dir=missing)
        )
    proc = run_cli(
        [
            PYTHON,
            "-m",
            "recipes.meta_init",
            "--method",
            "seed_checkpoint",
            "--seed-checkpoint-dir",
            missing,
        ],
        timeout_s=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: no seed checkpoint in {missing}; create it once with python -m recipes.meta_init "
        f"--create-seed-checkpoint --seed-checkpoint-dir {missing}"
    ]


# Slow: torchrun launches of 2 fresh interpreters; the same code runs in the world above.
@pytest.mark.slow
def test_torchrun_launches_equal_a_normal_build(tmp_path):
    seed_dir = str(tmp_path / "seed")
    proc = run_cli(
        [
            PYTHON,
            "-m",
            "recipes.meta_init",
            "--create-seed-checkpoint",
            "--seed-checkpoint-dir",
            seed_dir,
        ],
        timeout_s=120,
    )
    assert proc.returncode == 0 and os.path.exists(os.path.join(seed_dir, ".metadata")), proc.stderr
    reference = build_model("tiny", seed=0).state_dict()
    expected = sum(t.double().sum().item() for t in reference.values())
    for method in ("replay", "seed_checkpoint"):
        # through the harness, which prints the measured result as JSON
        command = [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",
            "meta_init",
            "--backend",
            "gloo",
            "--method",
            method,
            "--seed-checkpoint-dir",
            seed_dir,
        ]
        proc = run_cli(command, timeout_s=170)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = last_json(proc.stdout)
        assert result["param_checksum"] == pytest.approx(expected, abs=1e-6), method
        extras = result["extras"]
        assert extras["param_bytes_per_rank"] == [extras["full_model_bytes"] // 2] * 2


def test_a_seed_checkpoint_dir_that_names_a_file_is_refused_in_one_line(tmp_path):
    afile = tmp_path / "weights.pt"
    afile.write_bytes(b"")
    with pytest.raises(ValueError, match=r"^seed_checkpoint_dir='.*weights.pt' is a file; name a"):
        meta_init.MetaInitConfig(seed_checkpoint_dir=str(afile))
