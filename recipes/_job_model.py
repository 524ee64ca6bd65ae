"""The job's model: a toy preset, a Llama-style preset, or your Hugging Face causal LM from a
local folder (``config.json`` from ``save_pretrained``, with or without its weights). Part of
recipes/job.py; copy it with the job.

``transformers`` is imported only when a Hugging Face model is asked for: the toy presets run
without it. Nothing is downloaded: a folder is read with ``local_files_only=True``.

What the job needs of a model, found here so that its loop stays the same for every model:
``block_types`` (what fully_shard, activation checkpointing and compile take: Hugging Face's
``_no_split_modules``, or the class names you give), ``tp_plan`` (``llama_plan`` for Llama,
Mistral and Qwen2, whose module names it checks), ``logits`` (a Hugging Face model returns an
output whose ``.logits`` are the logits) and ``flops_per_token`` (one formula for every model).
Every refusal is a ``ModelError`` (a ValueError) in one line that names the fix.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn as nn

from recipes.parallelize import llama_plan, matching_modules, transformer_lm_plan
from recipes.toy import MODEL_PRESETS, Block, build_model

# --8<-- [start:presets]
# Hugging Face LlamaConfig shapes; the vocabulary comes from the shards. Counted on the meta
# device with the shards' vocabulary of 16384 (tests/test_job_your_model.py checks both):
# llama-100m: 110,119,680 parameters (untied head, as the toy 100m preset);
# llama-1b: 1,006,700,544 (tied head, Llama-3.2-1B's shape: 1.24B there, with its 128k vocabulary).
LLAMA_PRESETS: dict[str, dict] = {
    "llama-100m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500_000.0,
        tie_word_embeddings=True,
    ),
}
PRESETS = [*MODEL_PRESETS, *LLAMA_PRESETS]
# --8<-- [end:presets]

# Model types whose modules carry llama_plan's names (q_proj, ..., gate_proj, up_proj, down_proj).
LLAMA_STYLE = ("llama", "mistral", "qwen2")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class ModelError(ValueError):
    """A model the job cannot train as configured: one line naming the fix."""


def is_toy(name: str) -> bool:
    return name in MODEL_PRESETS


def has_weights(name: str) -> bool:
    return any((Path(name) / file).is_file() for file in WEIGHT_FILES)


def hf_config_dict(name: str) -> dict:
    """A Llama preset's or a folder's config as plain values (config.json: no model built)."""
    if name in LLAMA_PRESETS:
        return {"model_type": "llama", **LLAMA_PRESETS[name]}
    folder = Path(name)
    if not folder.is_dir():
        raise ModelError(
            f"model {name!r} is not a preset ({', '.join(PRESETS)}) and not a folder; name one, "
            "or a folder holding a Hugging Face config.json (save_pretrained's)"
        )
    if not (folder / "config.json").is_file():
        raise ModelError(
            f"model folder {name} holds no config.json; write one with "
            "config.save_pretrained(folder) (or model.save_pretrained for its weights too)"
        )
    try:
        values = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"model folder {name}: config.json is not valid JSON ({exc})") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ModelError(f"model folder {name}: config.json names no model_type; save it again")
    return values


def check_model(name: str, *, seq_len: int, parallelism: str, tp: int) -> None:
    """What the job can check from the config alone (JobConfig.__post_init__ calls it)."""
    if is_toy(name):
        heads, kv_heads = MODEL_PRESETS[name].n_heads, None
    else:
        config = hf_config_dict(name)
        model_type = config["model_type"]
        if name not in LLAMA_PRESETS:
            transformers = import_transformers(name)
            causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            if model_type not in causal:
                raise ModelError(
                    f"model folder {name}: a {model_type} config is not a causal LM "
                    "(AutoModelForCausalLM builds none of it); name a decoder LM's folder"
                )
        positions = config.get("max_position_embeddings", config.get("n_positions"))
        if positions is not None and seq_len > positions:
            raise ModelError(
                f"seq_len={seq_len} is beyond the model's {positions} positions; "
                f"use seq_len {positions} or less"
            )
        if parallelism == "tp_fsdp" and model_type not in LLAMA_STYLE:
            raise ModelError(
                f"tp_fsdp splits Llama-style models ({', '.join(LLAMA_STYLE)}: llama_plan's "
                f"q_proj ... down_proj); a {model_type} model has other modules (GPT-2 fuses q/k/v "
                "into one Conv1D that Colwise/RowwiseParallel cannot split); use fsdp or ddp"
            )
        heads = config.get("num_attention_heads", config.get("n_head"))
        kv_heads = config.get("num_key_value_heads") or heads
    for what, count in (("heads", heads), ("key/value heads", kv_heads)):
        if count and count % tp:
            raise ModelError(
                f"tp={tp} does not divide the model's {count} {what}; pick a divisor of {count}"
            )


def import_transformers(name: str):
    try:
        import transformers
    except ImportError:
        raise ModelError(
            f"model {name} is a Hugging Face model: pip install transformers"
        ) from None
    return transformers


# --8<-- [start:build]
def build(name: str, *, vocab_size: int, seq_len: int, seed: int, device) -> nn.Module:
    """The model in fp32, the same weights on every rank: a toy preset, a Llama preset, or the
    folder's model (its weights if it has them, else initialised from ``seed``)."""
    if is_toy(name):
        model_cfg = dataclasses.replace(MODEL_PRESETS[name], vocab_size=vocab_size, seq_len=seq_len)
        return build_model(model_cfg, seed=seed, device=device)
    transformers = import_transformers(name)
    # sdpa: the fast kernel, and exact here: under tp_fsdp attention runs on local tensors (the
    # q/k/v projections return their head shards), so no DTensor reaches it; the layouts agree
    # to 1e-5 with it (tests/test_job_your_model.py).
    options = dict(dtype=torch.float32, attn_implementation="sdpa")
    if name not in LLAMA_PRESETS and has_weights(name):
        transformers.utils.logging.disable_progress_bar()  # a bar per rank, on every rank's stderr
        model = transformers.AutoModelForCausalLM.from_pretrained(
            name, local_files_only=True, **options
        )
        have = model.get_input_embeddings().num_embeddings
        if vocab_size > have:
            raise ModelError(
                f"the shards' vocabulary of {vocab_size} is larger than the model's {have} "
                "tokens; prepare shards with a vocab_size of at most that"
            )
    else:
        if name in LLAMA_PRESETS:
            config = transformers.LlamaConfig(**LLAMA_PRESETS[name])
        else:
            config = transformers.AutoConfig.from_pretrained(name, local_files_only=True)
        config.vocab_size = vocab_size  # a config alone: the shards' vocabulary
        if getattr(config, "pad_token_id", None) is not None and config.pad_token_id >= vocab_size:
            config.pad_token_id = None  # a token the shards' vocabulary does not have
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                model = transformers.AutoModelForCausalLM.from_config(config, **options)
            except ValueError as exc:  # "Unrecognized configuration class ...": many lines
                raise ModelError(
                    f"model {name}: AutoModelForCausalLM refuses a {config.model_type} config "
                    f"({str(exc).splitlines()[0][:120]}); name a decoder LM's folder"
                ) from None
    model.config.use_cache = False  # a cache per forward is memory, and checkpointing refuses it
    check_causal(model, name)
    return model.float().train().to(device)


