"""nn.DataParallel: one process drives every visible GPU. Know it to recognise it; use DDP instead.

    python -m recipes.data_parallel
    CUDA_VISIBLE_DEVICES=0,1 python -m recipes.data_parallel --global-batch-size 16

Copy with it: recipes/toy.py (the model and data you replace), recipes/options.py (the command
line, from the config).

Each forward, ``nn.DataParallel`` splits the batch along dim 0 across the GPUs, copies the module to
each of them, runs the replicas in threads of this one process, and gathers the outputs on GPU 0;
backward sums the gradients back onto GPU 0's parameters. It is one line to add, and that is its
only advantage. Why DDP (recipes.ddp_torchrun) is preferred, even on a single machine:

- one process and the GIL drive every GPU: Python overhead grows with the GPU count;
- the model is re-broadcast to every GPU on every forward, and outputs/gradients funnel through GPU
  0, which therefore needs more memory than the others and becomes the bottleneck;
- no overlap of gradient communication with backward (DDP all-reduces buckets while backward runs);
- one machine only; PyTorch's docs recommend DDP "even if there is only a single node".

With no GPU, DataParallel simply calls the module on CPU: this recipe then runs on one device and
says so. The batch is the whole global batch (there is one process, and no process group): the
loss equals single-device training. It prints one line per step: the step and the loss.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, RandomSampler

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class DataParallelConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, split across the GPUs", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off)",
        choices=["auto", "fp32", "bf16"],
    )
    save_path: str | None = option(None, "save the trained model's state_dict here (torch.save)")

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each


# --8<-- [start:train]
def train(cfg: DataParallelConfig, observer=None) -> list[float]:
    """Train on every visible GPU (or the CPU) from this one process; returns each step's loss."""
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    if gpus and cfg.global_batch_size % gpus:
        lower = max(gpus, cfg.global_batch_size - cfg.global_batch_size % gpus)
        raise ValueError(
            f"global_batch_size={cfg.global_batch_size} does not split across {gpus} "
            f"GPUs; use a multiple of {gpus}, e.g. {lower} or {lower + gpus}"
        )
    if gpus:
        print(f"DataParallel over {gpus} GPU(s); outputs gather on {device}", flush=True)
    else:
        print(
            "no GPU visible: DataParallel calls the module directly on CPU (one device)", flush=True
        )
    bf16 = cfg.precision == "bf16" or (
        cfg.precision == "auto" and gpus > 0 and torch.cuda.is_bf16_supported()
    )
    if gpus and not bf16:  # fp32 means fp32: no TF32 matmuls (a process-wide switch)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    # --8<-- [start:loop]
    # Pitfall: the parameters must live on device_ids[0] (GPU 0) before wrapping
    model = build_model(cfg.model, seed=cfg.seed, device=device)
    dp_model = nn.DataParallel(model)  # every visible GPU; on CPU a pass-through
    optimizer = torch.optim.AdamW(dp_model.parameters(), lr=cfg.lr, fused=True if gpus else None)
    if observer:
        observer.model_ready(dp_model, optimizer)

    dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
    # A new order every epoch, the same on every run: reseeded from seed + epoch. (The sampler
    # holds the generator: given to the DataLoader, it would also draw the workers' base seed.)
    order = torch.Generator()
    loader = DataLoader(
        dataset,
        batch_size=cfg.global_batch_size,
        drop_last=True,
        pin_memory=gpus > 0,
        sampler=RandomSampler(dataset, generator=order),
    )
    losses, step, epoch = [], 0, 0
    while step < cfg.steps:
        order.manual_seed(cfg.seed + epoch)
        for inputs, targets in loader:
            if step == cfg.steps:
                break
            # Scattered along dim 0 to the GPUs; logits come back gathered on GPU 0.
            # autocast reaches the replicas: DataParallel's threads re-enter the caller's state.
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = lm_loss(dp_model(inputs.to(device)), targets.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # the replicas' gradients are summed onto GPU 0's parameters
            optimizer.step()
            losses.append(loss.item())
            print(f"step {step} loss {losses[-1]:.4f}", flush=True)
            if observer:
                observer.step_end(step, losses[-1])
            step += 1
        epoch += 1
    # --8<-- [end:loop]

    if cfg.save_path:
        # Pitfall: the weights live in dp_model.module; save that, not dp_model, whose keys all
        # start with "module." and no longer load into a plain model.
        torch.save(dp_model.module.state_dict(), cfg.save_path)
    return losses


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(DataParallelConfig, prog="python -m recipes.data_parallel", doc=__doc__)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), DataParallelConfig, argv)
    with exit_on_bad_input():  # a batch that does not split across the GPUs: one line, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
