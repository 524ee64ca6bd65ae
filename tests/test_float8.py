"""float8: torchao float8 linears + FSDP2 float8 all-gather, against bf16 on the same model.

Where there is no GPU of compute capability >= 8.9 or no torchao, the training test skips with
the recipe's own one-line reason, and the refusal itself is tested (one line, exit 2). The
recipe is copyable and returns its losses (a ``Float8Run``); the harness (``prove``, with
``recipes.core.observe.Float8Observer``) times both runs from outside.
"""

import pytest
import torch.nn as nn

from recipes import float8
from recipes.core.observe import prove
from recipes.toy import MODEL_PRESETS
from tests.helpers import PYTHON, run_cli

REASON = float8.float8_unavailable()


def test_the_filter_keeps_the_head_and_misaligned_linears_out_of_float8():
    assert float8.float8_filter(nn.Linear(768, 3072), "layers.0.mlp.w_in")
    assert not float8.float8_filter(nn.Linear(768, 16384), "output")  # logits feed the loss
    assert not float8.float8_filter(nn.Linear(32, 100), "layers.0.attn.wq")  # 100 % 16 != 0
    assert not float8.float8_filter(nn.Linear(24, 32), "layers.0.attn.wq")  # 24 % 16 != 0


@pytest.mark.skipif(REASON is None, reason="float8 can run here: there is no refusal to test")
def test_refuses_in_one_line_where_float8_cannot_run():
    with pytest.raises(float8.Float8UnavailableError) as caught:  # a ValueError
        float8.train(float8.Float8Config(steps=2))
    assert str(caught.value) == REASON and "\n" not in REASON
    done = run_cli([PYTHON, "-m", "recipes.float8", "--steps", "2"], timeout_s=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {REASON}"]


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.timeout(600)
def test_float8_loss_stays_close_to_bf16_and_reports_both_speeds():
    cfg = float8.Float8Config(model="100m", steps=6, global_batch_size=8, backend="nccl")
    result = prove(float8.train, cfg, name="float8")
    extras = result.extras
    # Every block linear converted (6 a block), the output head not.
    assert extras["float8_linears"] == 6 * MODEL_PRESETS["100m"].n_layers
    assert len(result.losses) == len(extras["bf16_losses"]) == cfg.steps
    assert extras["loss_within_tolerance"], (result.losses, extras["bf16_losses"])
    assert extras["max_loss_rel_diff"] <= cfg.loss_rtol
    # No "the loss goes down" check: in 6 steps at this learning rate neither bf16 nor float8 moves
    # past step-to-step noise (on the H200: 9.87 -> 9.98 for both); the claim is float8 == bf16.
    assert result.tokens_per_second > 0 and extras["bf16_tokens_per_second"] > 0
    assert extras["speedup_vs_bf16"] > 0
    assert result.precision == "float8"
