"""Tiny Hugging Face models, built from a config (no download), that the apply_* functions take.

GPT-2 ties its output layer to the token embedding and fuses q/k/v into one ``Conv1D``; Llama is
close to what people train today (RMSNorm, rotary positions, SwiGLU, grouped key/value heads).
``transformers`` is in the test extra; on a machine without it these tests skip with that reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip(
    "transformers", reason="the third-party model tests need transformers"
)

VOCAB, SEQ = 128, 16
KINDS = ["gpt2", "llama"]
# The tiny shapes (dropout off), shared with tests/test_job_your_model.py's config.json folders.
GPT2_SHAPE = dict(
    n_layer=2, n_embd=64, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)
LLAMA_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def build(
    kind: str,
    *,
    seed: int = 0,
    attn_implementation: str = "eager",
    tie_word_embeddings: bool = False,
) -> nn.Module:
    """The same weights for the same seed, in fp32, dropout off (so that runs compare exactly).

    eager attention: the same kernel in every process, and the one DTensor runs under TP. A
    pipeline stage passes no attention mask, and eager attention is causal only with one: "sdpa".
    ``tie_word_embeddings``: Llama's head shares the embedding's weight, as many small Llamas ship.
    """
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            **GPT2_SHAPE,
            vocab_size=VOCAB,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation=attn_implementation,
        )
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(
            **LLAMA_SHAPE,
            vocab_size=VOCAB,
            attn_implementation=attn_implementation,
            tie_word_embeddings=tie_word_embeddings,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown model kind {kind!r}; valid: {', '.join(KINDS)}")
    model.config.use_cache = False
    return model.float().train()


def build_t5(*, seed: int = 0, use_cache: bool = True) -> nn.Module:
    """A tiny T5 encoder-decoder. Pitfall: its decoder keeps a copy of the config, so setting
    ``model.config.use_cache = False`` afterwards does not reach it; ``use_cache`` here does."""
    torch.manual_seed(seed)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=use_cache,
    )
    return transformers.T5ForConditionalGeneration(config).float().train()


def block_types(kind: str) -> tuple[type[nn.Module], ...]:
    """The repeated block class: what the user passes to apply_fully_shard, apply_fsdp, AC..."""
    if kind == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return (GPT2Block,)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return (LlamaDecoderLayer,)


def batch(step: int, global_batch_size: int = 4) -> torch.Tensor:
    """Token ids [global_batch_size, SEQ + 1] for step ``step``, the same in every process."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (global_batch_size, SEQ + 1), generator=generator)
