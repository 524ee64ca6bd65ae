"""ulysses: the all_to_alls around attention equal one process (the output and every gradient) on
the cookbook's model and on a tiny HF Llama, and in training; the bytes they move, counted from
outside, are the arithmetic's, half of ring attention's on 2 ranks; heads that do not divide over
the ranks are one line."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipes import context_parallel, ulysses
from recipes.core.world import join_world
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset
from tests.helpers import (
    assert_losses_close,
    assert_states_close,
    plain_training_loop,
    spawn_world,
)

STEPS = 3
CFG = ulysses.UlyssesConfig(steps=STEPS, backend="gloo", timeout_s=120)
FP32 = 4  # bytes of an element: every tensor here is fp32 (gloo, CPU)
# Why atol 1e-5 everywhere: the sharded run does the same fp32 math as one process, in another
# order (attention per head group, the gradient summed over 2 ranks): rounding, ~1e-7 on these
# magnitudes. A wrong piece of the sequence or a head on the wrong rank is off by ~1e-1.
ATOL = 1e-5


@contextlib.contextmanager
def counted_traffic():
    """The bytes each collective of this rank hands to torch, recorded around torch's own
    functions: all_to_all_single's input (it sends (N-1)/N of it to the other ranks) and the
    tensors batch_isend_irecv sends (ring attention's)."""
    sent = {"all_to_all": [], "isend": []}
    real_all_to_all, real_batch = dist.all_to_all_single, dist.batch_isend_irecv

    def all_to_all_single(output, input, *args, **kwargs):
        sent["all_to_all"].append(input.numel() * input.element_size())
        return real_all_to_all(output, input, *args, **kwargs)

    def batch_isend_irecv(ops):
        sends = [op.tensor for op in ops if op.op is dist.isend]
        sent["isend"] += [tensor.numel() * tensor.element_size() for tensor in sends]
        return real_batch(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv
    try:
        yield sent
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = real_all_to_all, real_batch


def largest_over_ranks(values: list[torch.Tensor]) -> float:
    worst = torch.stack([v.abs().max() for v in values]).max()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def attention_against_sdpa(world, causal: bool) -> dict:
    """One attention call, [batch 2, heads 4, seq 16, head_dim 8] split over the ranks: Ulysses
    and ring attention each against SDPA on the whole sequence (output and q/k/v gradients), with
    the bytes each sent."""
    n, rank, seq = world.world_size, world.rank, 16
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(2, 4, seq, 8, generator=generator) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
    expected.backward(grad_out)
    mine = torch.arange(rank * seq // n, (rank + 1) * seq // n)  # contiguous: Ulysses' split
    layout = torch.stack(
        [context_parallel.shard_positions(seq, r, n, load_balance=False) for r in range(n)]
    )
    found = {}
    for name in ("ulysses", "ring"):
        shards = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        with counted_traffic() as sent:
            if name == "ulysses":
                out = ulysses.ulysses_sdpa(*shards, group=dist.group.WORLD, is_causal=causal)
            else:
                with context_parallel.ring_attention(dist.group.WORLD, layout):
                    out = F.scaled_dot_product_attention(*shards, is_causal=causal)
            out.backward(grad_out[:, :, mine])
        difference = largest_over_ranks(
            [out - expected[:, :, mine]]
            + [shard.grad - full.grad[:, :, mine] for shard, full in zip(shards, whole)]
        )
        found[name] = (difference, sent)
    return found


def model_against_one_process(model, run, tokens, world) -> tuple[float, float, list[int]]:
    """(largest |Ulysses - whole| of the logits, of every gradient, the all_to_alls' input bytes):
    the model on its whole sequences, then on contiguous shards under ulysses_attention."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    whole = run(model, inputs, None)
    lm_loss(whole, targets).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    shard = inputs.shape[1] // world.world_size
    mine = torch.arange(world.rank * shard, (world.rank + 1) * shard)
    with counted_traffic() as sent, ulysses.ulysses_attention(group=dist.group.WORLD):
        logits = run(model, inputs[:, mine], mine.expand(len(inputs), -1))
        # this rank's tokens' mean over the ranks: the whole batch's mean
        (lm_loss(logits, targets[:, mine]) / world.world_size).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    logits_difference = largest_over_ranks([logits - whole[:, mine]])
    grad_difference = largest_over_ranks(
        [p.grad - expected[name] for name, p in model.named_parameters()]
    )
    assert sent["isend"] == []
    return logits_difference, grad_difference, sent["all_to_all"]


def toy_run(model, ids, positions):
    return model(ids, positions=positions)


def llama_run(model, ids, positions):
    return model(input_ids=ids, position_ids=positions).logits


class KeepModel:
    """The test's observer: the model, for its final weights."""

    def model_ready(self, model, optimizer):
        self.model = model

    def step_end(self, step, loss):
        pass


def ulysses_world(with_training: bool = True) -> dict:
    """Every claim of this module, measured in one spawned world (rank 0's view)."""
    from tests import third_party  # in the rank: transformers is imported where it is used

    with join_world("gloo", timeout_s=120) as world:
        found = {
            "attention": {c: attention_against_sdpa(world, c) for c in (True, False)},
            "toy": model_against_one_process(
                build_model("tiny", seed=0), toy_run, make_dataset("tiny", 2).tokens[:2], world
            ),
            "llama": model_against_one_process(
                third_party.build("llama", attn_implementation="sdpa"),
                llama_run,
                third_party.batch(0, 2),
                world,
            ),
        }
        three_heads = torch.zeros(1, 3, 8, 8)  # [batch, heads, seq/N, head_dim]
        with pytest.raises(ValueError) as refused:  # over 2 ranks, at call time
            ulysses.ulysses_sdpa(three_heads, three_heads, three_heads, group=dist.group.WORLD)
        found["refusal"] = str(refused.value)
        if with_training:
            watch = KeepModel()
            with counted_traffic() as sent:
                losses = ulysses.train(CFG, observer=watch)
            state = {name: p.detach().clone() for name, p in watch.model.named_parameters()}
            found["training"] = (losses, state, sent)
        return found


pytestmark = pytest.mark.xdist_group("ulysses")  # one worker, one world for the module


@pytest.fixture(scope="module")
def runs():
    return spawn_world(ulysses_world, 2, deadline_s=240)


def test_attention_equals_sdpa_and_moves_half_the_bytes_of_ring_attention_on_2_ranks(runs):
    """b=2, H=4, s=16, d=8 over N=2 ranks; blk = b*H*(s/N)*d = 512 elements, one rank's q.
    Ulysses: 8 all_to_alls of blk (q, k, v, out forward; their gradients backward), each sending
    (N-1)/N of it: 8*blk*(N-1)/N. Ring: K/V (2 blk) go round N-1 times forward; backward K/V with
    their gradients (4 blk) N-1 times, then the gradients (2 blk) home: (6N-4)*blk."""
    n, blk = 2, 2 * 4 * 8 * 8
    for causal, found in runs["attention"].items():
        for name, (difference, _) in found.items():
            assert difference < ATOL, f"{name} causal={causal}: differs from SDPA by {difference}"
        ulysses_sent, ring_sent = found["ulysses"][1], found["ring"][1]
        assert ulysses_sent["all_to_all"] == [blk * FP32] * 8 and ulysses_sent["isend"] == []
        assert sum(ulysses_sent["all_to_all"]) * (n - 1) // n == 8 * blk * (n - 1) // n * FP32
        assert sum(ring_sent["isend"]) == (6 * n - 4) * blk * FP32 == 16384
        assert sum(ulysses_sent["all_to_all"]) * (n - 1) // n == 8192  # half of ring's


def test_the_cookbook_model_on_sequence_shards_equals_one_process(runs):
    logits, grads, sent = runs["toy"]
    assert logits < ATOL and grads < ATOL, f"logits differ by {logits}, gradients by {grads}"
    # 2 layers x 8 all_to_alls of [b=2, s/N=8, dim=32]: 512 fp32 elements each, half sent away
    assert sent == [2 * 8 * 32 * FP32] * 16, sent


def test_a_hugging_face_llama_on_sequence_shards_equals_one_process(runs):
    """A model the cookbook did not write: RoPE from position_ids, grouped-query attention through
    SDPA (4 query heads, 2 key/value heads: each rank gets 2 and 1)."""
    logits, grads, sent = runs["llama"]
    assert logits < ATOL and grads < ATOL, f"logits differ by {logits}, gradients by {grads}"
    q_bytes, kv_bytes = 2 * 4 * 8 * 16 * FP32, 2 * 2 * 8 * 16 * FP32  # [b, heads, s/N, 16]
    forward = [q_bytes, kv_bytes, kv_bytes, q_bytes]  # q, k, v, the output
    assert sorted(sent) == sorted(forward * 2 * 2), sent  # and backward, in 2 layers


def test_training_equals_one_process_with_16_all_to_alls_a_step(runs):
    losses, state, sent = runs["training"]
    expected_losses, expected_state = plain_training_loop(
        CFG.model, steps=STEPS, global_batch_size=12, lr=CFG.lr, seed=CFG.seed
    )
    assert_losses_close(losses, expected_losses, atol=ATOL)
    assert_states_close(state, expected_state, atol=ATOL)
    # the feature took effect: per step, 2 layers x 8 all_to_alls of b*(s/N)*dim elements
    preset = MODEL_PRESETS[CFG.model]
    per_call = CFG.global_batch_size * preset.seq_len // 2 * preset.dim * FP32
    assert sent["all_to_all"] == [per_call] * 16 * STEPS and sent["isend"] == []
    # what a rank sends to the other per layer per step ((N-1)/N of each input): the page's figure
    assert sum(sent["all_to_all"]) // 2 // (STEPS * preset.n_layers) == 49152


def test_heads_that_do_not_divide_over_the_ranks_are_one_line(runs):
    assert runs["refusal"] == (
        "Ulysses over 2 ranks cannot split 3 attention heads (each rank attends with "
        "heads/ranks of them); use 1, 3 ranks, or ring attention (recipes/context_parallel.py), "
        "which has no limit on heads"
    )
    with pytest.raises(ValueError, match=r"^Ulysses over 8 ranks cannot split 4 attention heads"):
        ulysses.check_ulysses_fits(4, 16, 8)  # heads >= ranks: fewer heads than ranks
    with pytest.raises(ValueError) as refused:
        ulysses.check_ulysses_fits(12, 16, 3)
    assert str(refused.value) == (
        "Ulysses over 3 ranks cannot split seq_len=16 into equal shards; use 1, 2, 4 ranks"
    )


@pytest.mark.slow  # 4 ranks on a 2-core machine: ~3x the 2-rank world's time for the same claim
def test_4_ranks_equal_one_process_and_repeat_the_llama_key_value_heads():
    """N=4: one head per rank; the Llama's 2 key/value heads do not divide over 4 ranks, so each
    rank gets its query head's K/V head repeated (k and v travel with 4 heads, as q does)."""
    found = spawn_world(ulysses_world, 4, False, deadline_s=400)
    n, blk = 4, 2 * 4 * 4 * 8
    for causal, attention in found["attention"].items():
        assert max(d for d, _ in attention.values()) < ATOL, (causal, attention)
        assert sum(attention["ring"][1]["isend"]) == (6 * n - 4) * blk * FP32 == 20480
        assert attention["ulysses"][1]["all_to_all"] == [blk * FP32] * 8
        sent = sum(attention["ulysses"][1]["all_to_all"]) * (n - 1) // n
        assert sent == 8 * blk * FP32 * (n - 1) // n == 6144  # under a third of ring's
    for model in ("toy", "llama"):
        logits, grads, _ = found[model]
        assert logits < ATOL and grads < ATOL, (model, logits, grads)
    q_bytes = 2 * 4 * 4 * 16 * FP32
    assert found["llama"][2] == [q_bytes] * 16
