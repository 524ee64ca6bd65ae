"""grad_clipping: one total norm over the mesh, equal to one process on every layout."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from recipes import grad_clipping
from recipes.core.observe import prove
from recipes.parallelize import MeshError
from tests.helpers import PYTHON, assert_states_close, last_json, run_alone, run_world
from tests.helpers import run_cli as cli

Config = grad_clipping.GradClippingConfig


def clip_result(cfg):
    """grad_clipping.train(cfg) measured by the harness: its RecipeResult with the merged final
    state, and the norms each rank clipped with (recipes.core.observe.ClippingObserver records
    them around torch's clipping functions)."""
    return prove(grad_clipping.train, cfg, name="grad_clipping", keep_final_state=True)


def reference():
    """One process, the whole batch, torch's clip_grad_norm_: what every layout must equal."""
    return run_alone(clip_result, Config(layout="single"))


def assert_equals_one_process(result, ref):
    # Clipping is active (the norm is above max_norm), so a wrong norm would change the weights.
    assert min(ref.extras["grad_norms"]) > 5 * Config.max_grad_norm
    assert result.extras["grad_norms"] == pytest.approx(ref.extras["grad_norms"], abs=1e-6)
    for per_rank in result.extras["grad_norms_per_rank"]:  # the same total on every rank
        assert per_rank == pytest.approx([per_rank[0]] * len(per_rank), abs=1e-6)
    assert result.losses == pytest.approx(ref.losses, abs=1e-5)
    assert_states_close(result.final_state, ref.final_state, atol=1e-6)


def gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=32,
        attn_implementation="eager",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # no dropout: the ranks must compute what one process does
    return GPT2LMHeadModel(config)


def gpt2_clip(max_norm: float = 0.05):
    """Hugging Face GPT-2 (tied embeddings, fused qkv): one backward on this rank's share of a
    fixed batch, fully_shard-ed when in a world, then clip_grad_norm_across. Returns the norm and
    the clipped gradients, unsharded."""
    from torch.distributed.tensor import DTensor
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from recipes.parallelize import apply_fully_shard

    model = gpt2()
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    world = dist.get_world_size()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        model = apply_fully_shard(model, mesh, block_types=(GPT2Block,))
        tokens = tokens.chunk(world)[dist.get_rank()]
    model(tokens, labels=tokens).loss.backward()
    norm = grad_clipping.clip_grad_norm_across(model.parameters(), max_norm)
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in model.named_parameters()
    }
    return float(norm), grads


def clip_layouts_and_gpt2(cfg):
    """One spawned world for both: the recipe's configs, and "gpt2"."""
    return gpt2_clip() if cfg == "gpt2" else clip_result(cfg)


