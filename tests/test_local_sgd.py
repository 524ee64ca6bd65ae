"""local_sgd: with H=1 and plain SGD, LocalSGD and DiLoCo (outer SGD at lr 1, no momentum) equal DDP
with SGD step for step; with H=4 there is one all-reduce per 4 steps, and after every
synchronisation every replica holds the same weights; torch's PostLocalSGDOptimizer agrees with
the hand-written loop; bad input is one line."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from recipes import local_sgd
from recipes.toy import build_model, lm_loss, make_dataset
from tests.deadlines import scaled
from tests.helpers import (
    PYTHON,
    REPO_ROOT,
    assert_losses_close,
    assert_states_close,
    run_world,
)

CFG = local_sgd.LocalSGDConfig(steps=4, backend="gloo", timeout_s=60)


def sgd_reference(cfg) -> tuple[list[float], dict]:
    """DDP with SGD, as one process sees it: the whole global batch, one SGD step per step."""
    model = build_model(cfg.model, seed=cfg.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=cfg.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.global_batch_size, sampler=sampler)
    losses = []
    for inputs, targets in loader:  # 8 batches an epoch: more than the steps asked for
        if len(losses) == cfg.steps:
            break
        optimizer.zero_grad()
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


class Watch:
    """The test's observer: after each synchronised step, every rank's weights are gathered and
    compared; the all-reduces the run makes are counted."""

    def __init__(self, sync_every: int):
        self.sync_every, self.model, self.mismatches = sync_every, None, []

    def model_ready(self, model, optimizer):
        self.model = model

    def step_end(self, step, loss):
        if (step + 1) % self.sync_every:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        if not all(torch.equal(gathered[0], other) for other in gathered[1:]):
            self.mismatches.append(step)


def watched_run(cfg):
    """One rank: the recipe's train with the all-reduces counted and the replicas compared."""
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    watch = Watch(cfg.sync_every)
    dist.all_reduce = counting
    try:
        losses = local_sgd.train(cfg, observer=watch)
        state = {name: p.detach().clone() for name, p in watch.model.named_parameters()}
    finally:
        dist.all_reduce = real
    return losses, state, calls, watch.mismatches


# Every run of this module in one spawned world of 2 (one world start instead of six): the
# recipe's train joins the world the test made, as a user's own script would.
CONFIGS = {
    "local_sgd h1 sgd": dataclasses.replace(CFG, inner_optimizer="sgd", lr=0.05, sync_every=1),
    "diloco h1 sgd": dataclasses.replace(
        CFG, inner_optimizer="sgd", lr=0.05, sync_every=1, outer="diloco", outer_lr=1.0,
        outer_momentum=0.0,
    ),
    "local_sgd h4": dataclasses.replace(CFG, steps=8, sync_every=4),
    "diloco h4": dataclasses.replace(CFG, steps=8, sync_every=4, outer="diloco", lr=3e-3),
    "local_sgd h2": dataclasses.replace(CFG, steps=4, sync_every=2),
    "torch averager h2": dataclasses.replace(CFG, steps=4, sync_every=2, torch_averager=True),
}  # fmt: skip

pytestmark = pytest.mark.xdist_group("local_sgd")  # one worker, one world for the module


@pytest.fixture(scope="module")
def runs():
    return dict(zip(CONFIGS, run_world(watched_run, 2, CONFIGS.values(), deadline_s=180)))


@pytest.mark.parametrize("name", ["local_sgd h1 sgd", "diloco h1 sgd"])
def test_h1_with_sgd_inside_equals_ddp_with_sgd(name, runs):
    """Averaging the replicas' SGD steps is the SGD step on the averaged gradient (SGD is linear):
    DDP, exactly. DiLoCo's outer SGD at lr 1 without momentum moves the shared weights by the whole
    averaged pseudo-gradient: the same. (With AdamW inside, the average of the replicas' AdamW
    steps is not AdamW on the average, and H=1 no longer equals DDP.)"""
    losses, state, calls, mismatches = runs[name]
    reference_losses, reference_state = sgd_reference(CONFIGS[name])
    assert_losses_close(losses, reference_losses, atol=1e-5)
    assert_states_close(state, reference_state, atol=1e-5)
    assert len(calls) == CONFIGS[name].steps and mismatches == []


def test_h4_makes_one_all_reduce_per_4_steps_and_the_replicas_agree_after_each(runs):
    losses, _, calls, mismatches = runs["local_sgd h4"]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    # one all-reduce per synchronisation (DDP makes one per gradient bucket per step, and one for
    # the logged loss): every parameter and the window's 4 losses in one buffer
    params = sum(p.numel() for p in build_model(CFG.model).parameters())
    assert calls == [params + 4, params + 4], calls
    assert mismatches == [], f"replicas differ after the synchronisations of steps {mismatches}"


def test_diloco_h4_synchronises_the_replicas_and_learns(runs):
    losses, _, calls, mismatches = runs["diloco h4"]
    assert len(calls) == 2 and mismatches == []
    assert sum(losses[-2:]) < sum(losses[:2]), losses


def test_torch_post_local_sgd_optimizer_agrees_with_the_hand_written_loop(runs):
    hand, torch_own = runs["local_sgd h2"], runs["torch averager h2"]
    assert_losses_close(torch_own[0], hand[0], atol=1e-6)
    assert_states_close(torch_own[1], hand[1], atol=1e-6)
    assert torch_own[3] == [] and hand[3] == []


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(sync_every=0), "sync_every must be a whole number >= 1, got 0"),
        (dict(steps=6, sync_every=4), "steps=6 is not a multiple of sync_every=4"),
        (dict(outer_momentum=1.0), "outer_momentum=1.0 must be below 1"),
        (dict(torch_averager=True, outer="diloco"), "use outer='average' with it"),
        (dict(outer_lr=float("nan")), "outer_lr must be a finite number > 0, got nan"),
    ],
)
def test_bad_input_is_one_line(changes, message):
    with pytest.raises(ValueError) as refused:
        local_sgd.LocalSGDConfig(**changes)
    assert message in str(refused.value) and "\n" not in str(refused.value)


# slow: two spawned worlds of the "small" model on real shards (tokenizer training included),
# ~30 CPU s; it checks the script that writes results/local_sgd_real_data.txt, not a claim of the
# recipe (the tests above make those)
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_real_data_comparison_runs_every_h_and_ddp(tmp_path):
    out = tmp_path / "table.txt"
    proc = subprocess.run(
        [PYTHON, "scripts/local_sgd_real_data.py", "--steps", "16", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(540),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        line[:28].strip(): line[28:].split()
        for line in out.read_text().splitlines()
        if line.startswith(("DDP", "LocalSGD", "DiLoCo"))
    }
    syncs = {name: int(values[0]) for name, values in rows.items()}
    assert syncs == {
        "DDP (all-reduce every step)": 16,
        "LocalSGD H=1": 16,
        "LocalSGD H=4": 4,
        "LocalSGD H=16": 1,
        "DiLoCo H=4": 4,
        "DiLoCo H=16": 1,
    }, rows
    assert all(0 < float(loss) < 10 for values in rows.values() for loss in values[1:]), rows
    assert max(len(line) for line in out.read_text().splitlines()) <= 100  # the docs column
