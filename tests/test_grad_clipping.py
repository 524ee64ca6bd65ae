"""grad_clipping: one total norm over the mesh, equal to one process on every layout."""

import pytest

from recipes import grad_clipping
from recipes.core.config import RecipeError
from tests.helpers import assert_states_close, run_alone, run_world

Config = grad_clipping.GradClippingConfig


def reference():
    """One process, the whole batch, torch's clip_grad_norm_: what every layout must equal."""
    return run_alone(grad_clipping.train, Config(layout="single", keep_final_state=True))


def assert_equals_one_process(result, ref):
    # Clipping is active (the norm is above max_norm), so a wrong norm would change the weights.
    assert min(ref.extras["grad_norms"]) > 5 * Config.max_grad_norm
    assert result.extras["grad_norms"] == pytest.approx(ref.extras["grad_norms"], abs=1e-6)
    for per_rank in result.extras["grad_norms_per_rank"]:  # the same total on every rank
        assert per_rank == pytest.approx([per_rank[0]] * len(per_rank), abs=1e-6)
    assert result.losses == pytest.approx(ref.losses, abs=1e-5)
    assert_states_close(result.final_state, ref.final_state, atol=1e-6)


def test_every_two_rank_layout_equals_one_process_and_the_pitfalls_differ():
    ref = reference()
    layouts = ["ddp", "fsdp", "tp", "pp"]
    configs = [Config(layout=layout, keep_final_state=True) for layout in layouts] + [
        Config(layout="ddp", clip="torch", keep_final_state=True),
        Config(layout="pp", clip="torch", keep_final_state=True),
        Config(layout="fsdp", clip="local_shards", keep_final_state=True),
    ]
    *results, ddp_torch, pp_torch, fsdp_local = run_world(grad_clipping.train, 2, configs,
                                                          timeout_s=300)
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


def test_four_rank_layouts_equal_one_process():
    ref = reference()
    layouts = ["hsdp", "fsdp_tp", "pp_fsdp"]
    results = run_world(grad_clipping.train, 4,
                        [Config(layout=layout, keep_final_state=True) for layout in layouts],
                        timeout_s=300)
    for layout, result in zip(layouts, results):
        assert (result.extras["layout"], result.extras["mesh"]) == (layout, [2, 2])
        assert_equals_one_process(result, ref)


@pytest.mark.slow  # 8 ranks on CPU: ~4x the 4-rank world's time; the 2-D cases cover each piece
def test_three_d_pipeline_fsdp_tp_equals_one_process():
    ref = reference()
    (result,) = run_world(grad_clipping.train, 8, [Config(layout="pp_fsdp_tp",
                                                          keep_final_state=True)], timeout_s=300)
    assert result.extras["mesh"] == [2, 2, 2]
    assert_equals_one_process(result, ref)


def test_torch_clip_grad_norm_under_tp_raises_on_mixed_tensors():
    # TP leaves embeddings and norms as plain tensors: clip_grad_norm_ cannot stack their norms
    # with the DTensor ones (clip_grad_norm_across groups them by mesh). A TP mesh of 1 in this
    # process makes the same DTensors without spawning a world.
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        run_alone(grad_clipping.train, Config(layout="tp", mesh=[1], clip="torch", steps=1))


def test_a_mesh_whose_product_is_not_the_world_size_is_one_line():
    with pytest.raises(RecipeError, match=r"^mesh 2x2 has 4 ranks but the world has 1; "
                                          r"pass sizes >= 1 whose product is 1$"):
        run_alone(grad_clipping.train, Config(layout="fsdp_tp", mesh=[2, 2]))
    with pytest.raises(RecipeError,
                       match=r"^mesh \[2\] has 1 dims but this layout has 2 \(dp, tp\)"):
        run_alone(grad_clipping.train, Config(layout="fsdp_tp", mesh=[2]))
