"""Hugging Face checkpoints in and out of a fully_shard run, each rank reading only its own shards.

    torchrun --standalone --nproc_per_node=2 -m recipes.hf_checkpoint
    python -m recipes.hf_checkpoint --model llama --max-file-bytes 100000   # a world of 1
    torchrun --standalone --nproc_per_node=2 -m recipes.hf_checkpoint --hf-dir my_model/  # yours

In: a directory that ``save_pretrained`` wrote (``config.json``, ``model.safetensors`` or several
files with ``model.safetensors.index.json``) goes into a sharded model without ever being whole on
one rank: the model is built on ``meta`` and sharded (recipes/meta_init.py), and each rank reads the
rows of its shards straight from the files (safetensors reads slices from a memory map). Out: the
DCP checkpoint of a fully_shard run becomes such a directory again, which
``AutoModelForCausalLM.from_pretrained(dir)`` loads and which gives the trained model's logits.

Both directions use torch's DCP Hugging Face storage where the installed torch has one that reads
slices (``torch.distributed.checkpoint.HuggingFaceStorageReader/Writer``; its early versions
deserialised every whole file on every rank): ``dcp.load``/``dcp.save`` plan what each rank reads
and writes, the writer saves each rank's shards and rank 0 consolidates them into full files.
Otherwise (``--reader safetensors``, or an older torch) the load reads each shard with safetensors'
``get_slice`` itself, and the export gathers the state on rank 0's host memory and writes it there.

Tied weights: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``. ``save_pretrained`` writes
one name; ``from_pretrained`` ties the other back. Here the names of one parameter are found with
``named_parameters(remove_duplicate=False)``: the load accepts a file without the alias, and the
export writes the first name only, as ``save_pretrained`` does. A file whose names do not match the
model's is refused before anything is read, in one line naming the missing and unexpected keys.

Length: about 335 lines, over the cookbook's ~300: a user's folder is checked before any rank reads
it (a file in its place, a config.json that is not one, a missing or truncated safetensors file),
so that bad input is one line naming the file, not a crash on one rank and a hang on the others.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from recipes.core.cli import run_cli
from recipes.core.config import Config, RecipeError, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.paths import input_dir_problem, output_dir_problem, refuse
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import all_ranks, mean_over_ranks
from recipes.core.workload import (
    SyntheticTokens,
    distributed_loader,
    iterate_steps,
    lm_loss,
)
from recipes.core.world import join_world
from recipes.parallelize import build_sharded_on_meta, local_slices

log = get_logger(__name__)
INDEX, SEQ_LEN = "model.safetensors.index.json", 16


@dataclass
class HFCheckpointConfig(Config):
    model: Literal["gpt2", "llama"] = opt("gpt2", "tiny model built when --hf-dir is ''")
    hf_dir: str = opt("", "a save_pretrained directory to start from; '' = write a tiny one first")
    out_dir: str = opt("checkpoints/hf_checkpoint", "dcp/ (the run's checkpoint) and hf/ go here")
    steps: int = opt(3, "fully_shard training steps between the load and the export", ge=0)
    global_batch_size: int = opt(4, "sequences per step, summed over ranks", ge=1)
    lr: float = opt(1e-3, "AdamW learning rate", gt=0)
    seed: int = opt(0, "seed of the tiny model and the data", ge=0)
    max_file_bytes: int = opt(0, "export into files of at most this many bytes, with an index "
                                 "(0 = one model.safetensors)", ge=0)
    reader: Literal["auto", "torch", "safetensors"] = opt(
        "auto", "auto = torch's HuggingFaceStorageReader/Writer where it reads slices; "
        "safetensors = read each shard with get_slice, export from rank 0")
    backend: Literal["auto", "gloo", "nccl"] = opt("auto", "process-group backend")
    timeout_s: float = opt(300.0, "collective timeout in seconds", gt=0)


def tiny_config(name: str):
    """The tiny GPT-2 (tied, fused qkv Conv1D) and Llama (GQA, rotary) the tests use."""
    from transformers import GPT2Config, LlamaConfig

    if name == "gpt2":
        # No dropout: the tests compare the sharded run with one process, step by step.
        return GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, attn_implementation="eager")
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       attn_implementation="eager")


def block_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The repeated decoder layer classes, as Hugging Face names them (``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def aliases(model: nn.Module) -> dict[str, str]:
    """{second name: first name} for every parameter reachable under two names (tied weights)."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    return {name: first[id(param)] for name, param in model.named_parameters(
        remove_duplicate=False) if first[id(param)] != name}


