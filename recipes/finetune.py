"""Fine-tuning under DDP or fully_shard: full, head-only, partial (the last k blocks) or LoRA.

    torchrun --standalone --nproc_per_node=2 -m recipes.finetune
    torchrun --standalone --nproc_per_node=2 -m recipes.finetune --strategy fully_shard --mode head
    python -m recipes.finetune --arch gpt2 --mode lora --lora-rank 8   # tiny Hugging Face GPT-2

The functions to copy take YOUR model and are told what they need: ``add_lora(model, targets=...,
rank=..., alpha=...)`` wraps the modules whose names match the patterns (or a predicate) in a
hand-written ``LoRA``; ``freeze_for(model, mode, head=..., block_types=..., last_k=...)`` sets
``requires_grad``; ``merge_lora(model)`` folds the adapters back into the weights. Ready-made
targets exist for the cookbook's TransformerLM, GPT-2 and Llama (``ready_made_targets``).

Order matters: add adapters, freeze, THEN wrap (DDP or fully_shard), then build the optimizer from
the trainable parameters only. Frozen parameters then get no gradient, no AdamW state and no
all-reduce; ``find_unused_parameters`` stays False (a frozen parameter is not an unused one).

The result reports the trainable fraction, the model-state bytes of this run and of full
fine-tuning of the same model (both measured per rank, recipes/core/memory.py), the bytes DDP
all-reduced per step and tokens/s. MFU is left out: its 6 x parameters FLOPs count the weight
gradients that frozen weights never compute. ``--checkpoint-dir`` writes, on rank 0, the trained
parameters alone (``trainable.pt``: the adapters for LoRA) and, for LoRA, ``merged.pt``, a plain
state dict of the merged model that the un-adapted model class loads.

Length: about 390 lines, over the cookbook's ~300: besides the training loop it carries the pieces a
user copies (LoRA, add_lora, merge_lora, freeze_for, the ready-made targets) and the baseline
measurement of full fine-tuning's bytes; splitting them into core/ would hide the lesson.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import math
import os
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.memory import model_state_bytes
from recipes.core.paths import output_dir_problem, refuse
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.speed import (autocast, make_adamw, make_grad_scaler, mixed_precision_policy,
                                 setup_precision)
from recipes.core.state import all_ranks, full_state_on_rank0, mean_over_ranks
from recipes.core.throughput import Workload
from recipes.core.workload import (MODEL_PRESETS, Block, ModelConfig, build_model,
                                   distributed_loader, iterate_steps, lm_loss, make_dataset)
from recipes.core.world import join_world
from recipes.parallelize import apply_fully_shard

log = get_logger(__name__)
MODES = ("full", "head", "partial", "lora")
# The tiny Hugging Face models of the tests, and the shapes of the synthetic data they train on.
HF_DATA = ModelConfig(vocab_size=128, seq_len=16, dim=64, n_layers=2, n_heads=4)


@dataclass
class FinetuneConfig(TrainConfig):
    arch: Literal["cookbook", "gpt2", "llama"] = opt(
        "cookbook", "cookbook = recipes.core.workload.TransformerLM (size: --model); "
        "gpt2 / llama = "
        "tiny Hugging Face models built from config (needs transformers)")
    mode: Literal["full", "head", "partial", "lora"] = opt(
        "lora", "what trains: everything, the head, the last --last-k blocks + head, or adapters")
    strategy: Literal["ddp", "fully_shard"] = opt("ddp", "how the ranks share the work")
    last_k: int = opt(1, "partial: how many of the last blocks train (with the head)", ge=1)
    lora_rank: int = opt(4, "LoRA: the rank r of each adapter (A: r x in, B: out x r)", ge=1)
    lora_alpha: float = opt(8.0, "LoRA: the update is scaled by alpha / rank", gt=0)
    lora_targets: str = opt("", "LoRA: comma-separated fnmatch patterns of module names, e.g. "
                                "'*.attn.wq,*.attn.wv'; empty = the ready-made ones for --arch")
    checkpoint_dir: str = opt("", "rank 0 writes trainable.pt (and merged.pt for LoRA) here")


# --8<-- [start:targets]
@dataclass(frozen=True)
class FinetuneTargets:
    """What fine-tuning needs to know about a model, given, never guessed from attribute names."""

    block_types: tuple[type[nn.Module], ...]  # partial: the last k; fully_shard: one unit each
    head: tuple[str, ...]  # module names that head-only and partial train
    lora_targets: tuple[str, ...]  # fnmatch patterns of the module names that get adapters


def ready_made_targets(arch: str) -> FinetuneTargets:
    if arch == "cookbook":
        return FinetuneTargets((Block,), ("norm", "output"), ("*.attn.w[qkvo]",))
    if arch == "gpt2":  # fused qkv Conv1D. Tied: training lm_head trains the token embedding too.
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        return FinetuneTargets((GPT2Block,), ("transformer.ln_f", "lm_head"),
                               ("*.attn.c_attn", "*.attn.c_proj"))
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return FinetuneTargets((LlamaDecoderLayer,), ("model.norm", "lm_head"),
                           ("*.self_attn.[qkvo]_proj",))
# --8<-- [end:targets]


# --8<-- [start:lora]
class LoRA(nn.Module):
    """``base(x) + alpha / rank * x A^T B^T``. A is random, B zero: training starts from the base
    model. ``base`` is an ``nn.Linear`` or GPT-2's ``Conv1D`` (weight stored as (in, out))."""

    def __init__(self, base: nn.Module, rank: int, alpha: float):
        super().__init__()
        self.conv1d = type(base).__name__ == "Conv1D"
        weight = base.weight
        in_features, out_features = weight.shape if self.conv1d else weight.shape[::-1]
        self.base, self.scale = base, alpha / rank
        like = {"device": weight.device, "dtype": weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, **like))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # nn.Linear's (and peft's) init
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, **like))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    def merged_weight(self) -> torch.Tensor:
        delta = (self.lora_b @ self.lora_a) * self.scale  # (out, in)
        return self.base.weight + (delta.T if self.conv1d else delta)