# --8<-- [end:build]


@torch.no_grad()
def check_causal(model: nn.Module, name: str) -> None:
    """Refuse a model that sees the future: position 0's logits must not depend on token 1.
    BertConfig builds a BertLMHeadModel under AutoModelForCausalLM, bidirectional unless
    is_decoder=True: next-token training on it would learn to copy the next token."""
    model.eval()
    first = logits(model, torch.tensor([[1, 2]]))[0, 0]
    second = logits(model, torch.tensor([[1, 3]]))[0, 0]
    model.train()
    if not torch.allclose(first, second, rtol=0, atol=1e-6):
        raise ModelError(
            f"model {name}: {type(model).__name__} is not a causal LM (its first position sees "
            "the next token: an encoder; set is_decoder=True if it has one); name a decoder LM"
        )


def logits(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab]: the toy model returns them, a Hugging Face model an output with them."""
    out = model(inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


# --8<-- [start:blocks]
def block_types(model: nn.Module, names: str | None) -> tuple[type[nn.Module], ...]:
    """The repeated block classes: ``names`` (comma-separated class names), else the model's
    ``_no_split_modules`` (Hugging Face's list of what must not be split), else the toy Block."""
    classes = {type(module).__name__: type(module) for module in model.modules()}
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in classes]
        if unknown:
            raise ModelError(
                f"blocks: {', '.join(unknown)} matches no module of {type(model).__name__}; its "
                f"module classes are: {', '.join(sorted(classes))}"
            )
        return tuple(classes[n] for n in wanted)
    found = tuple(
        classes[n] for n in sorted(getattr(model, "_no_split_modules", None) or []) if n in classes
    )
    if found:
        return found
    if any(isinstance(module, Block) for module in model.modules()):
        return (Block,)
    raise ModelError(
        f"{type(model).__name__} names no block classes (_no_split_modules); set blocks to one "
        f"of its module classes: {', '.join(sorted(classes))}"
    )


def tp_plan(model: nn.Module) -> dict:
    """The tensor-parallel plan: ours for the toy model, llama_plan for a Llama-style model
    (every one of its module names checked against the model first)."""
    if any(isinstance(module, Block) for module in model.modules()):
        return transformer_lm_plan()
    plan = llama_plan()
    missing = [key for key in plan if not matching_modules(model, key)]
    if missing:
        raise ModelError(
            f"tp_fsdp uses llama_plan, and {type(model).__name__} has no {', '.join(missing)}; "
            "use fsdp or ddp"
        )
    return plan


# --8<-- [end:blocks]


def flops_per_token(model: nn.Module, seq_len: int) -> int:
    """6 x the matmul parameters (every weight of >= 2 dims outside an embedding: the output head
    counts, tied or not) + 12 x layers x hidden x seq_len for attention, as nanoGPT and torchtitan
    count; from the model itself, for every model alike."""
    matmul = sum(
        param.numel()
        for module in model.modules()
        if not isinstance(module, nn.Embedding)
        for param in module.parameters(recurse=False)
        if param.dim() >= 2
    )
    config = model.config if hasattr(model, "config") else model.cfg
    if hasattr(config, "num_hidden_layers"):  # a Hugging Face config (GPT-2's maps n_layer)
        layers, hidden = config.num_hidden_layers, config.hidden_size
    else:
        layers, hidden = config.n_layers, config.dim
    return 6 * matmul + 12 * layers * hidden * seq_len


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters: a tied weight counts once."""
    return sum(param.numel() for param in model.parameters())
