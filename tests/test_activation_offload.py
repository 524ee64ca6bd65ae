"""activation_offload: with torch's save_on_cpu and with the recipe's offload_hooks, under every
checkpointing mode, the gradients, losses and weights equal the plain run's exactly; what the
forward leaves on the device is counted from outside (on CPU, by where each storage came from; on
a GPU, by the allocator); the recipe's loop is DDP's, exactly; bad input is one line.

On CPU the recipe refuses to offload (there is no device to offload from), so the offload path
runs here as the loop runs it - the same ``save_on_cpu(pin_memory=True)`` and ``offload_hooks`` -
around a single-process forward on CPU tensors: with pinning asked for, ``save_on_cpu`` copies
every saved tensor into a new host buffer even where there is no GPU (without it, ``.cpu()`` of a
CPU tensor is the tensor itself: nothing moves, asserted too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from recipes import activation_offload as ao
from recipes import ddp_torchrun
from recipes.options import parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset

# Where the bytes are counted: "small" (4 blocks) with 4 sequences of 64 tokens, fp32 on CPU.
MODEL_NAME = "small"
MODEL = MODEL_PRESETS[MODEL_NAME]
BATCH = 4
TOKENS = BATCH * MODEL.seq_len
FLOAT_BYTES = 4
CHECKPOINTS = ("none", "per_block", "op_selective")


# The contexts the recipe's loop runs its forward in (recipes/activation_offload.py, "loop"),
# and save_on_cpu without pinning, which the loop never uses: on CPU it moves nothing.
def offload_context(offload: str, model: nn.Module):
    if offload == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if offload == "save_on_cpu unpinned":
        return torch.autograd.graph.save_on_cpu(pin_memory=False)
    if offload == "offload_hooks":
        return torch.autograd.graph.saved_tensors_hooks(*ao.offload_hooks(model))
    return contextlib.nullcontext()


OFFLOADS = ("none", "save_on_cpu", "offload_hooks", "save_on_cpu unpinned")


def checkpointed_model(name: str, checkpoint: str, device="cpu") -> nn.Module:
    model = build_model(name, seed=0, device=device)
    if checkpoint != "none":  # as the loop does
        keep = ao.MATMULS if checkpoint == "op_selective" else None
        ao.checkpoint_blocks(model.layers.values(), keep=keep)
    return model


def one_batch(name: str, batch_size: int = BATCH, device="cpu"):
    dataset = make_dataset(name, batch_size)
    inputs, targets = zip(*(dataset[i] for i in range(batch_size)))
    return torch.stack(inputs).to(device), torch.stack(targets).to(device)


class StoragesMade(TorchDispatchMode):
    """The bytes a forward leaves alive, split by who made them.

    While it is on, it notes the storage of every tensor an op makes, and whether the op ran with
    grad mode on - the forward's own ops: the activations, where they were computed - or off: the
    ops inside a saved-tensor pack hook (autograd turns recording off while a hook packs), i.e. the
    copies an offload makes. ``alive()``: the bytes of each kind still alive, each storage once,
    without the parameters and the batch (they exist anyway). On a GPU the activations would be in
    device memory and the copies in host memory; on CPU both are host memory, and who made them is
    what tells them apart. Like recipes/core/memory.py's SavedTensorBytes it counts storages, not
    saved tensors: selective checkpointing's cache, which no saved_tensors_hooks sees, counts too.
    """

    def __init__(self, *exists_anyway: torch.Tensor):
        super().__init__()
        self._skip = {t.untyped_storage().data_ptr() for t in exists_anyway}
        self._made: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = "activations" if torch.is_grad_enabled() else "offloaded"
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self._made.append(
                    (StorageWeakRef(storage), storage.data_ptr(), storage.nbytes(), kind)
                )
        return out

    def alive(self) -> dict[str, int]:
        # A freed storage's address can be reused: only a live reference names it. A storage
        # counts once, as what its first op made (a view made later shares it).
        live: dict[int, tuple[int, str]] = {}
        for ref, ptr, nbytes, kind in self._made:
            if not ref.expired() and ptr not in self._skip:
                live.setdefault(ptr, (nbytes, kind))
        held = {"activations": 0, "offloaded": 0}
        for nbytes, kind in live.values():
            held[kind] += nbytes
        return held


def forward_backward(checkpoint: str, offload: str):
    """One forward (counted when it ends) and backward; the bytes, the loss's and the gradients."""
    model = checkpointed_model(MODEL_NAME, checkpoint)
    inputs, targets = one_batch(MODEL_NAME)
    with StoragesMade(*model.parameters(), inputs, targets) as made:
        with offload_context(offload, model):
            loss = lm_loss(model(inputs), targets)
    held = made.alive()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return held, loss.untyped_storage().nbytes(), grads


