"""performance: every speed switch keeps fp32 training exact, the attention kernel is named, and the
benchmark runs its code on CPU (its GPU figures come from scripts/bench.py on a GPU, not tests).

The recipe is copyable and returns its losses and the attention kernel that ran; the harness
(``prove``, with ``recipes.core.observe.PerformanceObserver``) measures the rest from outside: the
final weights, the switches and the torch.backends flags."""

import json

import pytest
import torch

from recipes import performance
from recipes.core.observe import prove
from tests.helpers import (
    PYTHON,
    assert_losses_close,
    assert_states_close,
    plain_training_loop,
    run_alone,
    run_cli,
    with_fields,
)

CFG = performance.PerformanceConfig(steps=4, precision="fp32", device="cpu")


def performance_result(cfg):
    """recipes.performance.train(cfg) measured by the harness, with the final state."""
    return prove(performance.train, cfg, name="performance", keep_final_state=True)


def test_fast_switches_keep_fp32_training_exact():
    reference_losses, reference_state = plain_training_loop(
        "tiny", steps=CFG.steps, global_batch_size=CFG.global_batch_size, lr=CFG.lr, seed=CFG.seed
    )
    for changes in (
        dict(optimizer="fused"),
        dict(optimizer="foreach", zero_grad="zeros"),
        dict(optimizer="for_loop", sdpa_backend="math"),
    ):
        result = run_alone(performance_result, with_fields(CFG, **changes))
        # fused/foreach/for-loop AdamW order their arithmetic differently: 1e-6 covers it (measured
        # up to ~2e-7 on torch 2.13 CPU); the math attention kernel differs from flash by as much.
        assert_losses_close(result.losses, reference_losses, atol=1e-5)
        assert_states_close(result.final_state, reference_state, atol=1e-5)
        assert result.extras["optimizer"] == changes["optimizer"]


@pytest.mark.parametrize("allowed, expected", [("math", "math"), ("auto", None)])
def test_forced_attention_kernel_is_the_one_that_ran(allowed, expected):
    result = run_alone(performance_result, with_fields(CFG, steps=2, sdpa_backend=allowed))
    ran = result.extras["sdpa_backend_ran"]
    assert ran == expected if expected else ran in performance.SDPA_OPS, ran
    assert set(result.extras["backends"]) >= {"cuda.matmul.allow_tf32", "float32_matmul_precision"}


def test_a_forced_kernel_that_cannot_run_is_an_error_not_a_fallback():
    with pytest.raises(
        ValueError, match="^sdpa_backend cudnn cannot run this model's attention on cpu"
    ):
        run_alone(performance.train, with_fields(CFG, steps=2, sdpa_backend="cudnn"))


def test_bad_input_is_one_line():
    proc = run_cli(
        # cpu: also where a GPU would make --pin-memory valid
        [PYTHON, "-m", "recipes.performance", "--pin-memory", "--steps", "2", "--device", "cpu"],
        timeout_s=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: pin_memory needs a GPU: pinned memory speeds up copies to one"
    ]
    with pytest.raises(ValueError, match="^precision tf32 is a CUDA matmul mode"):
        run_alone(performance.train, with_fields(CFG, precision="tf32"))
    # switches that contradict each other: refused by the config, built in code or from the
    # command line
    with pytest.raises(ValueError, match="^compile_scope model needs compile"):
        with_fields(CFG, compile_scope="model")
    with pytest.raises(ValueError, match="^compile_mode reduce-overhead needs compile_scope model"):
        with_fields(CFG, compile=True, compile_mode="reduce-overhead")
    with pytest.raises(SystemExit) as exit_info:
        performance.main(["--compile-scope", "model"])
    assert exit_info.value.code == 2


def test_bench_prints_its_tables_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli(
        [
            PYTHON,
            "scripts/bench.py",
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--batch",
            "4",
            "--parts",
            "ladder,recipes",  # the compiled part runs the same code, with compile: ~10 s more
            "--only",
            "fp32 (TF32,tf32,bf16 + fused AdamW,bare loop,fsdp2",
            "--out",
            str(out),
        ],
        timeout_s=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["torch"] and report["device"].startswith("CPU")
    ladder = {row["label"]: row for row in report["ladder"]}
    assert ladder["tf32 matmuls, foreach AdamW"]["skipped"].startswith("precision tf32 is a CUDA")
    fp32 = ladder["fp32 (TF32 off), foreach AdamW"]
    assert fp32["ms_per_step"] > 0 and fp32["tokens_per_second"] > 0 and fp32["mfu"] is None
    assert list(report["recipes"]) == ["8", "4"]
    labels = ["bare loop (performance)", "fsdp2", "fsdp2, no reshard"]
    for batch, rows in report["recipes"].items():
        assert [row["label"] for row in rows] == labels
        assert all(row["precision"] == "fp32" and row["batch"] == int(batch) for row in rows)
    assert "| bf16 + fused AdamW | 4 |" in proc.stdout and "| fsdp2 | 8 |" in proc.stdout


def test_tf32_is_set_from_the_flag_on_every_run():
    """The page's pitfall: TF32 is a process-wide switch, so the recipe sets it from --precision on
    every run and never inherits it from an earlier one."""
    cuda = torch.device("cuda", 0)  # resolve_precision only sets flags for it: no GPU needed
    try:
        assert performance.resolve_precision("tf32", cuda) == "tf32"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert performance.resolve_precision("fp32", cuda) == "fp32"
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
