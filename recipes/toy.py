"""The toy model and data every recipe trains: replace them with yours.

Copy this file with any recipe: it imports torch and nothing else. ``build_model`` makes a small
decoder-only transformer LM (``TransformerLM``, made of ``Block``s) and ``make_dataset`` a
deterministic, learnable token dataset; ``lm_loss`` is next-token cross entropy. In your project
these are your model, your dataset and your loss.

The model is written the way the parallelism recipes need it:

- blocks live in a ``ModuleDict`` keyed "0", "1", ... so that parameter names stay the same when a
  pipeline stage deletes the blocks it does not own;
- attention has separate ``wq``/``wk``/``wv``/``wo`` projections and infers its local head count
  from the projection's output size, so tensor parallelism can split heads across ranks without a
  code change;
- ``forward`` skips the embedding / norm / head a pipeline stage has set to ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = [
    "ModelConfig",
    "MODEL_PRESETS",
    "TransformerLM",
    "Block",
    "build_model",
    "lm_loss",
    "SyntheticTokens",
    "make_dataset",
]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    seq_len: int
    dim: int
    n_layers: int
    n_heads: int
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


MODEL_PRESETS: dict[str, ModelConfig] = {
    # tiny: for tests, a step takes milliseconds on CPU. 4 heads split over 2 or 4 tensor-parallel
    # ranks.
    "tiny": ModelConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4),
    "small": ModelConfig(vocab_size=512, seq_len=64, dim=128, n_layers=4, n_heads=4),
    # 100m: for benchmarks, ~110M parameters (GPT-2-small shaped with a 16k vocabulary).
    "100m": ModelConfig(vocab_size=16384, seq_len=512, dim=768, n_layers=12, n_heads=12),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        # -1: the local head count (fewer under tensor parallel)
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_in = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.w_out = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.dim)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [batch, seq] -> logits [batch, seq, vocab]; a pipeline stage passes hidden
        states through. ``positions``: the tokens' places in the whole sequence (default 0..seq-1);
        context parallelism passes those of this rank's shard, which are not 0..seq/N-1.
        """
        x = tokens
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                if positions is None:
                    positions = torch.arange(tokens.shape[1], device=tokens.device)
                x = x + self.pos_embeddings(positions)
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x


def build_model(
    model: str | ModelConfig = "tiny", *, seed: int = 0, device: torch.device | str = "cpu"
) -> TransformerLM:
    """The same weights on every rank and every world size: initialised from ``seed`` on CPU, then
    moved."""
    cfg = MODEL_PRESETS[model] if isinstance(model, str) else model
    if cfg.dim % cfg.n_heads:
        raise ValueError(f"dim={cfg.dim} must be divisible by n_heads={cfg.n_heads}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = TransformerLM(cfg)
    return lm.to(device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the batch (computed in fp32)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


class SyntheticTokens(Dataset):
    """Deterministic, learnable sequences: token[t] = (start + stride * t) mod vocab.

    The next token follows from the two before it, so the loss falls quickly: a training run that
    does not learn is visible. Sample ``i`` depends only on ``seed`` and ``i``, never on the world
    size.
    """

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=generator)
        stride = torch.randint(1, 8, (num_samples, 1), generator=generator)
        self.tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[index]
        return row[:-1], row[1:]  # inputs, next-token targets


def make_dataset(
    model: str | ModelConfig, global_batch_size: int, *, batches_per_epoch: int = 8, seed: int = 0
) -> SyntheticTokens:
    """A dataset of exactly ``batches_per_epoch`` global batches: no rank ever gets a padded
    sample."""
    cfg = MODEL_PRESETS[model] if isinstance(model, str) else model
    return SyntheticTokens(
        global_batch_size * batches_per_epoch, cfg.seq_len, cfg.vocab_size, seed=seed
    )