@pytest.fixture(scope="module")
def measured():
    return {(c, o): forward_backward(c, o) for c in CHECKPOINTS for o in OFFLOADS}


def test_gradients_equal_the_plain_runs_exactly(measured):
    reference = measured[("none", "none")][2]
    for (checkpoint, offload), (_, _, grads) in measured.items():
        # a copy to the host and back is exact, and so is the recomputation: bit for bit
        assert grads.keys() == reference.keys()
        different = [name for name in grads if not torch.equal(grads[name], reference[name])]
        assert not different, f"{checkpoint}, {offload}: gradients differ in {different}"


def test_offloading_leaves_only_the_loss_on_the_device(measured):
    for checkpoint in ("none", "per_block"):
        plain, loss_bytes, _ = measured[(checkpoint, "none")]
        assert plain["offloaded"] == 0 and plain["activations"] > 100 * loss_bytes, plain
        for offload in ("save_on_cpu", "offload_hooks"):
            held, _, _ = measured[(checkpoint, offload)]
            # every saved tensor went to a copy, and the forward's own storages are all freed but
            # the loss's (per_block: the blocks' inputs too, saved by checkpoint through the hooks)
            assert held["activations"] == loss_bytes, (checkpoint, offload, held)
            # the copies hold at least what left the device (more: see the duplicates test)
            assert held["offloaded"] >= plain["activations"] - loss_bytes, (checkpoint, held)


def test_selective_checkpointings_cache_stays_on_the_device(measured):
    """op_selective keeps the matmuls' outputs in a cache that no saved_tensors_hooks sees: per
    token and block q, k, v and the attention's output projection (dim each), the MLP's hidden
    layer (mlp_ratio x dim) and its output (dim). Offloading moves the rest (each block's input,
    what is saved outside the blocks), not these."""
    cache = MODEL.n_layers * TOKENS * (5 + MODEL.mlp_ratio) * MODEL.dim * FLOAT_BYTES
    plain, loss_bytes, _ = measured[("op_selective", "none")]
    for offload in ("save_on_cpu", "offload_hooks"):
        held, _, _ = measured[("op_selective", offload)]
        assert held["activations"] == cache + loss_bytes, (offload, held)
        assert plain["activations"] > held["activations"]


def test_save_on_cpu_moves_nothing_from_a_cpu_device(measured):
    # .cpu() of a CPU tensor is the tensor itself: why the recipe refuses --offload cpu on CPU
    for checkpoint in CHECKPOINTS:
        assert (
            measured[(checkpoint, "save_on_cpu unpinned")][0] == measured[(checkpoint, "none")][0]
        )


