"""activation_checkpointing: same gradients in every mode; saved bytes none > selective > per_block, as derived."""

import pytest
import torch

from recipes import activation_checkpointing as ac
from recipes.core.config import RecipeError
from recipes.core.workload import MODEL_PRESETS, build_model, lm_loss, make_dataset
from tests.helpers import PYTHON, assert_states_close, last_json, run_alone, run_cli, with_fields

# gloo, so CPU even where there is a GPU: the exact comparisons and the byte counts below are CPU's
# (CUDA's embedding backward is not bit-deterministic, and its attention kernels save other tensors).
CFG = ac.ACConfig(model="small", steps=3, every_k=2, segments=2, keep_final_state=True, timeout_s=60, backend="gloo")
MODEL = MODEL_PRESETS[CFG.model]  # 4 blocks: selective checkpoints blocks 0 and 2, sequential blocks 0-1
MODES = ("none", "per_block", "selective", "sequential")
FLOAT_BYTES = 4


@pytest.fixture(scope="module")
def runs():
    return {mode: run_alone(ac.train, with_fields(CFG, mode=mode)) for mode in MODES}


def one_batch(batch_size=4):
    inputs, targets = zip(*(make_dataset(CFG.model, batch_size)[i] for i in range(batch_size)))
    return torch.stack(inputs), torch.stack(targets)


def grads_and_block_calls(mode):
    """One forward + backward; the gradients, and how often each block's MLP ran (2 = recomputed)."""
    model = build_model(CFG.model, seed=0)
    forward = model
    if mode == "per_block":
        ac.apply_activation_checkpointing(model, every_k=1)
    elif mode == "selective":
        ac.apply_activation_checkpointing(model, every_k=CFG.every_k)
    elif mode == "sequential":
        forward = lambda tokens: ac.sequential_forward(model, tokens, segments=CFG.segments)  # noqa: E731
    calls = [0] * MODEL.n_layers
    # A pre-hook: the recomputation stops early, inside the MLP, once the last tensor backward needs is
    # rebuilt (checkpoint's early_stop), so a post-forward hook would never see the second call.
    for index, block in enumerate(model.layers.values()):
        block.mlp.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    inputs, targets = one_batch()
    lm_loss(forward(inputs), targets).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, calls


def test_every_mode_gives_the_gradients_of_no_checkpointing_and_recomputes_the_checkpointed_blocks():
    reference, calls = grads_and_block_calls("none")
    assert calls == [1, 1, 1, 1]
    expected_calls = {"per_block": [2, 2, 2, 2], "selective": [2, 1, 2, 1], "sequential": [2, 2, 1, 1]}
    for mode, expected in expected_calls.items():
        grads, calls = grads_and_block_calls(mode)
        assert calls == expected, f"{mode}: blocks ran {calls} times, expected {expected}"
        # Recomputation replays the same ops on the same inputs: the gradients are bit-identical on CPU.
        assert_states_close(grads, reference, atol=0.0)


def test_training_is_unchanged_by_checkpointing(runs):
    for mode in MODES[1:]:
        assert runs[mode].losses == runs["none"].losses, mode
        assert_states_close(runs[mode].final_state, runs["none"].final_state, atol=0.0)
    assert runs["none"].losses[-1] < runs["none"].losses[0]
    assert [runs[mode].extras["checkpointed_blocks"] for mode in MODES] == [[], [0, 1, 2, 3], [0, 2], [0]]


def expected_per_block_fraction(cfg) -> float:
    """Saved bytes with per-block checkpointing over saved bytes without, per token, derived from the model.

    Without checkpointing a pre-norm block keeps, per token: its input, the attention norm's output,
    q, k, v, the attention output, the residual sum and the MLP norm's output (8 x dim), plus the MLP's
    hidden activation before and after GELU (2 x mlp_ratio x dim). Per-block checkpointing keeps the
    block input only (dim). Outside the blocks and the same in both runs: the final norm's input and
    output (2 x dim) and the log-softmax over the vocabulary (vocab). Left out: a few floats per token
    (LayerNorm mean/rstd, attention log-sum-exp, token ids), hence the 1% slack in the test.
    """
    inside = (8 + 2 * cfg.mlp_ratio) * cfg.dim
    outside = 2 * cfg.dim + cfg.vocab_size
    return (cfg.n_layers * cfg.dim + outside) / (cfg.n_layers * inside + outside)


def test_saved_bytes_shrink_as_derived(runs):
    saved = {mode: runs[mode].extras["saved_bytes"] for mode in MODES}
    assert saved["none"] > saved["selective"] > saved["per_block"] > 0
    fraction = saved["per_block"] / saved["none"]
    assert fraction <= expected_per_block_fraction(MODEL) * 1.01, (fraction, expected_per_block_fraction(MODEL))
    assert fraction >= expected_per_block_fraction(MODEL) * 0.95  # and the derivation is not a loose bound

    # What checkpoint keeps is exactly each checkpointed region's input: dim floats per token.
    block_input_bytes = runs["none"].extras["tokens_per_step"] * MODEL.dim * FLOAT_BYTES
    inputs = {mode: runs[mode].extras["checkpoint_input_bytes"] for mode in MODES}
    assert inputs == {"none": 0, "per_block": 4 * block_input_bytes, "selective": 2 * block_input_bytes,
                      "sequential": block_input_bytes}
    # Every checkpointed block frees the same bytes: 2 of 4 blocks free exactly half of per_block's saving.
    assert 2 * (saved["none"] - saved["selective"]) == saved["none"] - saved["per_block"]
    # checkpoint_sequential checkpoints blocks 0-1 as one segment: like selective's two blocks, minus one kept input.
    assert saved["sequential"] == saved["selective"] - block_input_bytes


def test_bad_options_name_the_valid_range():
    with pytest.raises(RecipeError, match="segments must be between 1 and the model's 4 blocks, got 5"):
        ac.ACConfig(model="small", mode="sequential", segments=5)
    with pytest.raises(RecipeError, match="every_k must be >= 1"):
        ac.ACConfig(mode="selective", every_k=0)


def test_cli_runs_and_prints_the_measurement():
    proc = run_cli([PYTHON, "-m", "recipes.activation_checkpointing", "--model", "tiny", "--mode", "selective",
                    "--steps", "2"], timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = last_json(proc.stdout)
    assert result["extras"]["checkpointed_blocks"] == [0] and result["extras"]["saved_bytes"] > 0
    assert len(result["losses"]) == 2 and "saved for backward" in proc.stdout
