"""Hugging Face checkpoints in and out of a fully_shard run, each rank reading only its own shards.

    torchrun --standalone --nproc_per_node=2 -m recipes.hf_checkpoint
    python -m recipes.hf_checkpoint --model llama --max-file-bytes 100000   # a world of 1
    torchrun --standalone --nproc_per_node=2 -m recipes.hf_checkpoint --hf-dir my_model/  # yours

Copy with it: recipes/toy.py (the data you replace), recipes/dist_setup.py (join and leave the
world), recipes/parallelize.py (``build_sharded_on_meta``, ``local_slices``), recipes/options.py
(the command line, from the config).

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

``train`` prints one line per step from rank 0 and, after the export, how far the logits of
``from_pretrained(out_dir/hf)`` are from the trained model's; it returns an ``HFCheckpointRun``:
the global loss of each step, the files exported, that difference and which reader ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field

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
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import build_sharded_on_meta, local_slices
from recipes.toy import SyntheticTokens, lm_loss

INDEX, SEQ_LEN = "model.safetensors.index.json", 16


class HFCheckpointError(ValueError):
    """A folder or file that cannot be used, in one line that names it and the fix."""


@dataclass
class HFCheckpointConfig:
    model: str = option(
        "gpt2", "the tiny model written first when --hf-dir is ''", choices=["gpt2", "llama"]
    )
    hf_dir: str = option(
        "", "a save_pretrained directory to start from; '' = write a tiny one first"
    )
    out_dir: str = option(
        "checkpoints/hf_checkpoint",
        "initial/ (the tiny model), dcp/ (the run's checkpoint) and hf/ go here",
    )
    steps: int = option(3, "fully_shard training steps between the load and the export", at_least=0)
    global_batch_size: int = option(4, "sequences per step, summed over all ranks", at_least=1)
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    seed: int = option(0, "seed of the tiny model and of the data", at_least=0)
    max_file_bytes: int = option(
        0,
        "export into files of at most this many bytes, with an index (0 = one model.safetensors)",
        at_least=0,
    )
    reader: str = option(
        "auto",
        "auto = torch's HuggingFaceStorageReader/Writer where it reads slices; safetensors "
        "= read each shard with get_slice, export from rank 0",
        choices=["auto", "torch", "safetensors"],
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.hf_dir:
            given = os.path.realpath(self.hf_dir)
            for sub in ("hf", "dcp"):  # the run deletes hf/ and writes dcp/: never the input
                written = os.path.realpath(os.path.join(self.out_dir, sub))
                if given == written or given.startswith(written + os.sep):
                    raise HFCheckpointError(
                        f"hf_dir {self.hf_dir} is inside out_dir's {sub}/, which this run "
                        "overwrites; copy the model elsewhere or use another --out-dir"
                    )
            check_hf_dir(self.hf_dir)  # a file as the folder, a config that does not parse, ...
        check_out_dir(self.out_dir)


@dataclass
class HFCheckpointRun:
    losses: list[float]  # the global batch's loss of each step
    files: list[str] = field(default_factory=list)  # what the export wrote into out_dir/hf
    export_logits_max_abs_diff: float = math.nan  # from_pretrained(hf/) vs the trained model
    torch_hf_storage: bool = False  # torch's HF reader/writer ran (else get_slice, rank 0)


def tiny_config(name: str):
    """The tiny GPT-2 (tied, fused qkv Conv1D) and Llama (GQA, rotary) the tests use."""
    from transformers import GPT2Config, LlamaConfig

    if name == "gpt2":
        # No dropout: the tests compare the sharded run with one process, step by step.
        return GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=128,
            n_positions=32,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
            attn_implementation="eager",
        )
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )


def block_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The repeated decoder layer classes, as Hugging Face names them (``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def aliases(model: nn.Module) -> dict[str, str]:
    """{second name: first name} for every parameter reachable under two names (tied weights)."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    return {
        name: first[id(param)]
        for name, param in model.named_parameters(remove_duplicate=False)
        if first[id(param)] != name
    }


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
            raise HFCheckpointError(
                f"{index} is not an index save_pretrained writes ({exc!r}); "
                "save the model again, or remove the index"
            ) from None
        files = {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
    else:
        single = os.path.join(hf_dir, "model.safetensors")
        if not os.path.exists(single):
            raise HFCheckpointError(
                f"no model.safetensors or {INDEX} in {hf_dir!r}; pass a "
                "directory that save_pretrained wrote"
            )
        files = {}
    names = {}
    for path in sorted(set(files.values())) or [single]:
        if not os.path.isfile(path):
            raise HFCheckpointError(
                f"{INDEX} in {hf_dir!r} names {os.path.basename(path)}, "
                "which is missing; copy every file the index lists"
            )
        try:
            with safe_open(path, framework="pt") as f:
                names[path] = list(f.keys())
        except (OSError, SafetensorError) as exc:
            raise HFCheckpointError(
                f"{path} is not a readable safetensors file ({exc}); it may "
                "be truncated: save or download it again"
            ) from None
    return files or dict.fromkeys(names[single], single)


def check_hf_dir(hf_dir: str) -> None:
    """Every way a user's folder can be wrong, in one line naming the file, before any rank reads
    it: otherwise one rank crashes inside the load while the others wait for it."""
    what = "pass the directory save_pretrained wrote"
    if not os.path.exists(hf_dir):
        raise HFCheckpointError(f"--hf-dir {hf_dir} does not exist; {what}")
    if not os.path.isdir(hf_dir):
        raise HFCheckpointError(f"--hf-dir {hf_dir} is a file, not a directory; {what}")
    if not os.access(hf_dir, os.R_OK | os.X_OK):
        raise HFCheckpointError(f"--hf-dir {hf_dir} cannot be read by this user; {what}")
    config = os.path.join(hf_dir, "config.json")
    if not os.path.exists(config):
        raise HFCheckpointError(f"no config.json in {hf_dir!r}; pass a save_pretrained directory")
    try:
        with open(config) as f:
            json.load(f)
        from transformers import AutoConfig

        AutoConfig.from_pretrained(hf_dir)
    except (OSError, ValueError, KeyError) as exc:  # not JSON; JSON that names no known model
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HFCheckpointError(
            f"{config} is not a model config ({first_line}); save it again "
            "with model.config.save_pretrained"
        ) from None
    safetensors_files(hf_dir)


def check_keys(model: nn.Module, names: set[str], where: str) -> None:
    """One line naming the keys that do not match, before anything is read."""
    expected = set(get_model_state_dict(model)) - set(aliases(model))
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing or unexpected:
        raise HFCheckpointError(
            f"{where} does not match {type(model).__name__}: missing keys {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, unexpected keys {unexpected[:4]}"
            f"{' ...' if len(unexpected) > 4 else ''}; pass the checkpoint of this architecture"
        )


# --8<-- [end:files]


def torch_hf_storage() -> bool:
    """torch's HF reader/writer, in the versions that read slices and consolidate shards (the
    first ones read whole files on every rank and took other arguments)."""
    import inspect

    reader, writer = (getattr(dcp, f"HuggingFaceStorage{k}", None) for k in ("Reader", "Writer"))
    return (
        reader is not None
        and hasattr(reader, "_process_read_request")
        and writer is not None
        and "enable_consolidation" in inspect.signature(writer).parameters
    )


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
def export_hf(
    model: nn.Module, out_dir: str, *, max_file_bytes: int = 0, reader: str = "auto"
) -> list[str]:
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
        writer = dcp.HuggingFaceStorageWriter(
            out_dir, fqn_to_index_mapping=file_of, save_distributed=True, enable_consolidation=True
        )
        dcp.save(state, storage_writer=writer)
    else:  # rank 0 gathers the full state into host memory, then writes it
        from safetensors.torch import save_file

        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            for i in range(1, index + 1):
                part = {k: full[k].contiguous() for k in state if file_of[k] == i}
                save_file(
                    part,
                    os.path.join(out_dir, f"model-{i:05d}-of-{index:05d}.safetensors"),
                    metadata={"format": "pt"},
                )
            weight_map = {k: f"model-{file_of[k]:05d}-of-{index:05d}.safetensors" for k in state}
            with open(os.path.join(out_dir, INDEX), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    if rank == 0:
        shutil.rmtree(os.path.join(out_dir, "sharded"), ignore_errors=True)
        if index == 1:  # one file: the name from_pretrained looks for first, no index
            os.replace(
                os.path.join(out_dir, "model-00001-of-00001.safetensors"),
                os.path.join(out_dir, "model.safetensors"),
            )
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


def check_out_dir(out_dir: str) -> None:
    """Every rank writes under ``out_dir`` (its DCP shards): a file in the way, or a folder that
    cannot be written, fails now, on every rank alike, not in ``makedirs`` after training."""
    for path in (out_dir, *(os.path.join(out_dir, sub) for sub in ("initial", "dcp", "hf"))):
        if os.path.exists(path) and not os.path.isdir(path):
            raise HFCheckpointError(
                f"--out-dir {path} is a file; name a directory (created if missing)"
            )
    existing = os.path.abspath(out_dir)
    while not os.path.exists(existing):  # what makedirs would create goes in here
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise HFCheckpointError(
            f"--out-dir {out_dir}: {existing} is a file, so nothing can be "
            "created under it; name a directory you can write to"
        )
    try:  # tried, not read off the mode bits, which say nothing to root or a read-only mount
        with tempfile.NamedTemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise HFCheckpointError(
            f"--out-dir {out_dir}: cannot write in {existing} "
            f"({exc.strerror or exc}); name a directory you can write to"
        ) from None


# --8<-- [start:train]
def train(cfg: HFCheckpointConfig, observer=None) -> HFCheckpointRun:
    """Load (or write a tiny one first), train sharded, save with DCP, export to Hugging Face."""
    # Checked again before joining (the config checked them when built; files change): every
    # rank sees the same files and refuses at once
    if cfg.hf_dir:
        check_hf_dir(cfg.hf_dir)
    check_out_dir(cfg.out_dir)
    from transformers import AutoConfig, AutoModelForCausalLM

    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        if cfg.global_batch_size % world.world_size:
            raise HFCheckpointError(
                f"global_batch_size={cfg.global_batch_size} does not divide across "
                f"{world.world_size} ranks; use a multiple of {world.world_size}"
            )
        rank, world_size, device = world.rank, world.world_size, world.device
        per_rank_batch = cfg.global_batch_size // world_size
        hf_dir = cfg.hf_dir or os.path.join(cfg.out_dir, "initial")
        if not cfg.hf_dir and rank == 0:  # a from_pretrained-style start, as users have one
            torch.manual_seed(cfg.seed)
            AutoModelForCausalLM.from_config(tiny_config(cfg.model)).save_pretrained(hf_dir)
        dist.barrier()  # nobody reads the folder before rank 0 has written it
        hf_config = AutoConfig.from_pretrained(hf_dir)
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))

        # --8<-- [start:loop]
        # Built on meta and sharded, then each rank reads only its own rows from the files: the
        # model is never whole on one rank (from_pretrained on every rank would make it whole)
        model = build_hf_sharded(hf_config, mesh, device)
        load_hf_sharded(model, hf_dir, reader=cfg.reader)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # over this rank's shards
        if observer:
            observer.model_ready(model, optimizer)

        dataset = SyntheticTokens(
            cfg.global_batch_size * 4, SEQ_LEN, hf_config.vocab_size, seed=cfg.seed
        )  # your tokenized text here
        # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
        # at step s is one process's batch s. drop_last keeps every global batch full.
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True)

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
                loss = lm_loss(model(inputs).logits, targets)  # Hugging Face returns .logits
                loss.backward()  # fully_shard reduce-scatters: each rank keeps its shard's grads
                optimizer.step()  # each rank updates its own shards
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

        # The run's own checkpoint (every rank writes its shards), then a fresh sharded model
        # loads it and exports it: the path from any fully_shard checkpoint to Hugging Face.
        dcp_dir, out = os.path.join(cfg.out_dir, "dcp"), os.path.join(cfg.out_dir, "hf")
        if rank == 0:  # this recipe's own export directory: a rerun starts it afresh
            shutil.rmtree(out, ignore_errors=True)
        dcp.save(get_model_state_dict(model), checkpoint_id=dcp_dir)
        exported = build_hf_sharded(hf_config, mesh, device)
        dcp.load(state := get_model_state_dict(exported), checkpoint_id=dcp_dir)
        set_model_state_dict(exported, state)
        files = export_hf(exported, out, max_file_bytes=cfg.max_file_bytes, reader=cfg.reader)
        # The check a user would do: from_pretrained gives the trained model's logits
        probe = dataset.tokens[:2, :-1].to(device)
        model.eval()  # as from_pretrained returns it: dropout off
        with torch.no_grad():
            trained = model(probe).logits.float().cpu()  # a collective: every rank
        difference = math.nan
        if rank == 0:
            reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
            with torch.no_grad():
                difference = (reloaded(probe.cpu()).logits - trained).abs().max().item()
            print(
                f"exported {', '.join(files)} to {out}; from_pretrained's logits differ from "
                f"the trained model's by at most {difference:.3g}",
                flush=True,
            )
        return HFCheckpointRun(
            losses,
            files,
            difference,
            torch_hf_storage=cfg.reader != "safetensors" and torch_hf_storage(),
        )
    finally:
        cleanup_distributed()


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(HFCheckpointConfig, prog="python -m recipes.hf_checkpoint", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), HFCheckpointConfig, argv)
    with exit_on_bad_input():  # keys that do not match the model: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
