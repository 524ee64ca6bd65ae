r"""Tensor parallelism with DTensor: every layer's weights split across ranks, the same model.

    torchrun --standalone --nproc_per_node=2 -m recipes.tensor_parallel
    torchrun --standalone --nproc_per_node=4 -m recipes.tensor_parallel --sequence-parallel \
        --loss-parallel
    python -m recipes.tensor_parallel                   # a world of 1: tensor-parallel degree 1

The whole world is one tensor-parallel group (a 1-D DeviceMesh named "tp"); for tensor parallel
inside each of several data-parallel replicas see recipes.hybrid_parallel. ``apply_tp`` is the
Megatron-LM split, written with ``torch.distributed.tensor.parallel`` as torchtitan's
``parallelize.py`` does:

- attention: ``wq``/``wk``/``wv`` column-wise (each rank computes n_heads / N whole heads; the
model's
  attention infers its local head count from the projection's output size), ``wo`` row-wise (its
  all-reduce sums the heads' contributions);
- MLP: ``w_in`` column-wise, ``w_out`` row-wise: one all-reduce per MLP, none between the two
matmuls;
- embeddings row-wise (vocabulary rows split), the output head column-wise (vocabulary columns
split);
- ``--sequence-parallel``: the norms and residual stream are split along the sequence instead of
  replicated (the all-reduces become reduce-scatter + all-gather; activations take 1/N of the
  memory);
- ``--loss-parallel``: the logits stay split over the vocabulary and cross-entropy is computed on
the
  shards (``loss_parallel()``), so the full [batch, seq, vocab] logits never exist on one rank.

Every tensor-parallel rank must see the SAME batch (it computes a part of every sample, not a part
of the batch): the loader here is the single-process one on every rank. The losses and weights equal
single-process training (tests/test_tensor_parallel.py, worlds of 2 and 4); forward outputs and full
gradients equal the unsplit model's. Runs on gloo/CPU (checked with torch 2.13) and NCCL.

Speed: TP alone has no mixed-precision policy of its own, so ``--precision auto`` (bf16 on a GPU) is
autocast around the forward, as torchtitan does; AdamW is fused. Every op on a DTensor pays for
sharding propagation on the host: on one H200 (100m, torch 2.11) a world-1 step ran 129.8 ms
against the bare loop's 67.4 at batch 64. So on a GPU this recipe compiles by default (``--eager``
turns it off): the compiled blocks trace the DTensor ops once. Compiled, a step ran 51.8 ms
against 51.3 for the compiled bare loop at batch 64; at batch 32, 51.1 ms against 112.4 eager
and 27.8 for the compiled bare loop: the replicated parts outside the blocks (embeddings, norm,
output head) still pay DTensor's host cost (scripts/bench.py, 2026-11-26).

Length: about 400 lines, over the cookbook's ~300, because a user copies more than
``apply_tp``: two ready-made plans (the cookbook's model, a Llama-style model) and the checks that
make a wrong plan fail loudly (``check_tp_plan``, ``check_heads_divide``, ``check_tp_fits``,
``check_ties_split_alike``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

from recipes.core.cli import run_cli
from recipes.core.config import CompileOption, RecipeError, TrainConfig, opt
from recipes.core.log import get_logger
from recipes.core.memory import model_state_bytes
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import full_state_on_rank0
from recipes.core.speed import (apply_compile, compile_loss, autocast, make_adamw, make_grad_scaler,
                                setup_precision)
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    Block,
    ModelConfig,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.world import join_world

log = get_logger(__name__)


@dataclass
class TPConfig(CompileOption, TrainConfig):
    sequence_parallel: bool = opt(
        False, "split norms and the residual stream along the sequence (Shard(1)) instead of "
        "replicating them")
    loss_parallel: bool = opt(
        False, "keep the logits split over the vocabulary and compute cross-entropy on the shards "
        "(loss_parallel())")
    eager: bool = opt(
        False, "on a GPU, skip the torch.compile that TP turns on there (DTensor's sharding "
        "propagation then runs on the host for every op: about 2x slower on an H200)")


def check_tp_fits(model_cfg: ModelConfig, tp_size: int) -> None:
    """RecipeError unless every split dimension divides by ``tp_size``: heads, MLP width,
    vocabulary and sequence (the position embedding's rows). DTensor could shard unevenly; equal
    shards keep it simple."""
    sizes = {"n_heads": model_cfg.n_heads, "mlp width": model_cfg.mlp_ratio * model_cfg.dim,
             "vocab_size": model_cfg.vocab_size, "seq_len": model_cfg.seq_len}
    bad = [f"{name}={size}" for name, size in sizes.items() if size % tp_size]
    if bad:
        fits = [n for n in range(1, model_cfg.n_heads + 1)
                if all(size % n == 0 for size in sizes.values())]
        raise RecipeError(f"tensor parallel over {tp_size} ranks cannot split {', '.join(bad)}; "
                          f"use a tensor-parallel size of {', '.join(map(str, fits))}")


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
            return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                         if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
                         for t in inputs)

        def local_output(_module, output, _mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, input_fn=replicated_inputs,
                                 output_fn=local_output)


def matching_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """The submodules whose dotted path matches ``pattern`` name by name, ``*`` matching any one
    name: how ``parallelize_module`` resolves a plan key (``"layers.*.attn.wq"``)."""
    atoms = pattern.split(".")
    return [(name, module) for name, module in model.named_modules()
            if name and len(name.split(".")) == len(atoms)
            and all(fnmatch.fnmatchcase(part, atom) for part, atom in zip(name.split("."), atoms))]


def check_tp_plan(model: nn.Module, plan: Mapping[str, ParallelStyle], tp_size: int) -> None:
    """TPPlanError unless every plan key names modules of ``model`` that its style can split evenly.

    ``parallelize_module`` itself only warns about a key that matches nothing and skips it: the
    model would silently stay replicated where the plan says split.
    """
    for pattern, style in plan.items():
        found = matching_modules(model, pattern)
        if not found:
            paths = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", name)
                            for name, _ in model.named_modules()})
            raise TPPlanError(
                f"TP plan key {pattern!r} matches no module of {type(model).__name__}; its modules "
                f"are: {', '.join(p for p in paths if p)}")
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        for name, module in found:
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise TPPlanError(
                    f"{type(style).__name__} splits nn.Linear and nn.Embedding only; {name} is a "
                    f"{type(module).__name__}: leave it out of the plan (or replicate it)")
            # The split dimension: Linear weights are [out, in], Embedding weights [rows, dim].
            colwise = isinstance(style, ColwiseParallel)
            size = module.weight.shape[0 if colwise == isinstance(module, nn.Linear) else 1]
            if size % tp_size:
                raise TPPlanError(
                    f"{type(style).__name__} on {name} splits a dimension of {size} over {tp_size} "
                    f"ranks; use a tensor-parallel size that divides {size}")


def check_heads_divide(tp_size: int, *, n_heads: int, n_kv_heads: int | None = None) -> None:
    """TPPlanError unless every rank gets whole attention heads (column-wise q/k/v split them)."""
    for what, count in (("attention heads", n_heads), ("key/value heads", n_kv_heads)):
        if count is not None and count % tp_size:
            fits = [n for n in range(1, count + 1) if count % n == 0]
            raise TPPlanError(f"{count} {what} do not split over {tp_size} tensor-parallel ranks; "
                              f"use a tensor-parallel size of {', '.join(map(str, fits))}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *,
             plan: Mapping[str, ParallelStyle]) -> nn.Module:
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
    styles = [style for pattern, style in plan.items()
              if any(name == path for name, _ in matching_modules(model, pattern))]
    if not styles:
        return "kept whole"
    module, style = model.get_submodule(path), styles[-1]
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        colwise = isinstance(style, ColwiseParallel)  # the dimension as in check_tp_plan
        return f"Shard({0 if colwise == isinstance(module, nn.Linear) else 1})"
    return type(style).__name__


def check_ties_split_alike(model: nn.Module, plan: Mapping[str, ParallelStyle],
                           tied: list[list[tuple[str, str]]]) -> None:
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
                "ColwiseParallel on the head: both Shard(0)) or untie them in the model")


def retie(model: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """Make each tied weight's holders share one (split) parameter again, after the split."""
    for (first_path, first_name), *others in tied:
        shared = getattr(model.get_submodule(first_path), first_name)
        for path, name in others:
            module = model.get_submodule(path)
            mine = getattr(module, name)
            placements = [getattr(p, "placements", None) for p in (shared, mine)]
            if placements[0] != placements[1]:  # a custom style the check could not foresee
                raise TPPlanError(f"apply_tp split the weight that {first_path} and {path} share "
                                  f"as {placements[0]} and {placements[1]}; give them one split")
            module.register_parameter(name, shared)


def transformer_lm_plan(*, sequence_parallel: bool = False,
                        loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The Megatron-LM split of the cookbook's TransformerLM (recipes/core/workload.py)."""
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
            input_layouts=Replicate(),
            output_layouts=Shard(0) if sequence_parallel else Replicate()),
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
        "output": ColwiseParallel(input_layouts=residual,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        plan.update({
            # LayerNorm normalizes over dim, so it runs on sequence shards unchanged...
            "layers.*.attn_norm": SequenceParallel(),
            "layers.*.mlp_norm": SequenceParallel(),
            "norm": SequenceParallel(),
            # ...but attention and the MLP need whole sequences: all-gather them on the way in.
            # Pitfall: without these, q/k/v see a sequence shard and attention is silently wrong.
            "layers.*.attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),)),
            "layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
        })
    else:  # replicated norms, whose parameters still become DTensors
        plan.update({name: ReplicateParallel()
                     for name in ("layers.*.attn_norm", "layers.*.mlp_norm", "norm")})
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
    plan.update({name: ReplicateParallel() for name in (
        "model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm")})
    return plan
# --8<-- [end:apply_tp]


def as_float(value: torch.Tensor) -> float:
    """A scalar that may be a (replicated) DTensor, e.g. the loss under loss_parallel()."""
    return float((value.full_tensor() if isinstance(value, DTensor) else value).item())


# --8<-- [start:train]
def train(cfg: TPConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        model_cfg = MODEL_PRESETS[cfg.model]
        check_tp_fits(model_cfg, world.world_size)
        tp_mesh = init_device_mesh(world.device.type, (world.world_size,), mesh_dim_names=("tp",))
        # Same seed everywhere: each rank builds the full model, then keeps only its shards. (For a
        # model that does not fit one device, build on the "meta" device and initialize after
        # apply_tp.)
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        params_unsplit_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        plan = transformer_lm_plan(sequence_parallel=cfg.sequence_parallel,
                                   loss_parallel=cfg.loss_parallel)
        apply_tp(model, tp_mesh, plan=plan)
        # On a GPU TP compiles unless told not to: in eager mode DTensor decides every op's
        # sharding on the host, and the GPU waits for it (+92% at batch 64 on an H200, issue 25).
        compiled = cfg.compile or (world.device.type == "cuda" and not cfg.eager)
        if compiled:  # after TP: the compiled blocks trace the DTensor ops and their collectives
            apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
        # the loss on DTensor shards (loss_parallel) stays eager
        loss_fn = (compile_loss(lm_loss, backend=cfg.compile_backend)
                   if compiled and not cfg.loss_parallel else lm_loss)
        # TP alone has no mixed-precision policy of its own: bf16 is autocast (as torchtitan does).
        precision = setup_precision(cfg.precision, world.device)
        # Built after apply_tp: it must see the DTensors.
        optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=world.device)
        scaler = make_grad_scaler(world.device, precision)
        # Pitfall: a DistributedSampler over the TP ranks would give each rank different samples,
        # and each rank would compute its slice of a different batch. Every TP rank reads the whole
        # batch.
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=0, world_size=1,
                                             per_rank_batch_size=cfg.global_batch_size,
                                             seed=cfg.seed)
        # The loss and its backward must both run inside loss_parallel() when the logits are shards.
        loss_context = loss_parallel if cfg.loss_parallel else contextlib.nullcontext
        log.info("tensor parallel over %d rank(s), backend %s, sequence_parallel=%s, "
                 "loss_parallel=%s",
                 world.world_size, world.backend, cfg.sequence_parallel, cfg.loss_parallel)

        losses, timer = [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                inputs, targets = inputs.to(world.device), targets.to(world.device)
                with autocast(world.device, precision):
                    logits = model(inputs)
                optimizer.zero_grad(set_to_none=True)
                with loss_context():
                    loss = loss_fn(logits, targets)  # the cross entropy in fp32 either way
                    scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                if step == 0:
                    state_bytes = model_state_bytes(model, optimizer)  # gradients still present
            # The same on every rank: they all computed the whole batch.
            losses.append(as_float(loss))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        full_state, checksum = full_state_on_rank0(model)  # every rank joins the all-gathers
        return make_result(
            "tensor_parallel", world, losses, checksum, timer,
            keep_final_state=full_state if cfg.keep_final_state and world.is_main else None,
            workload=Workload(model_cfg, cfg.global_batch_size, precision),
            tp_size=world.world_size, sequence_parallel=cfg.sequence_parallel,
            loss_parallel=cfg.loss_parallel, compiled=compiled,
            param_bytes_per_rank=state_bytes["param_bytes"],
            param_bytes_unsplit=params_unsplit_bytes,
            param_fraction_per_rank=state_bytes["param_bytes"] / params_unsplit_bytes,
            optimizer_bytes_per_rank=state_bytes["optimizer_bytes"],
        )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, TPConfig, __doc__)
