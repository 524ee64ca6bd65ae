"""hf_checkpoint: a save_pretrained directory loads into fully_shard with each rank reading only its
rows, and the DCP checkpoint of a fully_shard run exports to what from_pretrained loads, with the
logits and weights of single-process training (GPT-2 with tied weights, and Llama).

The recipe's ``train`` runs through the harness's ``prove`` (recipes.core.observe's
HFCheckpointObserver: each rank's shard bytes, the checksum), as ``python -m recipes.core.prove
hf_checkpoint`` runs it for results/."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from recipes import hf_checkpoint as hf
from recipes.core.observe import prove
from recipes.core.workload import (
    SyntheticTokens,
    distributed_loader,
    iterate_steps,
    lm_loss,
)
from tests.helpers import PYTHON, run_cli, run_world

MODELS = ["gpt2", "llama"]
READERS = ["torch", "safetensors"]  # torch's HuggingFaceStorageReader, or get_slice by hand
STEPS = 2


def save_tiny(name: str, path: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf.tiny_config(name))
    model.save_pretrained(path)
    return model.eval()


class CountingOpen:
    """Wraps ``safetensors.safe_open``: counts the bytes of every tensor read from a file."""

    def __init__(self, real):
        self.real, self.bytes = real, 0

    def __call__(self, *args, **kwargs):
        return _File(self, self.real(*args, **kwargs))


class _File:
    def __init__(self, counter, handle):
        self.counter, self.handle = counter, handle

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def get_tensor(self, name):
        tensor = self.handle.get_tensor(name)
        self.counter.bytes += tensor.nbytes
        return tensor

    def get_slice(self, name):
        return _Slice(self.counter, self.handle.get_slice(name))


class _Slice:
    def __init__(self, counter, real):
        self.counter, self.real = counter, real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __getitem__(self, index):
        tensor = self.real[index]
        self.counter.bytes += tensor.nbytes
        return tensor


def rank_main(job: dict):
    """One world of 2 for the whole test: the loads (bytes read counted), then two recipe runs."""
    import safetensors
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig

    from recipes.core.state import all_ranks

    counter = CountingOpen(safetensors.safe_open)
    safetensors.safe_open = counter  # both readers import it when they read
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    loads = {}
    for name in MODELS:
        for reader in READERS:
            counter.bytes = 0
            model = hf.build_hf_sharded(
                AutoConfig.from_pretrained(job[name]), mesh, torch.device("cpu")
            )
            hf.load_hf_sharded(model, job[name], reader=reader)
            read = all_ranks(counter.bytes)
            sharded = all(isinstance(p, DTensor) for p in model.parameters())
            model.eval()
            with torch.no_grad():
                logits = model(job["probe"]).logits
            loads[name, reader] = read, sharded, logits
    runs = [prove(hf.train, cfg, name="hf_checkpoint") for cfg in job["runs"]]
    return loads, runs


def reference_training(initial_dir: str, cfg: hf.HFCheckpointConfig):
    """The plain single-process loop on the same start and data: the run must equal it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(initial_dir)
    model.train()
    data = SyntheticTokens(cfg.global_batch_size * 4, hf.SEQ_LEN, model.config.vocab_size, cfg.seed)
    loader, sampler = distributed_loader(
        data, rank=0, world_size=1, per_rank_batch_size=cfg.global_batch_size, seed=cfg.seed
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses = []
    for _, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
        loss = lm_loss(model(inputs).logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.eval()


def file_tensor_bytes(hf_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for name, path in hf.safetensors_files(hf_dir).items():
        with safe_open(path, framework="pt") as f:
            total += f.get_tensor(name).nbytes
    return total


def test_hf_in_and_out_of_fully_shard(tmp_path):
    from transformers import AutoModelForCausalLM

    originals = {name: save_tiny(name, str(tmp_path / name)) for name in MODELS}
    probe = torch.randint(0, 128, (2, hf.SEQ_LEN), generator=torch.Generator().manual_seed(1))
    runs = [  # GPT-2 into several files (index), Llama into one, by each export path
        hf.HFCheckpointConfig(
            model="gpt2",
            out_dir=str(tmp_path / "run_gpt2"),
            steps=STEPS,
            max_file_bytes=100_000,
            backend="gloo",
            timeout_s=60,
        ),
        hf.HFCheckpointConfig(
            model="llama",
            out_dir=str(tmp_path / "run_llama"),
            steps=STEPS,
            reader="safetensors",
            backend="gloo",
            timeout_s=60,
        ),
    ]
    job = {**{name: str(tmp_path / name) for name in MODELS}, "probe": probe, "runs": runs}
    loads, results = run_world(rank_main, 2, [job], deadline_s=170)[0]

    # In: the sharded model gives the original's logits, and each rank read half of the bytes.
    for (name, reader), (read, sharded, logits) in loads.items():
        with torch.no_grad():
            expected = originals[name](probe).logits
        torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0, msg=f"{name} {reader}")
        assert sharded, "every parameter is a DTensor shard"
        total = file_tensor_bytes(str(tmp_path / name))
        assert read == [total // 2, total // 2], f"{name} {reader}: bytes read per rank {read}"
    assert hf.torch_hf_storage(), "torch 2.13 has the slice-reading HuggingFaceStorageReader"

    # Out: from_pretrained loads the export; it equals single-process training, logits too.
    for cfg, result in zip(runs, results):
        out = os.path.join(cfg.out_dir, "hf")
        losses, reference = reference_training(os.path.join(cfg.out_dir, "initial"), cfg)
        torch.testing.assert_close(
            torch.tensor(result.losses), torch.tensor(losses), atol=1e-5, rtol=0
        )
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        for name, tensor in reference.state_dict().items():
            torch.testing.assert_close(
                reloaded.state_dict()[name], tensor, atol=1e-5, rtol=0, msg=f"{cfg.model} {name}"
            )
        with torch.no_grad():
            torch.testing.assert_close(
                reloaded(probe).logits, reference(probe).logits, atol=1e-5, rtol=0
            )
        assert result.extras["export_logits_max_abs_diff"] <= 1e-6
    gpt2_out, llama_out = (os.path.join(cfg.out_dir, "hf") for cfg in runs)
    with open(os.path.join(gpt2_out, hf.INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1 and "lm_head.weight" not in weight_map
    reloaded = AutoModelForCausalLM.from_pretrained(gpt2_out)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight  # re-tied on load
    assert sorted(os.listdir(llama_out)) == ["config.json", "model.safetensors"]


def test_bad_checkpoints_fail_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    good = str(tmp_path / "good")
    save_tiny("gpt2", good)
    state = load_file(os.path.join(good, "model.safetensors"))
    state["transformer.ln_f.extra"] = state.pop("transformer.ln_f.bias")
    save_file(state, os.path.join(good, "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.HFCheckpointConfig(hf_dir=good, out_dir=str(tmp_path / "out"), backend="gloo")
    with pytest.raises(
        hf.HFCheckpointError,
        match=r"missing keys \['transformer.ln_f.bias'\], "
        r"unexpected keys \['transformer.ln_f.extra'\]",
    ):
        hf.train(cfg)
    os.remove(os.path.join(good, "model.safetensors"))
    with pytest.raises(hf.HFCheckpointError, match="no model.safetensors"):
        hf.train(cfg)
    proc = run_cli(
        [
            PYTHON,
            "-m",
            "recipes.hf_checkpoint",
            "--hf-dir",
            str(tmp_path / "none"),
            "--out-dir",
            str(tmp_path / "out"),
        ],
        timeout_s=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (  # the config refuses it: argparse's line
        f"python -m recipes.hf_checkpoint: error: --hf-dir {tmp_path / 'none'} does not exist; "
        "pass the directory save_pretrained wrote"
    )


# Slow: a torchrun launch of 2 fresh interpreters that import transformers; the same run() is
# tested in the world above.
@pytest.mark.slow
def test_torchrun_launch_exports_what_from_pretrained_loads(tmp_path):
    command = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "recipes.hf_checkpoint",
        "--backend",
        "gloo",
        "--steps",
        "1",
        "--out-dir",
        str(tmp_path),
    ]
    proc = run_cli(command, timeout_s=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the recipe's own lines (it prints no JSON: the harness measures it, in the test above)
    difference = re.findall(
        r"logits differ from the trained model's by at most (\S+)$", proc.stdout, re.M
    )
    assert len(difference) == 1 and float(difference[0]) <= 1e-6, proc.stdout
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]


def test_a_broken_folder_or_file_fails_in_one_line_naming_it(tmp_path):
    """Each bad input stops before training with the file named and the fix: a file given as a
    folder, a config.json that is not one, a truncated safetensors file (its header no longer
    covers the file), an index naming a missing file; --out-dir a file, or under one."""
    import shutil

    good = str(tmp_path / "good")
    save_tiny("gpt2", good)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    truncated, not_config, sharded = (str(tmp_path / n) for n in ("trunc", "config", "sharded"))
    shutil.copytree(good, truncated)
    with open(os.path.join(good, "model.safetensors"), "rb") as f:
        data = f.read()
    with open(os.path.join(truncated, "model.safetensors"), "wb") as f:
        f.write(data[: len(data) // 2])  # an interrupted download
    shutil.copytree(good, not_config)
    with open(os.path.join(not_config, "config.json"), "w") as f:
        f.write('{"model": ')
    shutil.copytree(good, sharded)  # as save_pretrained(max_shard_size=...) writes, one file lost
    missing = "model-00002-of-00002.safetensors"
    os.replace(
        os.path.join(sharded, "model.safetensors"),
        os.path.join(sharded, "model-00001-of-00002.safetensors"),
    )
    with open(os.path.join(sharded, hf.INDEX), "w") as f:
        json.dump(
            {
                "metadata": {},
                "weight_map": {
                    "transformer.wte.weight": missing,
                    "lm_head": "model-00001-of-00002.safetensors",
                },
            },
            f,
        )
    out = str(tmp_path / "out")
    cases = [
        (
            {"hf_dir": str(a_file)},
            f"--hf-dir {a_file} is a file, not a directory; pass the "
            "directory save_pretrained wrote",
        ),
        ({"hf_dir": str(tmp_path / "nowhere")}, "does not exist; pass the directory "),
        (
            {"hf_dir": str(tmp_path)},
            f"no config.json in {str(tmp_path)!r}; pass a save_pretrained directory",
        ),
        ({"hf_dir": not_config}, f"{not_config}/config.json is not a model config (Expecting "),
        (
            {"hf_dir": truncated},
            f"{truncated}/model.safetensors is not a readable safetensors file "
            "(Error while deserializing header: incomplete metadata, file not "
            "fully covered); it may be truncated: save or download it again",
        ),
        (
            {"hf_dir": sharded},
            f"{hf.INDEX} in '{sharded}' names {missing}, which is missing; "
            "copy every file the index lists",
        ),
        ({"out_dir": str(a_file)}, f"--out-dir {a_file} is a file; name a directory"),
        (
            {"out_dir": str(a_file / "run")},
            f"--out-dir {a_file}/run: {a_file} is a file, so nothing can be created under it",
        ),
    ]
    for changes, message in cases:
        with pytest.raises(hf.HFCheckpointError) as caught:  # the config itself refuses
            hf.HFCheckpointConfig(
                **{"hf_dir": good, "out_dir": out, "steps": 1, "backend": "gloo", **changes}
            )
        assert message in str(caught.value), (changes, str(caught.value))
        assert "\n" not in str(caught.value)
    assert not os.path.exists(out)  # refused before anything was written
    # The command line: argparse's usage, then that line, exit 2.
    proc = run_cli(
        [PYTHON, "-m", "recipes.hf_checkpoint", "--hf-dir", truncated, "--out-dir", out],
        timeout_s=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[transformers]")]
    assert lines[-1] == f"python -m recipes.hf_checkpoint: error: {cases[4][1]}"
    # argparse's usage; runpy's warning where the harness forks a process that imported the recipe
    assert all(line.startswith(("usage:", " ", "<frozen runpy>")) for line in lines[:-1]), lines


def test_an_input_folder_inside_what_the_run_overwrites_is_refused(tmp_path):
    """--hf-dir out/hf: the export deletes out/hf first, so the run would destroy its input."""
    out = tmp_path / "out"
    save_tiny("gpt2", str(out / "hf"))
    for sub in ("hf", "dcp"):
        with pytest.raises(hf.HFCheckpointError, match=f"inside out_dir's {sub}/, which this run"):
            hf.HFCheckpointConfig(hf_dir=str(out / sub), out_dir=str(out))
    assert os.listdir(out / "hf")  # untouched