def saved_parameter_bytes(model: nn.Module) -> int:
    """What a forward saves of the parameters: each linear layer's weight (not its bias: addmm's
    backward needs only the input and the weight) and each layer norm's weight and bias; not the
    embedding tables (an embedding saves its indices)."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.nbytes
        elif isinstance(module, nn.LayerNorm):
            total += module.weight.nbytes + module.bias.nbytes
    return total


def test_offload_hooks_keep_the_weights_save_on_cpu_copies(measured):
    """save_on_cpu copies every saved tensor, weights included: a copy of the parameters leaves
    for the host every step and comes back in backward, though the parameters never leave the
    device: a copy for nothing. offload_hooks keep them where they are."""
    model = build_model(MODEL_NAME)
    outside_the_blocks = model.output.weight.nbytes + model.norm.weight.nbytes * 2  # + its bias
    expected = {  # inside a checkpointed block nothing is saved in the forward
        "none": saved_parameter_bytes(model),
        "per_block": outside_the_blocks,
        "op_selective": outside_the_blocks,
    }
    for checkpoint, weights in expected.items():
        copied = measured[(checkpoint, "save_on_cpu")][0]["offloaded"]
        kept = measured[(checkpoint, "offload_hooks")][0]["offloaded"]
        assert copied - kept == weights, (checkpoint, copied, kept, weights)


def test_a_tensor_saved_twice_is_copied_twice(measured):
    """save_on_cpu (and offload_hooks) copy a tensor once per op that saves it, where the device
    held one storage: per block the attention norm's output (read by wq, wk and wv: 2 extra
    copies) and the attention's output (saved by attention and by wo, as a view: 1); the log-
    softmax (read by the loss too) and the batch's token ids (the embedding's and the loss's: on
    the host once each, beside the batch that stays)."""
    plain = measured[("none", "none")][0]["activations"]
    held, loss_bytes, _ = measured[("none", "offload_hooks")]
    moved = plain - loss_bytes
    duplicates = (
        MODEL.n_layers * TOKENS * 3 * MODEL.dim * FLOAT_BYTES
        + TOKENS * MODEL.vocab_size * FLOAT_BYTES
        + 2 * TOKENS * torch.tensor(0).element_size()  # int64 token ids: inputs and targets
    )
    assert held["offloaded"] - moved == duplicates, (held, moved, duplicates)


def train_steps(name, checkpoint, offload, steps=3):
    """The recipe's loop on one process: one offload context, entered by every step's forward."""
    model = checkpointed_model(name, checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    offloading = offload_context(offload, model)
    losses = []
    for step in range(steps):
        inputs, targets = one_batch(name, batch_size=4 + step)
        optimizer.zero_grad(set_to_none=True)
        with offloading:
            loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_training_with_offload_equals_the_plain_run_exactly(checkpoint):
    reference_losses, reference_state = train_steps("tiny", "none", "none")
    for offload in ("save_on_cpu", "offload_hooks"):
        losses, state = train_steps("tiny", checkpoint, offload)
        assert losses == reference_losses, (checkpoint, offload)
        assert all(torch.equal(state[name], reference_state[name]) for name in state)


class KeepModel:
    def model_ready(self, model, optimizer):
        self.model = model.module  # DDP's

    def step_end(self, step, loss):
        pass


CFG = ao.OffloadConfig(steps=3, backend="gloo", precision="fp32", timeout_s=60)


def test_the_recipes_loop_is_ddps_with_checkpointing_exactly(capsys):
    """train() in a world of 1 in this process (gloo: CPU, so --offload auto is none): every
    checkpointing mode gives DDP's losses and weights, bit for bit. The world of 2 runs under
    torchrun in tests/test_copy_recipes.py."""
    keep = KeepModel()
    ddp_losses = ddp_torchrun.train(
        ddp_torchrun.DDPConfig(steps=3, backend="gloo", precision="fp32"), observer=keep
    )
    ddp_state = {name: p.detach() for name, p in keep.model.named_parameters()}
    for checkpoint in CHECKPOINTS:
        losses = ao.train(dataclasses.replace(CFG, checkpoint=checkpoint), observer=keep)
        assert losses == ddp_losses, checkpoint
        state = dict(keep.model.named_parameters())
        assert all(torch.equal(state[name], ddp_state[name]) for name in state), checkpoint
        assert (
            f"offload none, checkpoint {checkpoint} (fp32) on 1 rank(s) of cpu: no GPU to offload "
            "from\n" in capsys.readouterr().out
        )


def test_the_loop_offloads_with_what_these_tests_run():
    source = Path(ao.__file__).read_text()
    loop = source[source.index("# --8<-- [start:loop]") : source.index("# --8<-- [end:loop]")]
    assert "offloading = torch.autograd.graph.save_on_cpu(pin_memory=True)" in loop
    assert "pack, unpack = offload_hooks(model, stream=torch.cuda.Stream(device))" in loop
    assert "offloading = torch.autograd.graph.saved_tensors_hooks(pack, unpack)" in loop
    assert "checkpoint_blocks(model.layers.values(), keep=keep)" in loop
    assert "with offloading, torch.autocast(" in loop


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(offload="cpu", backend="gloo"), "offload cpu moves activations from a GPU"),
        (dict(offload="streamed", backend="gloo"), "offload streamed moves activations from a GPU"),
        (dict(checkpoint="full"), "checkpoint must be one of none, per_block, op_selective"),
        (dict(global_batch_size=0), "global_batch_size must be a whole number >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line(changes, message):
    with pytest.raises(ValueError) as refused:
        ao.OffloadConfig(**changes)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_offload_without_a_gpu_is_refused_on_the_command_line(capsys):
    argv = ["--offload", "cpu"] + ([] if not torch.cuda.is_available() else ["--backend", "gloo"])
    with pytest.raises(SystemExit) as exit_info:
        parse_config(ao.make_parser(), ao.OffloadConfig, argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m recipes.activation_offload: error: offload cpu moves activations from a GPU to "
        "host memory, and this run is on CPU, where they are already; use offload none (or "
        "auto), or run with a GPU per rank"
    )
    with pytest.raises(ValueError, match="^checkpoint_blocks got no block; pass your model's"):
        ao.checkpoint_blocks([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory needs a CUDA GPU")
def test_on_a_gpu_offloading_frees_device_memory_and_keeps_the_gradients(monkeypatch):
    """The allocator's own count: the bytes the forward leaves allocated and the step's peak; the
    step time is printed (speed is the benchmark's to claim, not a test's). fp32, deterministic
    kernels and math attention, so that two plain runs are equal and the exact comparisons mean
    something; the recipe's own loop too (train, a world of 1), with each offload."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda", 0)
    was = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            runs = {
                (c, o): gpu_steps(c, o, device)
                for c in ("none", "per_block")
                for o in ("none", "none again", "save_on_cpu", "offload_hooks")
            }
            cfg = dataclasses.replace(CFG, backend="nccl", model=MODEL_NAME, steps=2)
            trained = {o: ao.train(dataclasses.replace(cfg, offload=o)) for o in OFFLOAD_CHOICES}
    finally:
        torch.use_deterministic_algorithms(was[0])
        torch.backends.cuda.matmul.allow_tf32 = was[1]
    reference = runs[("none", "none")]["grads"]
    assert equal_grads(runs[("none", "none again")]["grads"], reference), "not deterministic"
    for (checkpoint, offload), run in runs.items():
        print(
            f"{checkpoint:9} {offload:13} held {run['held']:>11,} B peak {run['peak']:>11,} B "
            f"{1e3 * run['seconds_per_step']:.2f} ms/step"
        )
        assert equal_grads(run["grads"], reference), (checkpoint, offload)
        if offload in ("save_on_cpu", "offload_hooks"):
            plain = runs[(checkpoint, "none")]
            assert run["held"] < plain["held"] / 10, (checkpoint, offload, run, plain)
            assert run["peak"] < plain["peak"], (checkpoint, offload)
    assert trained["cpu"] == trained["none"] and trained["streamed"] == trained["none"], trained


