"""recipes/toy.py: the model and data every recipe trains are the same on every rank and world
size, learnable, and refuse a shape that cannot split into heads."""

import pytest
import torch

from recipes import toy


def test_the_same_seed_builds_the_same_weights_and_the_global_rng_is_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first, second = toy.build_model("tiny", seed=0), toy.build_model("tiny", seed=0)
    assert torch.rand(1) == before  # build_model forks the RNG: the caller's stream is intact
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    other = toy.build_model("tiny", seed=1)
    assert not torch.equal(other.output.weight, first.output.weight)


def test_logits_shape_and_a_shape_that_cannot_split_into_heads_is_refused():
    model = toy.build_model("tiny")
    cfg = toy.MODEL_PRESETS["tiny"]
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    assert model(tokens).shape == (3, cfg.seq_len, cfg.vocab_size)
    bad = toy.ModelConfig(vocab_size=8, seq_len=4, dim=30, n_heads=4, n_layers=1)
    with pytest.raises(ValueError, match="dim=30 must be divisible by n_heads=4"):
        toy.build_model(bad)


def test_the_data_is_deterministic_learnable_and_a_whole_number_of_batches():
    data = toy.make_dataset("tiny", 12, batches_per_epoch=3, seed=0)
    again = toy.make_dataset("tiny", 12, batches_per_epoch=3, seed=0)
    assert len(data) == 36 and torch.equal(data.tokens, again.tokens)
    inputs, targets = data[5]
    assert torch.equal(inputs[1:], targets[:-1])  # targets are the inputs shifted by one
    # learnable: the next token is the last one plus a per-sequence stride, mod vocab
    vocab = toy.MODEL_PRESETS["tiny"].vocab_size
    stride = (targets[0] - inputs[0]) % vocab
    assert torch.equal((inputs + stride) % vocab, targets)


def test_lm_loss_is_the_mean_next_token_cross_entropy_in_fp32():
    logits = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    targets = torch.randint(0, 5, (2, 3))
    loss = toy.lm_loss(logits, targets)
    assert loss.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(logits.float().reshape(6, 5), targets.reshape(6))
    assert torch.equal(loss, expected)