def test_every_two_rank_layout_equals_one_process_and_the_pitfalls_differ():
    ref = reference()
    layouts = ["ddp", "fsdp", "tp", "pp"]
    configs = [Config(layout=layout) for layout in layouts] + [
        Config(layout="ddp", clip="torch"),
        Config(layout="pp", clip="torch"),
        Config(layout="fsdp", clip="local_shards"),
    ]
    *results, ddp_torch, pp_torch, fsdp_local, (gpt2_norm, gpt2_grads) = run_world(
        clip_layouts_and_gpt2, 2, [*configs, "gpt2"], deadline_s=300
    )
    for layout, result in zip(layouts, results):
        assert result.extras["layout"] == layout
        assert_equals_one_process(result, ref)
    # DDP: every rank holds every all-reduced gradient, so torch's clip_grad_norm_ is right as is.
    assert_equals_one_process(ddp_torch, ref)
    # Pitfall (torchtitan#596): torch's clip_grad_norm_ on a stage sees only that stage's gradients.
    for step, stage_norms in enumerate(pp_torch.extras["grad_norms_per_rank"]):
        assert all(norm < ref.extras["grad_norms"][step] - 1e-3 for norm in stage_norms)
    # Pitfall (pytorch#170862-like): on local shards each rank gets its own, smaller norm.
    for step, rank_norms in enumerate(fsdp_local.extras["grad_norms_per_rank"]):
        assert rank_norms[0] != pytest.approx(rank_norms[1], abs=1e-4)
        assert all(norm < ref.extras["grad_norms"][step] - 1e-3 for norm in rank_norms)
    for wrong in (pp_torch, fsdp_local):  # ... and so the weights differ from one process
        with pytest.raises(AssertionError):
            assert_states_close(wrong.final_state, ref.final_state, atol=1e-4)
    # A model the cookbook did not write: Hugging Face GPT-2 under fully_shard, against one
    # process clipping with torch's clip_grad_norm_.
    model = gpt2()
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    model(tokens, labels=tokens).loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    assert ref_norm > 5 * 0.05 and gpt2_norm == pytest.approx(ref_norm, rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(gpt2_grads[name], p.grad, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize(
    "layouts",
    [
        ["hsdp", "fsdp_tp"],
        # slow: a third 4-rank config; its two pieces (fully_shard's DTensor norm, the pp sum) are
        # each covered by the 2-rank layouts.
        pytest.param(["pp_fsdp"], marks=pytest.mark.slow),
    ],
)
def test_four_rank_layouts_equal_one_process(layouts):
    # fsdp_tp: TP'd weights are 2-D DTensors (dp x tp), the rest 1-D on dp: two meshes to combine.
    ref = reference()
    results = run_world(
        clip_result, 4, [Config(layout=layout) for layout in layouts], deadline_s=300
    )
    for layout, result in zip(layouts, results):
        assert (result.extras["layout"], result.extras["mesh"]) == (layout, [2, 2])
        assert_equals_one_process(result, ref)


@pytest.mark.slow  # 8 ranks on CPU: ~4x the 4-rank world's time; the 2-D cases cover each piece
def test_three_d_pipeline_fsdp_tp_equals_one_process():
    ref = reference()
    (result,) = run_world(clip_result, 8, [Config(layout="pp_fsdp_tp")], deadline_s=300)
    assert result.extras["mesh"] == [2, 2, 2]
    assert_equals_one_process(result, ref)


def test_torch_clip_grad_norm_under_tp_raises_on_mixed_tensors():
    # TP leaves embeddings and norms as plain tensors: clip_grad_norm_ cannot stack their norms
    # with the DTensor ones (clip_grad_norm_across groups them by mesh). A TP mesh of 1 in this
    # process makes the same DTensors without spawning a world.
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        run_alone(grad_clipping.train, Config(layout="tp", mesh=[1], clip="torch", steps=1))


def test_a_mesh_whose_product_is_not_the_world_size_is_one_line():
    with pytest.raises(
        MeshError,
        match=r"^mesh 2x2 has 4 ranks but the world has 1; "
        r"pass sizes >= 1 whose product is 1$",
    ):
        run_alone(grad_clipping.train, Config(layout="fsdp_tp", mesh=[2, 2]))
    with pytest.raises(MeshError, match=r"^mesh \[2\] has 1 dims but this layout has 2 \(dp, tp\)"):
        run_alone(grad_clipping.train, Config(layout="fsdp_tp", mesh=[2]))


@pytest.mark.slow  # a torchrun launch: 3 interpreters; the same code runs in-process above
def test_torchrun_launch_prints_the_result():
    # through the harness, as scripts/collect_results.py runs it: the recipe's own lines, then
    # the measured result as JSON (the copy test launches the recipe itself under torchrun)
    proc = cli(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",
            "grad_clipping",
            "--layout",
            "pp",
            "--steps",
            "1",
        ],
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 0 loss 4.3436 grad norm 0.6157" in proc.stdout, proc.stdout
    result = last_json(proc.stdout)
    assert result["world_size"] == 2 and result["extras"]["layout"] == "pp"
    assert result["extras"]["grad_norms"] == pytest.approx([0.6157], abs=1e-4)  # = one process


def test_a_precision_that_cannot_compare_exactly_is_one_line():
    # (a ValueError from the config, as every copyable recipe refuses bad input; the command line
    # refuses it in one line too: the config's choices offer no bf16)
    with pytest.raises(
        ValueError, match=r"^precision must be one of auto, fp32, tf32, got 'bf16'$"
    ):
        Config(layout="single", precision="bf16")


def test_a_mesh_size_below_one_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"^mesh sizes must be >= 1, got \[2, 0\]; pass one per"):
        Config(layout="fsdp_tp", mesh=[2, 0])