OFFLOAD_CHOICES = ("none", "cpu", "streamed")


def gpu_steps(checkpoint: str, offload: str, device: torch.device, steps: int = 3) -> dict:
    """A warm-up step, one step measured (synchronised after the forward to read what it left
    allocated), then ``steps`` timed steps (synchronised at the end only: the side stream's
    copies overlap the forward there)."""
    model = checkpointed_model(MODEL_NAME, checkpoint, device=device)
    inputs, targets = one_batch(MODEL_NAME, batch_size=16, device=device)
    if offload == "offload_hooks":
        pack, unpack = ao.offload_hooks(model, stream=torch.cuda.Stream(device))
        offloading = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    else:
        offloading = offload_context(offload, model)

    def step(measure: bool = False) -> int:
        model.zero_grad(set_to_none=True)
        before = torch.cuda.memory_allocated(device)
        with offloading:
            loss = lm_loss(model(inputs), targets)
        if measure:
            torch.cuda.synchronize(device)
            torch.empty(1, device=device)  # frees what record_stream held: the copies are done
        held = torch.cuda.memory_allocated(device) - before
        loss.backward()
        return held

    step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    held = step(measure=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    grads = {name: p.grad.detach().cpu() for name, p in model.named_parameters()}
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    seconds_per_step = (time.perf_counter() - start) / steps
    return dict(held=held, peak=peak, seconds_per_step=seconds_per_step, grads=grads)


def equal_grads(grads: dict, reference: dict) -> bool:
    return all(torch.equal(grads[name], reference[name]) for name in reference)