# --8<-- [start:files]
def safetensors_files(hf_dir: str) -> dict[str, str]:
    """{tensor name: file} from the index, or from the one ``model.safetensors``. Every file's
    header is read: a missing or truncated file is named now, not as a rank's crash in the load."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(hf_dir, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RecipeError(f"{index} is not an index save_pretrained writes ({exc!r}); "
                              "save the model again, or remove the index") from None
        files = {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
    else:
        single = os.path.join(hf_dir, "model.safetensors")
        if not os.path.exists(single):
            raise RecipeError(f"no model.safetensors or {INDEX} in {hf_dir!r}; pass a directory "
                              "that save_pretrained wrote")
        files = {}
    names = {}
    for path in sorted(set(files.values())) or [single]:
        if not os.path.isfile(path):
            raise RecipeError(f"{INDEX} in {hf_dir!r} names {os.path.basename(path)}, which is "
                              "missing; copy every file the index lists")
        try:
            with safe_open(path, framework="pt") as f:
                names[path] = list(f.keys())
        except (OSError, SafetensorError) as exc:
            raise RecipeError(f"{path} is not a readable safetensors file ({exc}); it may be "
                              "truncated: save or download it again") from None
    return files or dict.fromkeys(names[single], single)


def check_hf_dir(hf_dir: str) -> None:
    problem = input_dir_problem(hf_dir, "--hf-dir", "the directory save_pretrained wrote")
    if problem:
        raise RecipeError(problem)
    config = os.path.join(hf_dir, "config.json")
    if not os.path.exists(config):
        raise RecipeError(f"no config.json in {hf_dir!r}; pass a save_pretrained directory")
    try:
        with open(config) as f:
            json.load(f)
        from transformers import AutoConfig
        AutoConfig.from_pretrained(hf_dir)
    except (OSError, ValueError, KeyError) as exc:  # not JSON; JSON that names no known model
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipeError(f"{config} is not a model config ({first_line}); save it again with "
                          "model.config.save_pretrained") from None
    safetensors_files(hf_dir)


def check_keys(model: nn.Module, names: set[str], where: str) -> None:
    """One line naming the keys that do not match, before anything is read."""
    expected = set(get_model_state_dict(model)) - set(aliases(model))
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing or unexpected:
        raise RecipeError(
            f"{where} does not match {type(model).__name__}: missing keys {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, unexpected keys {unexpected[:4]}"
            f"{' ...' if len(unexpected) > 4 else ''}; pass the checkpoint of this architecture")
# --8<-- [end:files]


def torch_hf_storage() -> bool:
    """torch's HF reader/writer, in the versions that read slices and consolidate shards (the
    first ones read whole files on every rank and took other arguments)."""
    import inspect
    reader, writer = (getattr(dcp, f"HuggingFaceStorage{k}", None) for k in ("Reader", "Writer"))
    return (reader is not None and hasattr(reader, "_process_read_request") and writer is not None
            and "enable_consolidation" in inspect.signature(writer).parameters)


# --8<-- [start:load]
@torch.no_grad()
def load_hf_sharded(model: nn.Module, hf_dir: str, *, reader: str = "auto") -> None:
    """Fill a sharded (fully_shard, materialised) model from a save_pretrained directory."""
    files = safetensors_files(hf_dir)
    check_keys(model, set(files), hf_dir)
    state = {k: v for k, v in get_model_state_dict(model).items() if k not in aliases(model)}
    if reader != "safetensors" and torch_hf_storage():
        # DCP plans each rank's reads from the DTensors' shards; the reader copies slices in place.
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(hf_dir))
    else:
        from safetensors import safe_open

        for name, param in state.items():
            with safe_open(files[name], framework="pt") as f:
                rows = f.get_slice(name)[local_slices(param)]  # reads only this rank's rows
            param.to_local().copy_(rows)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
# --8<-- [end:load]


# --8<-- [start:export]
def export_hf(model: nn.Module, out_dir: str, *, max_file_bytes: int = 0,
              reader: str = "auto") -> list[str]:
    """Write a sharded model as ``from_pretrained`` reads it, into an empty ``out_dir``; returns
    the files written (files left there by an earlier export would mix with them)."""
    state = {k: v for k, v in get_model_state_dict(model).items() if k not in aliases(model)}
    index, size, file_of = 1, 0, {}  # greedy split into files, in the model's order
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_file_bytes and size and size + nbytes > max_file_bytes:
            index, size = index + 1, 0
        file_of[name], size = index, size + nbytes
    rank = dist.get_rank()
    if reader != "safetensors" and torch_hf_storage():
        # Every rank writes its shards under out_dir/sharded; rank 0 then joins them into files.
        writer = dcp.HuggingFaceStorageWriter(out_dir, fqn_to_index_mapping=file_of,
                                              save_distributed=True, enable_consolidation=True)
        dcp.save(state, storage_writer=writer)
    else:  # rank 0 gathers the full state into host memory, then writes it
        from safetensors.torch import save_file

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            for i in range(1, index + 1):
                part = {k: full[k].contiguous() for k in state if file_of[k] == i}
                save_file(part, os.path.join(out_dir, f"model-{i:05d}-of-{index:05d}.safetensors"),
                          metadata={"format": "pt"})
            weight_map = {k: f"model-{file_of[k]:05d}-of-{index:05d}.safetensors" for k in state}
            with open(os.path.join(out_dir, INDEX), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    if rank == 0:
        shutil.rmtree(os.path.join(out_dir, "sharded"), ignore_errors=True)
        if index == 1:  # one file: the name from_pretrained looks for first, no index
            os.replace(os.path.join(out_dir, "model-00001-of-00001.safetensors"),
                       os.path.join(out_dir, "model.safetensors"))
            os.remove(os.path.join(out_dir, INDEX))
        model.config.save_pretrained(out_dir)
    dist.barrier()
    return sorted(os.listdir(out_dir))
# --8<-- [end:export]


def build_hf_sharded(hf_config, mesh, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    def make() -> nn.Module:
        return AutoModelForCausalLM.from_config(hf_config)
    with torch.device("meta"):
        blocks = block_types(make())
    model = build_sharded_on_meta(make, mesh, block_types=blocks, device=device)
    for module in model.modules():  # to_empty left buffers uninitialised: recompute them (rotary)
        if any(True for _ in module.buffers(recurse=False)):
            model._init_weights(module)
    return model


# --8<-- [start:run]
def run(cfg: HFCheckpointConfig) -> RecipeResult:
    if cfg.hf_dir:  # bad input fails here, before a world is started
        check_hf_dir(cfg.hf_dir)
    from transformers import AutoConfig, AutoModelForCausalLM

    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        per_rank = per_rank_batch_size(cfg.global_batch_size, world.world_size)
        # Every rank writes under --out-dir (its DCP shards): each looks, all stop together.
        refuse(*(output_dir_problem(path, "--out-dir") for path in (
            cfg.out_dir, *(os.path.join(cfg.out_dir, sub) for sub in ("initial", "dcp", "hf")))))
        hf_dir = cfg.hf_dir or os.path.join(cfg.out_dir, "initial")
        if not cfg.hf_dir and world.is_main:  # a from_pretrained-style start, as users have one
            torch.manual_seed(cfg.seed)
            AutoModelForCausalLM.from_config(tiny_config(cfg.model)).save_pretrained(hf_dir)
        dist.barrier()
        hf_config = AutoConfig.from_pretrained(hf_dir)
        mesh = init_device_mesh(world.device.type, (world.world_size,), mesh_dim_names=("shard",))
        model = build_hf_sharded(hf_config, mesh, world.device)
        load_hf_sharded(model, hf_dir, reader=cfg.reader)

        data = SyntheticTokens(cfg.global_batch_size * 4, SEQ_LEN, hf_config.vocab_size, cfg.seed)
        loader, sampler = distributed_loader(data, rank=world.rank, world_size=world.world_size,
                                             per_rank_batch_size=per_rank, seed=cfg.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        losses, timer = [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                loss = lm_loss(model(inputs.to(world.device)).logits, targets.to(world.device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            losses.append(mean_over_ranks(loss))
            log.info("step %d loss %.4f", step, losses[-1])
        # The run's own checkpoint (every rank writes its shards), then a fresh sharded model
        # loads it and exports it: the path from any fully_shard checkpoint to Hugging Face.
        dcp_dir, out = os.path.join(cfg.out_dir, "dcp"), os.path.join(cfg.out_dir, "hf")
        if world.is_main:  # this recipe's own export directory: a rerun starts it afresh
            shutil.rmtree(out, ignore_errors=True)
        dcp.save(get_model_state_dict(model), checkpoint_id=dcp_dir)
        exported = build_hf_sharded(hf_config, mesh, world.device)
        dcp.load(state := get_model_state_dict(exported), checkpoint_id=dcp_dir)
        set_model_state_dict(exported, state)
        files = export_hf(exported, out, max_file_bytes=cfg.max_file_bytes, reader=cfg.reader)
        # Before the probe's forward: the root keeps its parameters unsharded after one.
        local = sum(p.to_local().double().sum().item() for p in model.parameters())
        checksum = torch.tensor([local], dtype=torch.float64, device=world.device)
        dist.all_reduce(checksum)
        shard_bytes = sum(p.to_local().nbytes for p in model.parameters())
        probe = data.tokens[:2, :-1].to(world.device)
        model.eval()  # as from_pretrained returns it: dropout off
        with torch.no_grad():
            trained = model(probe).logits.float().cpu()
        difference = float("nan")  # rank 0 measures it
        if world.is_main:  # the check a user would do: from_pretrained gives the same logits
            reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
            with torch.no_grad():
                difference = (reloaded(probe.cpu()).logits - trained).abs().max().item()
        return make_result("hf_checkpoint", world, losses, float(checksum.item()), timer,
                           files=files, export_logits_max_abs_diff=difference,
                           torch_hf_storage=cfg.reader != "safetensors" and torch_hf_storage(),
                           param_bytes_per_rank=all_ranks(shard_bytes))
# --8<-- [end:run]


if __name__ == "__main__":
    run_cli(run, HFCheckpointConfig, __doc__)
