"""LocalSGD and DiLoCo against DDP on the cookbook's real data: the loss after N steps, H=1, 4, 16.

    python scripts/local_sgd_real_data.py                 # 64 steps on 2 ranks (gloo, CPU)
    python scripts/local_sgd_real_data.py --steps 128 --out /tmp/local_sgd.txt

The recipes run unchanged (recipes/ddp_torchrun.py, recipes/local_sgd.py), in one spawned world of
2 ranks, on the "small" model (vocab 512, 64 tokens a window) and real text: Python's own stdlib
sources, tokenized by recipes/data.py into memory-mapped shards. The script swaps each recipe's
synthetic dataset for those token windows from outside (as a user swaps in their own data), and
reads the trained model through the observer each recipe takes. "syncs" counts the times the
replicas meet: DDP's gradient all-reduce every step, LocalSGD's and DiLoCo's one all-reduce every
H steps: after the last step, the mean
loss on 64 held-out windows of the validation split (every replica holds the same weights then:
local_sgd ends on a synchronisation). It writes a text table to results/local_sgd_real_data.txt,
which docs/recipes/local_sgd.md includes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes import data, ddp_torchrun, local_sgd  # noqa: E402
from recipes.core.spawn import spawn_world  # noqa: E402
from recipes.core.world import join_world  # noqa: E402
from recipes.toy import lm_loss  # noqa: E402

VAL_WINDOWS = 64


class HeldOut:
    """The observer: keeps the model, and after the last step measures the validation loss."""

    def __init__(self, data_dir: str, seq_len: int, steps: int):
        self.val = data.TokenWindows(data_dir, "val", seq_len)
        self.steps, self.model, self.val_loss = steps, None, None

    def model_ready(self, model, optimizer):
        self.model = getattr(model, "module", model)  # DDP's wrapped model, or the model

    def step_end(self, step, loss):
        if step != self.steps - 1:
            return
        windows = [self.val[i] for i in range(min(VAL_WINDOWS, len(self.val)))]
        inputs = torch.stack([w[0] for w in windows])
        targets = torch.stack([w[1] for w in windows])
        with torch.no_grad():
            self.val_loss = lm_loss(self.model(inputs), targets).item()


def compare(data_dir: str, steps: int, runs: dict) -> dict:
    """One rank: every run in this world, each recipe reading the real token windows."""
    seq_len = 64  # the "small" preset's
    windows = data.TokenWindows(data_dir, "train", seq_len)

    def real_windows(model, global_batch_size, seed=0):  # make_dataset's signature
        return windows

    def run(name, module_name, cfg):
        module = {"ddp_torchrun": ddp_torchrun, "local_sgd": local_sgd}[module_name]
        module.make_dataset = real_windows  # the recipe's data, swapped from outside
        watch = HeldOut(data_dir, seq_len, steps)
        losses = module.train(cfg, observer=watch)
        return {"losses": losses, "val_loss": watch.val_loss}

    if set(module for module, _ in runs.values()) == {"ddp_torchrun"}:
        # ddp_torchrun creates and destroys its process group itself, in the open: one run
        return {name: run(name, *spec) for name, spec in runs.items()}
    with join_world("gloo", timeout_s=120):  # local_sgd's runs share one group
        return {name: run(name, *spec) for name, spec in runs.items()}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="a multiple of 16 (the largest H)")
    parser.add_argument("--out", default="results/local_sgd_real_data.txt")
    args = parser.parse_args(argv)
    if args.steps < 16 or args.steps % 16:
        parser.error(f"--steps {args.steps}: use a multiple of 16, e.g. 64")
    common = dict(model="small", steps=args.steps, global_batch_size=16, lr=1e-3, seed=0)
    ddp = ddp_torchrun.DDPConfig(**common, backend="gloo", precision="fp32", timeout_s=120)
    base = local_sgd.LocalSGDConfig(**common, backend="gloo", timeout_s=120)
    runs = {"DDP (all-reduce every step)": ("ddp_torchrun", ddp)}
    for h in (1, 4, 16):
        runs[f"LocalSGD H={h}"] = ("local_sgd", dataclasses.replace(base, sync_every=h))
    for h in (4, 16):
        runs[f"DiLoCo H={h}"] = (
            "local_sgd",
            dataclasses.replace(base, sync_every=h, outer="diloco"),
        )
    with tempfile.TemporaryDirectory() as folder:
        shards = data.DataConfig(data_dir=os.path.join(folder, "shards"), max_bytes=1_000_000)
        data.prepare_shards(shards)
        ddp_runs = {k: v for k, v in runs.items() if v[0] == "ddp_torchrun"}
        sgd_runs = {k: v for k, v in runs.items() if v[0] != "ddp_torchrun"}
        results = spawn_world(compare, 2, shards.data_dir, args.steps, ddp_runs, deadline_s=900)
        results |= spawn_world(compare, 2, shards.data_dir, args.steps, sgd_runs, deadline_s=1800)
    lines = [
        f"{args.steps} steps on 2 ranks (gloo), {cpu_model()}, {os.cpu_count()} cores",
        "model small, global batch 16 x 64 tokens, AdamW lr 1e-3",
        f"data: Python's stdlib sources as BPE-512 shards; {datetime.date.today()}, "
        f"torch {torch.__version__}",
        "",
        f"{'run':<28} {'syncs':>6} {'train loss, last 8 steps':>25} {'val loss':>9}",
    ]
    for name, (module, cfg) in runs.items():
        got = results[name]
        syncs = args.steps if module == "ddp_torchrun" else args.steps // cfg.sync_every
        tail = sum(got["losses"][-8:]) / 8
        lines.append(f"{name:<28} {syncs:>6} {tail:>25.4f} {got['val_loss']:>9.4f}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(args.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
