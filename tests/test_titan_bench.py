"""``scripts/bench.py --parts titan`` (scripts/titan_bench.py), cheaply on CPU: the dry run builds
the job's configs and prints the runs, the FLOP formula and parameter counts are the job's, and
the results table renders. torchtitan's trainer needs a GPU; its config is built here only where
torchtitan imports (it is an optional extra, `.[titan]`, and 0.3.0 imports triton)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from recipes.data import DataConfig, prepare_shards
from tests.helpers import REPO_ROOT, docs_hooks


def titan_bench():
    spec = importlib.util.spec_from_file_location(
        "titan_bench", Path(REPO_ROOT) / "scripts" / "titan_bench.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["titan_bench"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def byte_shards(tmp_path):
    """Token shards of plain bytes (no tokenizer to train): ~30 windows of 2048 tokens."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def f(x):\n    return x + 1\n" * 2500)
    data = tmp_path / "shards"
    prepare_shards(DataConfig(corpus=str(corpus), data_dir=str(data), vocab_size=256))
    return data


def test_the_shapes_are_the_job_presets_with_its_flop_formula():
    tb = titan_bench()
    # recipes/_job_model.py's counts at the shards' 16,384 vocabulary (tests/test_job_your_model.py
    # checks them on the built models)
    assert tb.parameter_count("100m") == 110_119_680
    assert tb.parameter_count("1b") == 1_006_700_544
    # 6 x matmul weights + 12 x layers x hidden x seq; at seq 64 recipes.job's own count for the
    # built llama-100m (its flops_per_token, read from a CPU run of the job) is 592,183,296
    assert tb.flops_per_token("100m", seq_len=64) == 592_183_296
    assert tb.flops_per_token("1b") == 6 * (1_006_700_544 - 16 * 2 * 2048 - 2048) + 12 * 16 * (
        2048 * 2048
    )


def test_dry_run_builds_the_job_configs_and_prints_every_run(byte_shards, tmp_path, capsys):
    tb = titan_bench()
    out = tmp_path / "titan.json"
    assert tb.run(dry_run=True, data_dir=str(byte_shards), out=str(out), steps=12, warmup=4) == 0
    printed = capsys.readouterr().out
    for shape in ("100m", "1b"):
        assert f"job {shape}: JobConfig ok (llama-{shape}, fsdp, bf16)" in printed
        for system in ("job", "titan"):
            run = f"scripts/titan_bench.py {system} --shape {shape} --steps 12 --warmup 4"
            assert run in printed
    assert printed.count(" -m torch.distributed.run --standalone --nproc_per_node=1 ") == 4
    assert "torchtitan config: not built here" in printed or "Trainer.Config ok" in printed
    assert not out.exists()  # a dry run measures nothing, so it writes nothing


def test_steps_must_exceed_the_warmup_left_out(capsys):
    assert titan_bench().run(dry_run=True, steps=10, warmup=10) == 2
    assert "must exceed warmup" in capsys.readouterr().err


def test_the_table_renders_both_systems_and_a_note_when_unmeasured(tmp_path, monkeypatch):
    row = {
        "tokens_per_s": 123456.0,
        "mfu": 0.4,
        "peak_reserved_gib": 30.0,
        "peak_allocated_gib": 28.0,
        "loss_last": 7.25,
        "own_mfu": 0.41,
    }
    data = {
        "what": "a test",
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "torchtitan": "0.3.0",
        "date": "2026-11-28T00:00:00+00:00",
        "flop_formula": "6 x matmul + 12 x L x H x T",
        "shapes": {
            "100m": {"global_batch_size": 16, "job": row, "titan": {"failed": "exit 1: boom"}}
        },
    }
    table = titan_bench().table(data)
    assert "| 100m (batch 16) | recipes.job | 123,456 | 40.0% | n/a | 30.0 | 7.250 |" in table
    assert "| 100m (batch 16) | torchtitan | failed: exit 1: boom |" in table
    hooks = docs_hooks()
    monkeypatch.setattr(hooks.base, "RESULTS_DIR", tmp_path)
    (tmp_path / "bench").mkdir()
    assert "Not yet measured: needs a GPU" in hooks.render_bench("titan")
    (tmp_path / "bench" / "nvidia-h200-titan.json").write_text(json.dumps(data))
    page = hooks.render_bench("titan")
    assert "**On one NVIDIA H200**, torch 2.11.0, torchtitan 0.3.0" in page
    assert "| 123,456 |" in page


def test_torchtitan_builds_the_same_model_and_reads_the_same_batches(byte_shards, tmp_path):
    tb = titan_bench()
    why = tb.titan_importable()
    if why:
        pytest.skip(why)
    import torch

    from recipes.data import TokenWindows
    from recipes.job import GlobalBatches

    for shape in tb.SHAPES:
        spec = tb.titan_model_spec(shape, tb.VOCAB_SIZE)
        with torch.device("meta"):
            model = spec.model.build()
        params, flops = spec.model.get_nparams_and_flops(model, tb.SEQ_LEN)
        assert params == tb.parameter_count(shape)
        # torchtitan counts the RMSNorm weights too: (2 x layers + 1) x hidden more
        norms = (2 * len(spec.model.layers) + 1) * spec.model.dim
        assert flops - tb.flops_per_token(shape) == 6 * norms
    cfg = tb.titan_config("100m", steps=4, warmup=1, data_dir=str(byte_shards), out_dir=tmp_path)
    loader = cfg.dataloader.build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=tb.SEQ_LEN, local_batch_size=2
    )
    inputs, labels = next(iter(loader))
    windows = TokenWindows(str(byte_shards), "train", tb.SEQ_LEN)
    first = next(iter(GlobalBatches(len(windows), 2, dp_rank=0, dp_size=1, seed=0)))
    assert torch.equal(inputs["input"], torch.stack([windows[i][0] for i in first]))
    assert torch.equal(labels, torch.stack([windows[i][1] for i in first]))
    assert torch.equal(inputs["positions"][0], torch.arange(tb.SEQ_LEN))
