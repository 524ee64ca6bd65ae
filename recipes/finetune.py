"""Fine-tuning under DDP or fully_shard: full, head-only, partial (the last k blocks) or LoRA.

    torchrun --standalone --nproc_per_node=2 -m recipes.finetune
    torchrun --standalone --nproc_per_node=2 -m recipes.finetune --strategy fully_shard --mode head
    python -m recipes.finetune --arch gpt2 --mode lora --lora-rank 8   # tiny Hugging Face GPT-2
    python -m recipes.finetune --arch llama --lora-impl peft   # the same LoRA through peft

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/parallelize.py (``apply_fully_shard``), recipes/options.py (the command
line, from the config).

The functions to copy take YOUR model and are told what they need: ``add_lora(model, targets=...,
rank=..., alpha=...)`` wraps the modules whose names match the patterns (or a predicate) in a
hand-written ``LoRA``; ``freeze_for(model, mode, head=..., block_types=..., last_k=...)`` sets
``requires_grad``; ``merge_lora(model)`` folds the adapters back into the weights. Ready-made
targets exist for the cookbook's TransformerLM, GPT-2 and Llama (``ready_made_targets``).
``add_peft_lora`` (``--lora-impl peft``) puts the same adapters on through Hugging Face ``peft``'s
``get_peft_model`` (imported only then: ``pip install peft``) and returns the ``PeftModel``.

Order matters: add adapters, freeze, THEN wrap (DDP or fully_shard), then build the optimizer from
the trainable parameters only. Frozen parameters then get no gradient, no AdamW state and no
all-reduce; ``find_unused_parameters`` stays False (a frozen parameter is not an unused one).

``train`` prints how many parameters train and one line per step from rank 0, and returns the
global batch's loss of each step. What fine-tuning saves (each rank's model-state bytes against
full fine-tuning's, the bytes DDP all-reduces) is measured from outside, by the cookbook's
harness. ``--checkpoint-dir`` writes, on rank 0, the trained parameters alone (``trainable.pt``:
the adapters for LoRA; peft's ``get_peft_model_state_dict`` for peft) and, for LoRA,
``merged.pt``, a plain state dict of the merged model that the un-adapted model class loads.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, resolve_precision, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import apply_fully_shard
from recipes.toy import MODEL_PRESETS, Block, ModelConfig, build_model, lm_loss, make_dataset

MODES = ("full", "head", "partial", "lora")
# The tiny Hugging Face models of the tests, and the shapes of the synthetic data they train on.
HF_DATA = ModelConfig(vocab_size=128, seq_len=16, dim=64, n_layers=2, n_heads=4)


class TuningError(ValueError):
    """A model, a target or an option fine-tuning cannot use, in one line with the fix."""


@dataclass
class FinetuneConfig:
    arch: str = option(
        "cookbook",
        "cookbook = recipes/toy.py's TransformerLM (size: --model); gpt2 / llama = tiny "
        "Hugging Face models built from config (needs transformers)",
        choices=["cookbook", "gpt2", "llama"],
    )
    model: str = option("tiny", "model size, for --arch cookbook", choices=sorted(MODEL_PRESETS))
    mode: str = option(
        "lora",
        "what trains: everything, the head, the last --last-k blocks + head, or adapters",
        choices=MODES,
    )
    strategy: str = option("ddp", "how the ranks share the work", choices=["ddp", "fully_shard"])
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights, adapters and data order on every rank
    seed: int = option(
        0, "model init, adapters and data order; the same losses on any world size", at_least=0
    )
    # no fp16: its loss scaler is recipes/amp.py's lesson
    precision: str = option(
        "auto",
        "auto: bf16 on a GPU, fp32 on CPU; fp32: exact (TF32 off); tf32: TF32 matmuls (CUDA); "
        "bf16: mixed precision",
        choices=["auto", "fp32", "tf32", "bf16"],
    )
    last_k: int = option(
        1, "partial: how many of the last blocks train (with the head)", at_least=1
    )
    lora_rank: int = option(
        4, "LoRA: the rank r of each adapter (A: r x in, B: out x r)", at_least=1
    )
    lora_alpha: float = option(8.0, "LoRA: the update is scaled by alpha / rank", above=0)
    lora_impl: str = option(
        "hand",
        "LoRA: hand = this file's LoRA module; peft = Hugging Face peft's get_peft_model "
        "(needs peft), the same adapters",
        choices=["hand", "peft"],
    )
    lora_targets: str = option(
        "",
        "LoRA: comma-separated fnmatch patterns of module names, e.g. '*.attn.wq,*.attn.wv'; "
        "empty = the ready-made ones for --arch",
    )
    checkpoint_dir: str = option("", "rank 0 writes trainable.pt (and merged.pt for LoRA) here")
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self) -> None:  # built from Python too: refused here, before any work
        check_options(self)  # the ranges and choices above: one line each
        if self.lora_targets and self.mode != "lora":
            raise TuningError(
                f"lora_targets={self.lora_targets!r} applies to mode lora, and mode is "
                f"{self.mode}; drop --lora-targets or use --mode lora"
            )
        if self.checkpoint_dir:  # a file in the way fails now, not in makedirs after training
            check_checkpoint_dir(self.checkpoint_dir)


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

        return FinetuneTargets(
            (GPT2Block,), ("transformer.ln_f", "lm_head"), ("*.attn.c_attn", "*.attn.c_proj")
        )
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return FinetuneTargets(
        (LlamaDecoderLayer,), ("model.norm", "lm_head"), ("*.self_attn.[qkvo]_proj",)
    )


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


def add_lora(
    model: nn.Module,
    *,
    targets: Sequence[str] | Callable[[str, nn.Module], bool],
    rank: int,
    alpha: float,
    seed: int = 0,
) -> list[str]:
    """Wrap each module whose full name matches a pattern in ``targets`` (fnmatch), or for which
    ``targets(name, module)`` is true, in a ``LoRA``; returns the names. Same seed, same adapters
    on every rank. Parameter names gain ``.base`` (``wq.weight`` -> ``wq.base.weight``)."""
    if rank < 1:
        raise TuningError(f"LoRA rank must be >= 1, got {rank}; typical ranks are 4, 8 or 16")
    names = lora_target_names(model, targets)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name in names:
            parent, _, child = name.rpartition(".")
            holder = model.get_submodule(parent)
            setattr(holder, child, LoRA(getattr(holder, child), rank, alpha))
    return names


def lora_target_names(
    model: nn.Module, targets: Sequence[str] | Callable[[str, nn.Module], bool]
) -> list[str]:
    """The full names of the Linear / Conv1D modules ``targets`` picks; nothing, or a module that
    is not a projection, is refused."""
    patterns = (targets,) if isinstance(targets, str) else () if callable(targets) else targets
    match = (
        targets
        if callable(targets)
        else (lambda name, _: any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns))
    )
    names = [name for name, module in model.named_modules() if name and match(name, module)]
    linear = {
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    }
    if not names:
        found = sorted({name.split(".")[-1] for name in linear})
        raise TuningError(
            f"LoRA targets {targets!r} match no module of {type(model).__name__}; "
            f"its linear layers are called {', '.join(found)} (patterns match the "
            "full name, e.g. '*.attn.wq')"
        )
    if set(names) - linear:
        raise TuningError(
            f"LoRA targets match {sorted(set(names) - linear)[0]}, which is not a "
            "Linear or Conv1D; narrow the patterns to the projections"
        )
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


# --8<-- [start:peft]
def add_peft_lora(
    model: nn.Module,
    *,
    targets: Sequence[str] | Callable[[str, nn.Module], bool],
    rank: int,
    alpha: float,
    seed: int = 0,
) -> nn.Module:
    """The same adapters through Hugging Face ``peft``: returns the ``PeftModel`` to train (wrap
    IT in DDP or fully_shard). Each target keeps its module as a frozen ``base_layer`` beside
    trainable ``lora_A``/``lora_B``; ``get_peft_model`` freezes everything else itself."""
    names = lora_target_names(model, targets)  # add_lora's patterns and refusals
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise TuningError("--lora-impl peft needs peft: pip install peft") from None
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # scale alpha / r, as LoRA's (use_rslora=False: not alpha / sqrt(r))
        target_modules=names,  # full names; peft also matches a name's dotted suffix
        lora_dropout=0.0,
        init_lora_weights=True,  # A kaiming-uniform(a=sqrt(5)), B zero: LoRA's init
        # GPT-2's Conv1D stores its weight (in, out): the merge must transpose B A
        fan_in_fan_out=any(type(model.get_submodule(n)).__name__ == "Conv1D" for n in names),
    )
    # Pitfall: peft draws A from the global RNG, and fully_shard broadcasts nothing: unseeded,
    # each rank would keep its shard of different adapters. Seeded, every rank builds the same.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


# --8<-- [end:peft]


# --8<-- [start:freeze_for]
def freeze_for(
    model: nn.Module,
    mode: str,
    *,
    head: Sequence[str] = (),
    block_types: tuple[type[nn.Module], ...] = (),
    last_k: int = 1,
) -> tuple[int, int]:
    """Set ``requires_grad`` for ``mode`` (full, head, partial, lora); returns (trainable, total)
    parameter counts. Call it BEFORE wrapping in DDP or fully_shard and before the optimizer."""
    if mode not in MODES:
        raise TuningError(f"unknown fine-tuning mode {mode!r}; valid: {', '.join(MODES)}")
    trained: list[nn.Module | nn.Parameter] = [model]
    if mode == "lora":
        trained = [p for m in model.modules() if isinstance(m, LoRA) for p in (m.lora_a, m.lora_b)]
        if not trained:
            raise TuningError("mode 'lora' found no LoRA adapter; call add_lora(model, ...) first")
    elif mode in ("head", "partial"):
        children = {name for name, _ in model.named_modules()}
        missing = [name for name in head if name not in children]
        if missing or not head:
            raise TuningError(
                f"head modules {list(head)} are not all in {type(model).__name__} "
                f"(missing {missing}); pass head=(names), e.g. ('lm_head',)"
            )
        trained = [model.get_submodule(name) for name in head]
        if mode == "partial":
            blocks = [m for m in model.modules() if block_types and isinstance(m, block_types)]
            if not 1 <= last_k <= len(blocks):
                kinds = ", ".join(t.__name__ for t in block_types) or "no block_types given"
                raise TuningError(
                    f"last_k={last_k}, but {type(model).__name__} has {len(blocks)} "
                    f"blocks ({kinds}); use 1 to {len(blocks)}"
                )
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
        raise TuningError(
            f"checkpoint keys not in the model: {', '.join(unexpected[:3])}; build "
            "the model as it was trained (add_lora with the same targets) first"
        )


def build_arch(arch: str, preset: str = "tiny", *, seed: int = 0) -> nn.Module:
    """The model to fine-tune, the same on every rank (a real run loads pretrained weights here)."""
    if arch == "cookbook":
        return build_model(preset, seed=seed)
    try:
        import transformers
    except ImportError:
        raise TuningError(f"--arch {arch} needs transformers: pip install transformers") from None
    shape = {
        "vocab_size": HF_DATA.vocab_size,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": False,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "gpt2":  # dropout off: the same losses on any world size
            config = transformers.GPT2Config(
                n_layer=2,
                n_embd=64,
                n_head=4,
                n_positions=32,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                **shape,
            )
            return transformers.GPT2LMHeadModel(config).float()
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            **shape,
        )
        return transformers.LlamaForCausalLM(config).float()


def logits_of(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits  # Hugging Face: .logits


def lora_patterns(cfg: FinetuneConfig) -> tuple[str, ...]:
    given = tuple(p.strip() for p in cfg.lora_targets.split(",") if p.strip())
    return given or ready_made_targets(cfg.arch).lora_targets


# --8<-- [start:prepare]
def adapt(cfg: FinetuneConfig, mode: str) -> tuple[nn.Module, tuple[int, int]]:
    """Build the model, add adapters, freeze: all before any wrapper sees the model."""
    model = build_arch(cfg.arch, cfg.model, seed=cfg.seed)
    targets = ready_made_targets(cfg.arch)
    if mode == "lora" and cfg.lora_impl == "peft":  # peft freezes all but its adapters itself
        lora = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "seed": cfg.seed}
        model = add_peft_lora(model, targets=lora_patterns(cfg), **lora)
        return model, model.get_nb_trainable_parameters()  # (trainable, total)
    if mode == "lora":
        add_lora(
            model,
            targets=lora_patterns(cfg),
            rank=cfg.lora_rank,
            alpha=cfg.lora_alpha,
            seed=cfg.seed,
        )
    counts = freeze_for(
        model, mode, head=targets.head, block_types=targets.block_types, last_k=cfg.last_k
    )
    return model, counts


def wrap(
    model: nn.Module,
    strategy: str,
    *,
    mesh,
    device: torch.device,
    block_types: tuple[type[nn.Module], ...],
    low: torch.dtype | None,
) -> nn.Module:
    """The adapted, frozen model wrapped for ``strategy``, computing in ``low`` (None: fp32)."""
    if strategy == "ddp":
        # Pitfall: DDP buckets the parameters that require grad WHEN IT IS BUILT. Frozen first, they
        # are simply left out (no find_unused_parameters); frozen after, DDP waits for their
        # gradients and the second step fails, asking for find_unused_parameters.
        model.to(device)
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # Frozen and trainable parameters may share a unit: fully_shard reduces only the gradients.
    # Its own mixed precision (never autocast on top): compute in low, reduce in fp32.
    return apply_fully_shard(
        model,
        mesh,
        block_types=block_types,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=low, reduce_dtype=torch.float32 if low else None
        ),
    )


# --8<-- [end:prepare]


def check_checkpoint_dir(path: str) -> None:
    """Rank 0 writes there after training: a file in the way fails now, not in makedirs then."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise TuningError(
            f"--checkpoint-dir {path} is a file; name a directory (created if missing)"
        )
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # what makedirs would create goes in here
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        why = (
            f"{existing} is a file, so nothing can be created under it"
            if not os.path.isdir(existing)
            else f"cannot write in {existing}"
        )
        raise TuningError(f"--checkpoint-dir {path}: {why}; name a directory you can write to")


