"""The functions that parallelize your model: copy this file, or any one function with what it
names, into your project. It imports torch and nothing else.

Each takes your model and torch's own types, with keyword-only options, and is told what it needs:
the block classes to shard, checkpoint or compile (``block_types=(YourBlock,)`` or ``is_block``), a
tensor-parallel plan as ``parallelize_module`` takes it, a wrap policy. A request that matches
nothing, a plan key that names no module, or a split that would untie a tied weight is refused
with a ``ValueError`` subclass defined beside the function, in one line that names what the model
has and the fix: never a silent partial result.

Order, as torchtitan's ``parallelize`` composes them: ``apply_tp`` (it splits the weights), then
``apply_activation_checkpointing``, then ``apply_compile``, then ``apply_fully_shard`` (or classic
``apply_fsdp``), which wraps what the others made. ``apply_tp_and_fsdp`` is the 2-D composition.

The recipes show each in use: activation_checkpointing, performance (compile), fsdp2, fsdp,
tensor_parallel and hybrid_parallel; the complete job (recipes/job.py) composes them by
configuration. ``rank_grid`` prints a mesh's rank map, for the log of any layout on a mesh.
``build_sharded_on_meta`` (build on meta, shard, allocate the shards) and ``local_slices`` (where
a rank's shard sits in the full tensor) serve meta_init and hf_checkpoint. ``checked_mesh`` is
``init_device_mesh`` with the sizes checked first (grad_clipping, sharded_accumulation).
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import re
from collections.abc import Callable, Mapping
from math import prod

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_checkpoint_wrapper
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = [
    "CheckpointingError",
    "apply_activation_checkpointing",
    "CompileTargetError",
    "apply_compile",
    "ShardingError",
    "apply_fully_shard",
    "build_sharded_on_meta",
    "local_slices",
    "FSDPWrapError",
    "apply_fsdp",
    "check_units",
    "tied_modules",
    "TPPlanError",
    "apply_tp",
    "check_tp_plan",
    "check_heads_divide",
    "check_tp_fits",
    "matching_modules",
    "transformer_lm_plan",
    "llama_plan",
    "ReplicateParallel",
    "apply_tp_and_fsdp",
    "rank_grid",
    "MeshError",
    "checked_mesh",
]


# --8<-- [start:apply_activation_checkpointing]
class CheckpointingError(ValueError):
    """apply_activation_checkpointing refused the model or its arguments: one line naming the fix.

    A ValueError of this module's own, so that the function copies without the cookbook's package.
    """


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    block_types: tuple[type[nn.Module], ...] | None = None,
    is_block: Callable[[nn.Module], bool] | None = None,
    every_k: int = 1,
    policy: Callable[..., CheckpointPolicy] | list | None = None,
) -> list[nn.Module]:
    """Checkpoint blocks 0, k, 2k, ... of ``model`` in place and return them.

    Name the blocks by class (``block_types=(Block,)``) or by a predicate (``is_block``), in
    ``model.modules()`` order; match no module that sits inside another match. ``policy`` (a
    function like ``save_matmul_outputs``, or a list of ops to keep) turns on op-level selective
    checkpointing; without it a block keeps only its input. Each block's ``forward`` becomes
    ``checkpoint(original_forward, x, use_reentrant=False, ...)``: no wrapper module is inserted, so
    parameter names (state dicts, optimizer states, checkpoints on disk) stay as they were, where
    torch's ``checkpoint_wrapper`` adds a ``_checkpoint_wrapped_module.`` prefix. Call it once,
    before torch.compile and DDP/FSDP wrap the model.
    """
    if (block_types is None) == (is_block is None):
        raise CheckpointingError(
            "apply_activation_checkpointing needs exactly one of "
            "block_types=(YourBlock,) or is_block=..."
        )
    if every_k < 1:
        raise CheckpointingError(f"every_k must be >= 1, got {every_k}")
    matches = is_block or (lambda module: isinstance(module, block_types))
    blocks = [module for module in model.modules() if matches(module)][::every_k]
    if not blocks:
        found = sorted({type(module).__name__ for module in model.modules()})
        raise CheckpointingError(
            f"apply_activation_checkpointing matched no block in {type(model).__name__}; its "
            f"module classes are: {', '.join(found)}; pass block_types=(TheBlockClass,)"
        )
    options: dict = {"use_reentrant": False}
    if policy is not None:  # checkpoint calls context_fn on every forward: a fresh cache each time
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    for block in blocks:
        block.forward = checkpointed(block, options)
    return blocks


# Keyword names under which Hugging Face blocks take a key/value cache.
CACHE_ARGUMENTS = frozenset({"cache", "past_key_values", "past_key_value", "layer_past"})


def checkpointed(block: nn.Module, options: dict) -> Callable:
    """``block.forward`` under ``checkpoint``, refusing a key/value cache while gradients are on.

    Pitfall: checkpoint replays the forward in backward with the same argument objects. A cache
    the forward updated is not the one it saw: T5's decoder (built with use_cache=True) fills its
    cross-attention cache, and the replay reuses those keys/values instead of computing them, so
    backward fails with "A different number of tensors was saved during the original forward and
    recomputation". torch's checkpoint_wrapper fails the same way; HF's own checkpointing drops
    the cache inside checkpointed layers. GPT-2's self-attention cache grows to twice the sequence
    in the replay and comes out exact only because torch's causal mask is top-left aligned (query
    i still sees the first i keys, the forward's own); and a cache keeps every layer's keys and
    values alive, what checkpointing was meant to free.
    """
    forward = block.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():  # without gradients nothing is replayed: a cache is fine
            named = [*((f"argument {i}", value) for i, value in enumerate(args)), *kwargs.items()]
            for name, value in named:
                if value is not None and (
                    name in CACHE_ARGUMENTS or type(value).__name__.endswith("Cache")
                ):
                    raise CheckpointingError(
                        f"{type(block).__name__}'s checkpointed forward got a key/value cache "
                        f"({name}: {type(value).__name__}): the replay in backward would see "
                        "what it filled; build or call the model with use_cache=False, or use "
                        "its own model.gradient_checkpointing_enable()"
                    )
        return checkpoint(forward, *args, **options, **kwargs)

    return run


# --8<-- [end:apply_activation_checkpointing]


# --8<-- [start:apply_compile]
class CompileTargetError(ValueError):
    """apply_compile was not told which blocks to compile, or they match nothing in the model.

    A ValueError of this module's own, so that the function copies without the cookbook's package.
    """


def apply_compile(
    model: nn.Module,
    *,
    block_types: tuple[type[nn.Module], ...] | None = None,
    is_block: Callable[[nn.Module], bool] | None = None,
    backend: str = "inductor",
) -> nn.Module:
    """``torch.compile`` each block of ``model`` in place; returns ``model``.

    Name the blocks by class (``block_types``) or by a predicate (``is_block``). Compiling the
    repeated block, not the whole model, compiles once and reuses the code for every layer, and
    keeps the sharding hooks between blocks out of the graph. Compiling ``forward`` in place
    changes no parameter name, so checkpoints and tensor-parallel plans stay valid.

    Order: after activation checkpointing (so the checkpointed region is compiled as a whole) and
    before fully_shard / DDP (which then wrap compiled blocks).
    """
    if (block_types is None) == (is_block is None):
        raise CompileTargetError(
            "apply_compile needs exactly one of block_types=(YourBlock,) or is_block=..."
        )
    matches = is_block or (lambda module: isinstance(module, block_types))
    blocks = [module for module in model.modules() if matches(module)]
    if not blocks:
        found = sorted({type(m).__name__ for m in model.modules()})
        raise CompileTargetError(
            f"apply_compile matched no block in {type(model).__name__}; its module classes "
            f"are: {', '.join(found)}; pass block_types=(TheBlockClass,)"
        )
    for block in blocks:
        # The block's forward, not the module call: hooks that wrappers put on the block
        # (fully_shard's all-gather and reduce-scatter) then run eagerly around the graph
        # instead of breaking it.
        # On an H200 (100m, bf16, batch 64) fully_shard + compile ran 80.5 ms a step with
        # Module.compile() and 60.5 ms this way; the unsharded compiled loop, 54.6 ms.
        block.forward = torch.compile(block.forward, backend=backend)
    return model


# --8<-- [end:apply_compile]


# --8<-- [start:apply_fully_shard]
class ShardingError(ValueError):
    """apply_fully_shard refused the model: one line naming the block classes it has.

    A ValueError of this module's own, so that the function copies without the cookbook's package.
    """


def apply_fully_shard(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    block_types: tuple[type[nn.Module], ...],
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    explicit_prefetch: bool = False,
) -> nn.Module:
    """Shard each block, then the root, over ``mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP).

    ``block_types``: your model's repeated block classes (``(Block,)`` here, ``(GPT2Block,)`` for
    Hugging Face GPT-2). A model with none of them is refused, naming the classes it has: one unit
    for the whole model would silently gather every parameter at once.
    """
    precision, offload = mp_policy or MixedPrecisionPolicy(), offload_policy or OffloadPolicy()
    blocks = [module for module in model.modules() if isinstance(module, block_types)]
    if not blocks:
        found = sorted({type(m).__name__ for m in model.modules()})
        raise ShardingError(
            f"apply_fully_shard found no {', '.join(t.__name__ for t in block_types)} in "
            f"{type(model).__name__}; its module classes are: {', '.join(found)}"
        )
    # Order: bottom-up. Each call groups the parameters not yet claimed by an inner call, so the
    # Blocks go first and the root call collects the rest (embeddings, final norm, output).
    for block in blocks:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=precision,
            offload_policy=offload,
        )
    # The root keeps fully_shard's default (None -> not resharded after forward): backward needs
    # its parameters (the output layer) first, so freeing them would only re-gather them at once.
    fully_shard(model, mesh=mesh, mp_policy=precision, offload_policy=offload)
    if explicit_prefetch:
        # Default: each group all-gathers when its own forward / backward starts (after the previous
        # one is issued). Explicit: Block i issues Block i+1's all-gather in forward and Block i-1's
        # in backward, so the communication runs under Block i's compute.
        for previous, following in zip(blocks, blocks[1:]):
            previous.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([previous])
    return model


# --8<-- [end:apply_fully_shard]


# --8<-- [start:build_sharded_on_meta]
def build_sharded_on_meta(
    make_model: Callable[[], nn.Module],
    mesh: DeviceMesh,
    *,
    block_types: tuple[type[nn.Module], ...],
    device: torch.device,
) -> nn.Module:
    """Build under meta (no bytes), shard, then allocate only this rank's shards (uninitialised).

    Order: sharding before ``to_empty`` is what makes each rank allocate 1/N. Pitfall:
    ``to_empty`` gives every parameter and buffer new, uninitialised memory: each one must be
    initialised or loaded afterwards, buffers too (a rotary table, a causal mask)."""
    with torch.device("meta"):
        model = make_model()
    apply_fully_shard(model, mesh, block_types=block_types)
    model.to_empty(device=device)
    return model


# --8<-- [end:build_sharded_on_meta]


# --8<-- [start:local_slices]
def local_slices(param: DTensor) -> tuple[slice, ...]:
    """The index of this rank's shard inside the full tensor, e.g. rows 32:64 of a (64, 32) weight.

    DCP's own chunk list (``__create_chunk_list__``) gives the offsets and sizes for any placement,
    uneven shards included, without a collective."""
    (chunk,) = param.__create_chunk_list__()
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))


# --8<-- [end:local_slices]


# --8<-- [start:apply_fsdp]
class FSDPWrapError(ValueError):
    """apply_fsdp refused the model or its options: a wrap policy that wraps nothing or splits a
    tied weight, a hybrid strategy without a 2-D mesh, CPU offload without a GPU.

    A ValueError of this module's own, so that the function copies without the cookbook's package.
    """


def apply_fsdp(
    model: nn.Module,
    *,
    auto_wrap_policy: ModuleWrapPolicy | Callable | None,
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
    limit_all_gathers: bool = True,
    sync_module_states: bool = True,
    checkpoint_block_types: tuple[type[nn.Module], ...] = (),
    device: torch.device | None = None,
    mesh: DeviceMesh | None = None,
) -> FSDP:
    """Wrap ``model`` in classic FSDP, one unit per module that ``auto_wrap_policy`` picks.

    ``auto_wrap_policy``: e.g. ``ModuleWrapPolicy({GPT2Block})``, your model's block classes; None
    makes the whole model one unit. A policy that wraps nothing, or that puts the two users of a
    tied weight (GPT-2's ``wte`` and ``lm_head``) in different units, is refused. ``mesh``: 2-D
    ("replicate", "shard") for HYBRID_SHARD, else optional 1-D. ``checkpoint_block_types``:
    recompute these blocks' activations in backward (activation checkpointing inside each unit).
    """
    hybrid = sharding_strategy in (
        ShardingStrategy.HYBRID_SHARD,
        ShardingStrategy._HYBRID_SHARD_ZERO2,
    )
    if hybrid and (mesh is None or mesh.ndim != 2):
        raise FSDPWrapError(f"{sharding_strategy.name} needs a 2-D device mesh (replicate, shard)")
    if hybrid and mesh.size(1) == 1:
        # Pitfall (torch's FSDP, seen on 2.13): with one rank per shard group FSDP clamps the group
        # to NO_SHARD and never all-reduces across the replicas: each rank trains on its own
        # gradient. One rank per node means replication, which is NO_SHARD over the whole world.
        sharding_strategy, mesh = ShardingStrategy.NO_SHARD, None
    on_cpu = (device or next(model.parameters()).device).type == "cpu"
    if cpu_offload is not None and cpu_offload.offload_params and on_cpu:
        raise FSDPWrapError(
            "cpu_offload needs a GPU: FSDP pins host memory for the copies to "
            "and from the device; on a CPU-only world the parameters already live "
            "in host memory: drop --cpu-offload"
        )
    if sync_module_states and on_cpu:
        # FSDP's own sync_module_states refuses CPU tensors (it broadcasts on the accelerator): on a
        # CPU-only world, broadcast rank 0's parameters and buffers by hand, before sharding.
        with torch.no_grad():
            for tensor in itertools.chain(model.parameters(), model.buffers()):
                dist.broadcast(tensor, src=0)
        sync_module_states = False
    tied = tied_modules(model)  # before wrapping: FSDP flattens them away
    fsdp_model = FSDP(
        model,
        sharding_strategy=sharding_strategy,
        auto_wrap_policy=auto_wrap_policy,
        mixed_precision=mixed_precision,  # e.g. fsdp_mixed_precision("bf16"); None = fp32
        cpu_offload=cpu_offload,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        limit_all_gathers=limit_all_gathers,
        sync_module_states=sync_module_states,
        # use_orig_params: parameters keep their names and shapes for the optimizer (per-parameter
        # groups, weight-decay rules) and for torch.compile; gradients are views into the flat
        # shard.
        use_orig_params=True,
        # Pitfall: without device_id FSDP looks for an accelerator and refuses a CPU-only host.
        device_id=device,
        device_mesh=mesh,
    )
    check_units(fsdp_model, auto_wrap_policy, tied)
    if checkpoint_block_types:
        # Order: wrap with FSDP FIRST, then checkpoint, so each unit is
        # FSDP(CheckpointWrapper(Block)): the recomputation in backward runs inside the unit while
        # its parameters are all-gathered. Non-reentrant: the reentrant variant runs a nested
        # backward that FSDP's hooks do not expect.
        # torch's own checkpoint_wrapper here (not this file's apply_activation_checkpointing):
        # classic FSDP documents and tests its units wrapped by it
        torch_checkpoint_wrapper.apply_activation_checkpointing(
            fsdp_model,
            check_fn=lambda module: isinstance(module, checkpoint_block_types),
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            ),
        )
    return fsdp_model


def tied_modules(model: nn.Module) -> list[list[nn.Module]]:
    """For each parameter that several modules share (a tied embedding and output layer), the
    modules that hold it."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
    return [modules for modules in holders.values() if len(modules) > 1]


def check_units(fsdp_model: FSDP, policy, tied: list[list[nn.Module]]) -> None:
    """FSDPWrapError if the policy wrapped nothing, or split a tied weight across units.

    A tied weight in two units is two flat shards that no longer share storage: the forward fails
    ("size mismatch ... vec (0)") or, worse, the two copies train apart.
    """
    unit_of: dict[int, nn.Module] = {}

    def visit(module: nn.Module, unit: nn.Module) -> None:
        unit = module if isinstance(module, FSDP) else unit
        unit_of[id(module)] = unit
        for child in module.children():
            visit(child, unit)

    visit(fsdp_model, fsdp_model)
    units = {id(unit) for unit in unit_of.values()}
    inner = fsdp_model.module
    if policy is not None and len(units) == 1:
        found = sorted({type(m).__name__ for m in inner.modules()})
        raise FSDPWrapError(
            f"the FSDP wrap policy matched nothing in {type(inner).__name__}, so "
            f"the whole model is one unit; pass your block classes, e.g. "
            f"ModuleWrapPolicy({{Block}}); its module classes are: "
            f"{', '.join(found)}"
        )
    names = {id(m): name for name, m in inner.named_modules(remove_duplicate=False)}
    for holders in tied:
        if len({id(unit_of[id(m)]) for m in holders}) > 1:
            raise FSDPWrapError(
                "the FSDP wrap policy puts a tied weight's modules ("
                + ", ".join(names.get(id(m), type(m).__name__) for m in holders)
                + ") in different units; wrap only the blocks (ModuleWrapPolicy({Block})) so that "
                "they stay together in the root unit"
            )


# --8<-- [end:apply_fsdp]


# --8<-- [start:apply_tp]
class TPPlanError(ValueError):
    """apply_tp (or a check beside it) refused the plan: a key that names no module, a split that
    is uneven or would untie a tied weight, heads that do not divide over the ranks.

    A ValueError of this module's own, so that apply_tp copies without the cookbook's package.
    """


class ReplicateParallel(ParallelStyle):
    """Parameters become Replicate DTensors; the module takes and returns plain tensors
    (torchtitan's NoParallel). For the norms without sequence parallel: every parameter is then a
    DTensor.

    Pitfall: a model with both DTensor and plain parameters trains on CPU, where AdamW loops over
    tensors one by one, and fails on GPU, where it defaults to foreach kernels ("got mixed
    torch.Tensor and DTensor"); clip_grad_norm_ fails the same way.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicated_inputs(_module, inputs, mesh):
            return tuple(
                DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
                else t
                for t in inputs
            )

        def local_output(_module, output, _mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(
            module, device_mesh, input_fn=replicated_inputs, output_fn=local_output
        )


def matching_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """The submodules whose dotted path matches ``pattern`` name by name, ``*`` matching any one
    name: how ``parallelize_module`` resolves a plan key (``"layers.*.attn.wq"``)."""
    atoms = pattern.split(".")
    return [
        (name, module)
        for name, module in model.named_modules()
        if name
        and len(name.split(".")) == len(atoms)
        and all(fnmatch.fnmatchcase(part, atom) for part, atom in zip(name.split("."), atoms))
    ]


def check_tp_plan(model: nn.Module, plan: Mapping[str, ParallelStyle], tp_size: int) -> None:
    """TPPlanError unless every plan key names modules of ``model`` that its style can split evenly.

    ``parallelize_module`` itself only warns about a key that matches nothing and skips it: the
    model would silently stay replicated where the plan says split.
    """
    for pattern, style in plan.items():
        found = matching_modules(model, pattern)
        if not found:
            paths = sorted(
                {re.sub(r"\.\d+(?=\.|$)", ".*", name) for name, _ in model.named_modules()}
            )
            raise TPPlanError(
                f"TP plan key {pattern!r} matches no module of {type(model).__name__}; its modules "
                f"are: {', '.join(p for p in paths if p)}"
            )
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        for name, module in found:
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise TPPlanError(
                    f"{type(style).__name__} splits nn.Linear and nn.Embedding only; {name} is a "
                    f"{type(module).__name__}: leave it out of the plan (or replicate it)"
                )
            # The split dimension: Linear weights are [out, in], Embedding weights [rows, dim].
            colwise = isinstance(style, ColwiseParallel)
            size = module.weight.shape[0 if colwise == isinstance(module, nn.Linear) else 1]
            if size % tp_size:
                raise TPPlanError(
                    f"{type(style).__name__} on {name} splits a dimension of {size} over {tp_size} "
                    f"ranks; use a tensor-parallel size that divides {size}"
                )


def check_heads_divide(tp_size: int, *, n_heads: int, n_kv_heads: int | None = None) -> None:
    """TPPlanError unless every rank gets whole attention heads (column-wise q/k/v split them)."""
    for what, count in (("attention heads", n_heads), ("key/value heads", n_kv_heads)):
        if count is not None and count % tp_size:
            fits = [n for n in range(1, count + 1) if count % n == 0]
            raise TPPlanError(
                f"{count} {what} do not split over {tp_size} tensor-parallel ranks; "
                f"use a tensor-parallel size of {', '.join(map(str, fits))}"
            )


def check_tp_fits(tp_size: int, **sizes: int) -> None:
    """TPPlanError unless every size the plan splits divides by ``tp_size``, naming the sizes that
    would: ``check_tp_fits(3, n_heads=4, mlp_width=128, vocab_size=64, seq_len=16)``. Before the
    model exists (a config check, a dry run): DTensor could shard unevenly; equal shards keep the
    heads whole and the collectives simple."""
    bad = [f"{name}={size}" for name, size in sizes.items() if size % tp_size]
    if bad:
        fits = [
            n
            for n in range(1, min(sizes.values()) + 1)
            if all(size % n == 0 for size in sizes.values())
        ]
        raise TPPlanError(
            f"tensor parallel over {tp_size} ranks cannot split {', '.join(bad)}; "
            f"use a tensor-parallel size of {', '.join(map(str, fits))}"
        )


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, *, plan: Mapping[str, ParallelStyle]
) -> nn.Module:
    """Split ``model`` across the ranks of the 1-D ``tp_mesh`` as ``plan`` says, in place.

    ``plan``: module path (``*`` = any one name) -> torch ParallelStyle, as ``parallelize_module``
    takes it; ``transformer_lm_plan`` and ``llama_plan`` below are ready-made ones. Every key must
    match a module and every split must be even (checked first, naming the fix). Apply it before
    fully_shard and before building the optimizer (the optimizer must see the DTensor parameters
    that replace the plain ones). Parameters keep their names, and a weight that two modules
    share (a tied embedding and head) stays one parameter: both must be split alike.
    """
    check_tp_plan(model, plan, tp_mesh.size())
    tied = tied_parameters(model)
    check_ties_split_alike(model, plan, tied)
    parallelize_module(model, tp_mesh, dict(plan))
    retie(model, tied)
    return model


def tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """(module path, parameter name) of every holder, for each parameter several modules share:
    an embedding tied to the output head (``tie_word_embeddings=True``, GPT-2, many small Llamas).
    """
    holders: dict[int, list[tuple[str, str]]] = {}
    for path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((path, name))
    return [users for users in holders.values() if len(users) > 1]


def weight_split(model: nn.Module, plan: Mapping[str, ParallelStyle], path: str) -> str:
    """How ``plan`` splits the weight of module ``path``, in words: 'Shard(d)', 'kept whole'..."""
    styles = [
        style
        for pattern, style in plan.items()
        if any(name == path for name, _ in matching_modules(model, pattern))
    ]
    if not styles:
        return "kept whole"
    module, style = model.get_submodule(path), styles[-1]
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        colwise = isinstance(style, ColwiseParallel)  # the dimension as in check_tp_plan
        return f"Shard({0 if colwise == isinstance(module, nn.Linear) else 1})"
    return type(style).__name__


def check_ties_split_alike(
    model: nn.Module, plan: Mapping[str, ParallelStyle], tied: list[list[tuple[str, str]]]
) -> None:
    """TPPlanError unless the holders of each tied weight get the same split.

    Pitfall: ``parallelize_module`` gives each module its own new parameter, so a tied weight
    silently becomes two that drift apart (1.6e-3 in the loss after 3 steps on a tied Llama).
    Where both halves are split alike, ``retie`` makes them one parameter again: exact, since
    row-wise on an embedding and column-wise on the head both shard the [vocab, dim] weight on
    dim 0, so every rank holds the same rows for both uses.
    """
    for users in tied:
        splits = {path: weight_split(model, plan, path) for path, _ in users}
        if len(set(splits.values())) > 1:
            said = ", ".join(f"{path} {split}" for path, split in splits.items())
            raise TPPlanError(
                f"apply_tp would untie the weight that {' and '.join(splits)} share: the plan "
                f"splits it {said}; give them the same split (RowwiseParallel on the embedding, "
                "ColwiseParallel on the head: both Shard(0)) or untie them in the model"
            )


def retie(model: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """Make each tied weight's holders share one (split) parameter again, after the split."""
    for (first_path, first_name), *others in tied:
        shared = getattr(model.get_submodule(first_path), first_name)
        for path, name in others:
            module = model.get_submodule(path)
            mine = getattr(module, name)
            placements = [getattr(p, "placements", None) for p in (shared, mine)]
            if placements[0] != placements[1]:  # a custom style the check could not foresee
                raise TPPlanError(
                    f"apply_tp split the weight that {first_path} and {path} share "
                    f"as {placements[0]} and {placements[1]}; give them one split"
                )
            module.register_parameter(name, shared)


def transformer_lm_plan(
    *, sequence_parallel: bool = False, loss_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The Megatron-LM split of the cookbook's TransformerLM (recipes/toy.py)."""
    # Between blocks the residual stream is either replicated (every rank holds all of it) or, with
    # sequence parallel, split along the sequence dim: Shard(1) of [batch, seq, dim].
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        # Row-wise on an embedding splits the vocabulary rows; each rank looks up the ids it owns
        # and the partial results are summed (or reduce-scattered straight into the sequence
        # shards).
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        # Position embeddings are [seq, dim]: their sequence dim is 0, so their shard is Shard(0);
        # added to tok_embeddings' [batch, seq/N, dim] shard it lines up position by position.
        "pos_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel else Replicate()
        ),
        # Column-wise q/k/v: rank r gets heads [r*H/N, (r+1)*H/N): attention needs no communication.
        "layers.*.attn.wq": ColwiseParallel(),
        "layers.*.attn.wk": ColwiseParallel(),
        "layers.*.attn.wv": ColwiseParallel(),
        # Row-wise wo: takes its input's head shard, sums partial outputs across ranks (all-reduce,
        # or reduce-scatter into sequence shards with sequence parallel).
        "layers.*.attn.wo": RowwiseParallel(output_layouts=residual),
        "layers.*.mlp.w_in": ColwiseParallel(),
        "layers.*.mlp.w_out": RowwiseParallel(output_layouts=residual),
        # Column-wise head: each rank computes logits for its slice of the vocabulary. Without loss
        # parallel they are all-gathered (Replicate); with it they stay a DTensor sharded on the
        # last dim (use_local_output=False: the loss needs to know they are shards).
        "output": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan.update(
            {
                # LayerNorm normalizes over dim, so it runs on sequence shards unchanged...
                "layers.*.attn_norm": SequenceParallel(),
                "layers.*.mlp_norm": SequenceParallel(),
                "norm": SequenceParallel(),
                # ...but attention and the MLP need whole sequences: all-gather them on the way in.
                # Pitfall: without these, q/k/v see a sequence shard and attention is silently
                # wrong.
                "layers.*.attn": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "layers.*.mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        )
    else:  # replicated norms, whose parameters still become DTensors
        plan.update(
            {
                name: ReplicateParallel()
                for name in ("layers.*.attn_norm", "layers.*.mlp_norm", "norm")
            }
        )
    return plan


def llama_plan() -> dict[str, ParallelStyle]:
    """The same split for a Llama-style model with Hugging Face's names (LlamaForCausalLM;
    Mistral and Qwen2 share them). Its attention infers the local head count from q_proj's output,
    as ours does.
    Check the heads first: ``check_heads_divide(tp, n_heads=..., n_kv_heads=...)``."""
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        # SwiGLU: gate and up split alike, so each rank multiplies matching halves; down sums them.
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    plan.update(
        {
            name: ReplicateParallel()
            for name in (
                "model.layers.*.input_layernorm",
                "model.layers.*.post_attention_layernorm",
                "model.norm",
            )
        }
    )
    return plan


# --8<-- [end:apply_tp]


# --8<-- [start:apply_tp_and_fsdp]
def apply_tp_and_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    plan: Mapping[str, ParallelStyle],
    block_types: tuple[type[nn.Module], ...],
    in_pipeline: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Tensor parallel over mesh["tp"] as ``plan`` says, then fully_shard over mesh["dp"], one
    group per ``block_types`` block: the 2-D part of every layout."""
    apply_tp(module, mesh["tp"], plan=plan)
    # In a pipeline every micro-batch runs the stage's forward: resharding after each forward would
    # all-gather the parameters once per micro-batch. Keep them (ZeRO-2 style) until the backward.
    return apply_fully_shard(
        module,
        mesh["dp"],
        block_types=block_types,
        reshard_after_forward=not in_pipeline,
        mp_policy=mp_policy,
    )


# --8<-- [end:apply_tp_and_fsdp]


# --8<-- [start:rank_grid]
def rank_grid(mesh: DeviceMesh) -> str:
    """The mesh as tables of global ranks, to log where each parallelism's groups lie (shared by
    process_groups and hybrid_parallel): rows = second-to-last dim, columns = last dim, one table
    per coordinate of the dims before them (e.g. one per pipeline stage of a pp x dp x tp mesh)."""
    names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])
    ranks = mesh.mesh if mesh.ndim >= 2 else mesh.mesh.reshape(1, -1)
    if mesh.ndim == 1:
        names.insert(0, "")
    width = max(len(f"{names[-1]}={ranks.shape[-1] - 1}"), len(str(int(ranks.max())))) + 2
    lines = [f"mesh {' x '.join(n for n in names if n)} = {' x '.join(map(str, mesh.mesh.shape))}"]
    for outer in itertools.product(*(range(n) for n in ranks.shape[:-2])):
        if outer:
            lines.append(", ".join(f"{name}={i}" for name, i in zip(names, outer)) + ":")
        lines.append(
            " " * 8 + "".join(f"{names[-1]}={c}".rjust(width) for c in range(ranks.shape[-1]))
        )
        for r, row in enumerate(ranks[outer]):
            label = f"{names[-2]}={r}" if names[-2] else ""
            lines.append(f"  {label:<6}" + "".join(str(int(rank)).rjust(width) for rank in row))
    return "\n".join(lines)


# --8<-- [end:rank_grid]


class MeshError(ValueError):
    """checked_mesh refused the sizes: one line naming what the world has and what to pass."""


def checked_mesh(world, sizes: list[int], names: tuple[str, ...]) -> DeviceMesh:
    """``init_device_mesh(world.device.type, sizes, mesh_dim_names=names)`` after the checks that
    give one line instead of a deep traceback: one size per name, each >= 1, their product the
    world size. ``world``: anything with ``world_size`` and ``device`` (``setup_distributed``'s)."""
    from torch.distributed.device_mesh import init_device_mesh

    if len(sizes) != len(names):
        raise MeshError(
            f"mesh {sizes} has {len(sizes)} dims but this layout has "
            f"{len(names)} ({', '.join(names)}); pass one size per dim"
        )
    if any(size < 1 for size in sizes) or prod(sizes) != world.world_size:
        shown = "x".join(map(str, sizes))
        raise MeshError(
            f"mesh {shown} has {prod(sizes)} ranks but the world has "
            f"{world.world_size}; pass sizes >= 1 whose product is {world.world_size}"
        )
    return init_device_mesh(world.device.type, tuple(sizes), mesh_dim_names=names)
