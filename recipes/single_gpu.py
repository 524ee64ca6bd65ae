"""One GPU, no torch.distributed: the training loop every other recipe starts from.

    python -m recipes.single_gpu
    python -m recipes.single_gpu --model 100m --batch-size 64 --compile   # on a GPU: fast

Copy with it: recipes/toy.py (the model and data you replace), recipes/options.py (the command
line, from the config).

The loop a user has before scaling out: the model on the device, AdamW, a shuffled DataLoader that
reshuffles every epoch from the seed, forward, loss, backward, step, one line per step, and a save
at the end. recipes/ddp_torchrun.py is this file plus the lines that make it run on N GPUs; its
page and "From one GPU to many" show the difference as a diff. With the same seed and batch the
losses equal ddp_torchrun's on any number of ranks (tests/test_single_gpu.py asserts it).

Fast by default: on a GPU, bf16 autocast with fp32 master weights, fused AdamW, and ``--compile``
compiles each block and the loss. ``--precision fp32`` is the exact reference.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, RandomSampler

from recipes.options import check_options, config_parser, option, parse_config
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset


@dataclass
class SingleGPUConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    batch_size: int = option(12, "sequences per optimizer step", at_least=1)
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off)",
        choices=["auto", "fp32", "bf16"],
    )
    compile: bool = option(False, "torch.compile each transformer block and the loss")
    compile_backend: str = option(
        "inductor",
        "torch.compile's backend; inductor is the fast one",
        choices=["inductor", "aot_eager", "eager"],
    )
    save_path: str | None = option(None, "save the trained model's state_dict here (torch.save)")

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each


# --8<-- [start:train]
def train(cfg: SingleGPUConfig, observer=None) -> list[float]:
    """Train on one device (the GPU when there is one); returns each step's loss."""
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    bf16 = cfg.precision == "bf16" or (
        cfg.precision == "auto" and use_cuda and torch.cuda.is_bf16_supported()
    )
    if use_cuda and not bf16:  # fp32 means fp32: no TF32 matmuls (a process-wide switch)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    # --8<-- [start:loop]
    model = build_model(cfg.model, seed=cfg.seed, device=device)
    loss_fn = lm_loss
    if cfg.compile:  # each block's forward, and the loss
        for block in [m for m in model.modules() if isinstance(m, Block)]:
            block.forward = torch.compile(block.forward, backend=cfg.compile_backend)
        loss_fn = torch.compile(lm_loss, backend=cfg.compile_backend)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
    )  # one kernel on CUDA
    if observer:
        observer.model_ready(model, optimizer)

    dataset = make_dataset(cfg.model, cfg.batch_size, seed=cfg.seed)
    # A new order every epoch, the same on every run: reseeded from seed + epoch. (The sampler
    # holds the generator: given to the DataLoader, it would also draw the workers' base seed.)
    order = torch.Generator()
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        drop_last=True,
        pin_memory=use_cuda,
        sampler=RandomSampler(dataset, generator=order),
    )

    losses, step, epoch = [], 0, 0
    while step < cfg.steps:
        order.manual_seed(cfg.seed + epoch)
        for inputs, targets in loader:
            if step == cfg.steps:
                break
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            print(f"step {step} loss {losses[-1]:.4f}", flush=True)
            if observer:
                observer.step_end(step, losses[-1])
            step += 1
        epoch += 1
    # --8<-- [end:loop]

    if cfg.save_path:
        torch.save(model.state_dict(), cfg.save_path)
    return losses


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(SingleGPUConfig, prog="python -m recipes.single_gpu", doc=__doc__)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), SingleGPUConfig, argv)
    train(cfg)


if __name__ == "__main__":
    main()