def add_lora(model: nn.Module, *, targets: Sequence[str] | Callable[[str, nn.Module], bool],
             rank: int, alpha: float, seed: int = 0) -> list[str]:
    """Wrap each module whose full name matches a pattern in ``targets`` (fnmatch), or for which
    ``targets(name, module)`` is true, in a ``LoRA``; returns the names. Same seed, same adapters
    on every rank. Parameter names gain ``.base`` (``wq.weight`` -> ``wq.base.weight``)."""
    if rank < 1:
        raise RecipeError(f"LoRA rank must be >= 1, got {rank}; typical ranks are 4, 8 or 16")
    patterns = (targets,) if isinstance(targets, str) else () if callable(targets) else targets
    match = targets if callable(targets) else (
        lambda name, _: any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns))
    names = [name for name, module in model.named_modules() if name and match(name, module)]
    linear = {name for name, m in model.named_modules()
              if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}
    if not names:
        found = sorted({name.split(".")[-1] for name in linear})
        raise RecipeError(f"LoRA targets {targets!r} match no module of {type(model).__name__}; "
                          f"its linear layers are called {', '.join(found)} (patterns match the "
                          "full name, e.g. '*.attn.wq')")
    if set(names) - linear:
        raise RecipeError(f"LoRA targets match {sorted(set(names) - linear)[0]}, which is not a "
                          "Linear or Conv1D; narrow the patterns to the projections")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name in names:
            parent, _, child = name.rpartition(".")
            holder = model.get_submodule(parent)
            setattr(holder, child, LoRA(getattr(holder, child), rank, alpha))
    return names


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each adapter into its base weight and put the base module back: the original names
    and speed, a state dict the plain model class loads. On an unsharded model (rank 0's copy)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRA):
            with torch.no_grad():
                module.base.weight.copy_(module.merged_weight())
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.base)
    return model
# --8<-- [end:lora]


# --8<-- [start:freeze_for]
def freeze_for(model: nn.Module, mode: str, *, head: Sequence[str] = (),
               block_types: tuple[type[nn.Module], ...] = (), last_k: int = 1) -> tuple[int, int]:
    """Set ``requires_grad`` for ``mode`` (full, head, partial, lora); returns (trainable, total)
    parameter counts. Call it BEFORE wrapping in DDP or fully_shard and before the optimizer."""
    if mode not in MODES:
        raise RecipeError(f"unknown fine-tuning mode {mode!r}; valid: {', '.join(MODES)}")
    trained: list[nn.Module | nn.Parameter] = [model]
    if mode == "lora":
        trained = [p for m in model.modules() if isinstance(m, LoRA) for p in (m.lora_a, m.lora_b)]
        if not trained:
            raise RecipeError("mode 'lora' found no LoRA adapter; call add_lora(model, ...) first")
    elif mode in ("head", "partial"):
        children = {name for name, _ in model.named_modules()}
        missing = [name for name in head if name not in children]
        if missing or not head:
            raise RecipeError(f"head modules {list(head)} are not all in {type(model).__name__} "
                              f"(missing {missing}); pass head=(names), e.g. ('lm_head',)")
        trained = [model.get_submodule(name) for name in head]
        if mode == "partial":
            blocks = [m for m in model.modules() if block_types and isinstance(m, block_types)]
            if not 1 <= last_k <= len(blocks):
                kinds = ", ".join(t.__name__ for t in block_types) or "no block_types given"
                raise RecipeError(f"last_k={last_k}, but {type(model).__name__} has {len(blocks)} "
                                  f"blocks ({kinds}); use 1 to {len(blocks)}")
            trained += blocks[-last_k:]
    model.requires_grad_(False)
    for item in trained:
        item.requires_grad_(True)
    params = list(model.parameters())  # tied weights (GPT-2's lm_head = wte) count once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