# --8<-- [start:train]
def train(cfg: FinetuneConfig, observer=None) -> list[float]:
    """Fine-tune on this process's rank; returns the global batch's loss of each step."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        rank, world_size, device = world.rank, world.world_size, world.device
        if cfg.global_batch_size % world_size:
            raise TuningError(
                f"global_batch_size={cfg.global_batch_size} does not divide across "
                f"{world_size} ranks; use a multiple of {world_size}"
            )
        per_rank_batch = cfg.global_batch_size // world_size
        precision = resolve_precision(cfg.precision, device)
        low = {"bf16": torch.bfloat16}.get(precision)
        mesh = (
            init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
            if cfg.strategy == "fully_shard"
            else None
        )

        # --8<-- [start:loop]
        # Order: adapters and freezing, THEN the wrapper, then the optimizer. The same seed on
        # every rank gives every rank the same weights and the same adapters.
        model, (n_trainable, n_total) = adapt(cfg, cfg.mode)  # bad targets stop here, at once
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        block_types = ready_made_targets(cfg.arch).block_types
        wrapped = wrap(
            model, cfg.strategy, mesh=mesh, device=device, block_types=block_types, low=low
        )
        # Only trainable parameters: AdamW allocates no state for the others
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            fused=True if device.type == "cuda" else None,
        )
        if observer:
            observer.model_ready(wrapped, optimizer)
        if rank == 0:
            print(
                f"{cfg.mode} fine-tuning with {cfg.strategy} on {world_size} rank(s): "
                f"{n_trainable} of {n_total} parameters train "
                f"({100 * n_trainable / n_total:.2f}%)",
                flush=True,
            )

        data = MODEL_PRESETS[cfg.model] if cfg.arch == "cookbook" else HF_DATA
        dataset = make_dataset(data, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
        # at step s is one process's batch s. drop_last keeps every global batch full.
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True)
        autocast = low is not None and cfg.strategy == "ddp"  # fully_shard casts by its policy

        losses, step, epoch = [], 0, 0
        while step < cfg.steps:
            # Pitfall: without set_epoch every epoch repeats the first epoch's order
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=low or torch.float32, enabled=autocast):
                    loss = lm_loss(logits_of(wrapped(inputs)), targets)  # this rank's mean
                loss.backward()  # frozen parameters: no gradient, no reduction
                optimizer.step()  # only the trainable parameters move
                # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks)
                global_loss = loss.detach().float().clone()
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
                losses.append(global_loss.item())
                if rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f}", flush=True)
                if observer:
                    observer.step_end(step, losses[-1])
                step += 1
            epoch += 1
        # --8<-- [end:loop]

        if cfg.checkpoint_dir:
            # Every rank takes part (fully_shard gathers each shard); rank 0 alone receives the
            # full state, in host memory, and writes it
            state = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if rank == 0:
                save_checkpoint(cfg, state, trainable)
            dist.barrier()  # no rank reads the files or exits before they are complete
        return losses
    finally:
        cleanup_distributed()


# --8<-- [end:train]


# --8<-- [start:save]
def save_checkpoint(cfg: FinetuneConfig, state: dict[str, torch.Tensor], trainable: list[str]):
    """trainable.pt: what changed (the adapters alone for LoRA; the base is the pretrained model
    you started from). merged.pt (LoRA): adapters folded in, loadable without add_lora."""
    os.makedirs(cfg.checkpoint_dir, exist_ok=True)
    if cfg.mode == "lora" and cfg.lora_impl == "peft":
        return save_peft_checkpoint(cfg, state)
    torch.save(
        {name: state[name] for name in trainable}, os.path.join(cfg.checkpoint_dir, "trainable.pt")
    )
    if cfg.mode == "lora":
        model = build_arch(cfg.arch, cfg.model, seed=cfg.seed)
        add_lora(model, targets=lora_patterns(cfg), rank=cfg.lora_rank, alpha=cfg.lora_alpha)
        load_trainable(model, state)
        torch.save(merge_lora(model).state_dict(), os.path.join(cfg.checkpoint_dir, "merged.pt"))


# --8<-- [end:save]


# --8<-- [start:save_peft]
def save_peft_checkpoint(cfg: FinetuneConfig, state: dict[str, torch.Tensor]) -> None:
    """peft's two: the adapters in its own key format (``set_peft_model_state_dict`` loads them on
    a fresh ``get_peft_model``), and ``merge_and_unload``'s plain model, as merged.pt."""
    from peft import get_peft_model_state_dict

    model = build_arch(cfg.arch, cfg.model, seed=cfg.seed)
    model = add_peft_lora(
        model, targets=lora_patterns(cfg), rank=cfg.lora_rank, alpha=cfg.lora_alpha
    )
    model.load_state_dict(state)  # the trained PeftModel, unsharded, on rank 0
    adapters = get_peft_model_state_dict(model)  # lora_A / lora_B only, adapter name dropped
    torch.save(adapters, os.path.join(cfg.checkpoint_dir, "trainable.pt"))
    merged = model.merge_and_unload()  # B A folded into each base_layer; the plain class again
    torch.save(merged.state_dict(), os.path.join(cfg.checkpoint_dir, "merged.pt"))


# --8<-- [end:save_peft]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(FinetuneConfig, prog="python -m recipes.finetune", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), FinetuneConfig, argv)
    with exit_on_bad_input():  # a target that matches nothing: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