# --8<-- [end:freeze_for]


def load_trainable(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``trainable.pt`` (adapters, a head) into a model built the same way: base weights
    loaded and, for LoRA, ``add_lora`` called with the same targets and rank."""
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys
    if unexpected:
        raise RecipeError(f"checkpoint keys not in the model: {', '.join(unexpected[:3])}; build "
                          "the model as it was trained (add_lora with the same targets) first")


def build_arch(arch: str, preset: str = "tiny", *, seed: int = 0) -> nn.Module:
    """The model to fine-tune, the same on every rank (a real run loads pretrained weights here)."""
    if arch == "cookbook":
        return build_model(preset, seed=seed)
    try:
        import transformers
    except ImportError:
        raise RecipeError(f"--arch {arch} needs transformers: pip install transformers") from None
    shape = {"vocab_size": HF_DATA.vocab_size, "bos_token_id": 0, "eos_token_id": 0,
             "use_cache": False}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "gpt2":  # dropout off: the same losses on any world size
            config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                             **shape)
            return transformers.GPT2LMHeadModel(config).float()
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=32,
                                          **shape)
        return transformers.LlamaForCausalLM(config).float()


def logits_of(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits  # Hugging Face: .logits


def count_reduced_bytes(ddp_model: DDP) -> dict[str, int]:
    """A DDP comm hook that counts the bytes of each gradient bucket, then all-reduces it as the
    default does (average). Register before the first forward."""
    counter = {"bytes": 0}

    def hook(_state, bucket):
        counter["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(None, bucket)
    ddp_model.register_comm_hook(None, hook)
    return counter


def lora_patterns(cfg: FinetuneConfig) -> tuple[str, ...]:
    given = tuple(p.strip() for p in cfg.lora_targets.split(",") if p.strip())
    return given or ready_made_targets(cfg.arch).lora_targets


# --8<-- [start:prepare]
def adapt(cfg: FinetuneConfig, mode: str) -> tuple[nn.Module, tuple[int, int]]:
    """Build the model, add adapters, freeze: all before any wrapper sees the model."""
    model = build_arch(cfg.arch, cfg.model, seed=cfg.seed)
    targets = ready_made_targets(cfg.arch)
    if mode == "lora":
        add_lora(model, targets=lora_patterns(cfg), rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                 seed=cfg.seed)
    counts = freeze_for(model, mode, head=targets.head, block_types=targets.block_types,
                        last_k=cfg.last_k)
    return model, counts


def wrap(cfg: FinetuneConfig, model: nn.Module, world, mesh, precision: str):
    """Wrap the adapted, frozen model; then the optimizer, over the trainable parameters only."""
    counter = None
    if cfg.strategy == "ddp":
        # Pitfall: DDP buckets the parameters that require grad WHEN IT IS BUILT. Frozen first, they
        # are simply left out (no find_unused_parameters); frozen after, DDP waits for their
        # gradients and the second step fails, asking for find_unused_parameters.
        model.to(world.device)
        device_ids = [world.device.index] if world.device.type == "cuda" else None
        wrapped = DDP(model, device_ids=device_ids)
        counter = count_reduced_bytes(wrapped)
    else:  # frozen and trainable parameters may share a unit: fully_shard reduces only the grads
        blocks = ready_made_targets(cfg.arch).block_types
        wrapped = apply_fully_shard(model, mesh, block_types=blocks,
                                    mp_policy=mixed_precision_policy(precision))
    # Only trainable parameters: AdamW allocates no state for the others.
    optimizer = make_adamw([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                           device=world.device)
    return wrapped, optimizer, counter
# --8<-- [end:prepare]


def _step(cfg, wrapped, optimizer, scaler, batch, world, precision) -> torch.Tensor:
    inputs, targets = (t.to(world.device) for t in batch)
    # fully_shard casts with its own MixedPrecisionPolicy; DDP computes under autocast
    cast = autocast(world.device, precision) if cfg.strategy == "ddp" else contextlib.nullcontext()
    with cast:
        loss = lm_loss(logits_of(wrapped(inputs)), targets)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


# --8<-- [start:train]
def train(cfg: FinetuneConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        per_rank_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size)
        # Rank 0 writes the checkpoint: a file in the folder's place fails now, not after training.
        refuse(output_dir_problem(cfg.checkpoint_dir, "--checkpoint-dir")
               if cfg.checkpoint_dir and world.is_main else None)
        precision = setup_precision(cfg.precision, world.device)
        mesh = (init_device_mesh(world.device.type, (world.world_size,), mesh_dim_names=("shard",))
                if cfg.strategy == "fully_shard" else None)
        data = MODEL_PRESETS[cfg.model] if cfg.arch == "cookbook" else HF_DATA
        loader, sampler = distributed_loader(
            make_dataset(data, cfg.global_batch_size, seed=cfg.seed), rank=world.rank,
            world_size=world.world_size, per_rank_batch_size=per_rank_batch, seed=cfg.seed)
        scaler = make_grad_scaler(world.device, precision)
        model, (n_trainable, n_total) = adapt(cfg, cfg.mode)  # bad input stops here, at once
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        full_bytes = None
        if cfg.mode != "full":  # the baseline: full fine-tuning's bytes after one step, then freed
            full_model, _ = adapt(cfg, "full")
            full_wrapped, full_optimizer, _ = wrap(cfg, full_model, world, mesh, precision)
            _step(cfg, full_wrapped, full_optimizer, make_grad_scaler(world.device, precision),
                  next(iter(loader)), world, precision)
            full_bytes = model_state_bytes(full_model, full_optimizer)
            del full_model, full_wrapped, full_optimizer
            gc.collect()
            if world.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(world.device)
        wrapped, optimizer, counter = wrap(cfg, model, world, mesh, precision)
        log.info("%s fine-tuning with %s on %d rank(s): %d of %d parameters train (%.2f%%)",
                 cfg.mode, cfg.strategy, world.world_size, n_trainable, n_total,
                 100 * n_trainable / n_total)
        losses, timer = [], StepTimer(world.device)
        for step, batch in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                loss = _step(cfg, wrapped, optimizer, scaler, batch, world, precision)
            losses.append(mean_over_ranks(loss))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        # After the step, before zero_grad: what each rank holds, and the frozen parameters' grads.
        frozen = [p for p in model.parameters() if not p.requires_grad]
        own_bytes = model_state_bytes(model, optimizer)
        full_bytes = full_bytes or own_bytes
        extras = {
            "mode": cfg.mode, "strategy": cfg.strategy, "arch": cfg.arch,
            "trainable_params": n_trainable, "total_params": n_total,
            "trainable_fraction": n_trainable / n_total, "trainable_names": trainable,
            "memory_per_rank": all_ranks(own_bytes),
            "full_finetune_memory_per_rank": all_ranks(full_bytes),
            "bytes_saved_per_rank": all_ranks(sum(full_bytes.values()) - sum(own_bytes.values())),
            "frozen_grads_none_per_rank": all_ranks(all(p.grad is None for p in frozen)),
            "optimizer_tensors": sum(len(group["params"]) for group in optimizer.param_groups),
            "optimizer_state_tensors": len(optimizer.state),
            "reduced_bytes_per_step": counter["bytes"] / cfg.steps if counter else None,
        }
        names = [name for name, _ in model.named_parameters()]
        state, _ = full_state_on_rank0(model)  # every rank calls it; rank 0 gets the full state
        state = {name: state[name] for name in names} if world.is_main else {}
        if world.is_main and cfg.checkpoint_dir:
            save_checkpoint(cfg, state, trainable)
        result = make_result(
            "finetune", world, losses, state.values(), timer, **extras,
            keep_final_state=state if cfg.keep_final_state and world.is_main else None,
            workload=Workload(data, cfg.global_batch_size, precision))
        result.model_tflops, result.mfu = 0.0, None  # see the module docstring
        # Pitfall: free the DDP wrapper while the process group is alive; a reducer collected
        # after join_world destroyed the group can deadlock the gloo teardown
        # (recipes/lightning_fabric.py).
        del wrapped, optimizer
        return result
# --8<-- [end:train]


# --8<-- [start:save]
def save_checkpoint(cfg: FinetuneConfig, state: dict[str, torch.Tensor], trainable: list[str]):
    """trainable.pt: what changed (the adapters alone for LoRA; the base is the pretrained model
    you started from). merged.pt (LoRA): adapters folded in, loadable without add_lora."""
    os.makedirs(cfg.checkpoint_dir, exist_ok=True)
    torch.save({name: state[name] for name in trainable},
               os.path.join(cfg.checkpoint_dir, "trainable.pt"))
    if cfg.mode == "lora":
        model = build_arch(cfg.arch, cfg.model, seed=cfg.seed)
        add_lora(model, targets=lora_patterns(cfg), rank=cfg.lora_rank, alpha=cfg.lora_alpha)
        load_trainable(model, state)
        torch.save(merge_lora(model).state_dict(), os.path.join(cfg.checkpoint_dir, "merged.pt"))
# --8<-- [end:save]


if __name__ == "__main__":
    run_cli(train, FinetuneConfig, __doc__)
