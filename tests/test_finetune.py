"""finetune: every mode under DDP and fully_shard equals single-process fine-tuning; frozen
parameters get no gradient, no optimizer state and no all-reduce; the checkpoints reload; the
pitfalls (DDP frozen after wrapping, classic FSDP without use_orig_params) are shown; peft's
LoRA (get_peft_model) equals the hand-written one.

The recipe's ``train`` runs through the harness's ``prove`` (tests.helpers.recipe_result), whose
recipes.core.observe.FinetuneObserver measures from outside what the assertions read: the
trainable names and counts, each rank's bytes against full fine-tuning's, the frozen gradients,
the optimizer's tensors and the bytes DDP all-reduces (a comm hook), and the final state."""

import dataclasses
import importlib.util
import os
import re
import sys

import pytest
import torch

from recipes import finetune
from recipes.core.workload import (
    Block,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.world import join_world
from tests.helpers import (
    PYTHON,
    assert_losses_close,
    assert_states_close,
    last_json,
    recipe_result,
    run_cli,
    run_world,
    with_fields,
)

TuningError = finetune.TuningError
STEPS = 3
CFG = finetune.FinetuneConfig(steps=STEPS, precision="fp32", timeout_s=120)
BF16_ATOL = 2e-2  # as in tests/test_fsdp2.py: bf16's 8-bit mantissa over a few AdamW steps
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="the Hugging Face models need: pip install transformers",
)


def reference(cfg: finetune.FinetuneConfig, ranks: int = 2, *, lora_a=None):
    """Single-process fine-tuning, textbook loop: (losses, initial and final parameters, trainable
    names). It uses the recipe's add_lora / freeze_for, as a user's one-GPU script would.

    Each step's batch is the same global batch, but its mean gradient is summed in the order the
    ``ranks`` ranks sum it: the mean over each rank's share (the samples DistributedSampler deals
    it), divided by the rank count, added up in rank order. Why: a gradient summed in another order
    differs in its last bits, and AdamW's first step, lr * g / (|g| + eps), makes a last-bit
    difference of a gradient near eps a large one of the weight (its slope in g is lr * eps /
    (|g| + eps)^2): GPT-2's layer-1 c_proj has an element whose first gradient is -2.6e-8 (the
    others are near 1e-2); computed over the whole batch at once, it ended 6e-6 from the 2-rank
    run's after 3 steps, and 1.27e-5 in a fresh clone's run (over the 1e-5 allowed). Summed in the
    ranks' order, every weight of the 24 runs (3 models x 4 modes x DDP, fully_shard) was bit for
    bit the 2-rank run's (torch 2.13 CPU); the tolerance stays, for other kernels' margin.

    ``lora_a``: each adapter's A by module name, copied over add_lora's (peft's initial A: the
    same kaiming-uniform init, other draws), so that the hand-written LoRA starts where peft's did.
    """
    model = finetune.build_arch(cfg.arch, cfg.model, seed=cfg.seed)
    targets = finetune.ready_made_targets(cfg.arch)
    if cfg.mode == "lora":
        finetune.add_lora(
            model,
            targets=targets.lora_targets,
            rank=cfg.lora_rank,
            alpha=cfg.lora_alpha,
            seed=cfg.seed,
        )
    for name, a in (lora_a or {}).items():
        with torch.no_grad():
            model.get_submodule(name).lora_a.copy_(a)
    finetune.freeze_for(
        model, cfg.mode, head=targets.head, block_types=targets.block_types, last_k=cfg.last_k
    )
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    data = finetune.HF_DATA if cfg.arch != "cookbook" else cfg.model
    dataset = make_dataset(data, cfg.global_batch_size, seed=cfg.seed)
    shares = [
        iterate_steps(
            *distributed_loader(
                dataset,
                rank=rank,
                world_size=ranks,
                per_rank_batch_size=cfg.global_batch_size // ranks,
                seed=cfg.seed,
            ),
            cfg.steps,
        )
        for rank in range(ranks)
    ]
    losses = []
    for batches in zip(*shares):  # one step: every rank's share of the global batch
        optimizer.zero_grad()
        loss = 0.0
        for _, (inputs, targets_) in batches:
            share = lm_loss(finetune.logits_of(model(inputs)), targets_) / ranks
            share.backward()  # accumulates: the ranks' sum, in rank order
            loss += share.item()
        optimizer.step()
        losses.append(loss)
    final = {name: p.detach().clone() for name, p in model.named_parameters()}
    return losses, initial, final, [n for n, p in model.named_parameters() if p.requires_grad]


def assert_fine_tuned_like_one_process(result, cfg, *, atol=1e-5, lora_a=None):
    losses, initial, final, trainable = reference(cfg, lora_a=lora_a)
    extras = result.extras
    assert extras["trainable_names"] == trainable
    assert_losses_close(result.losses, losses, atol=atol)
    assert_states_close(result.final_state, final, atol=atol)
    frozen = [name for name in initial if name not in trainable]
    assert (cfg.mode == "full") == (not frozen)
    for name in frozen:  # bit for bit: a frozen weight is never touched, under any precision
        assert torch.equal(result.final_state[name], initial[name]), name
    assert all(extras["frozen_grads_none_per_rank"])
    # Only trainable parameters are in the optimizer, and only they have AdamW state.
    assert extras["optimizer_tensors"] == extras["optimizer_state_tensors"] == len(trainable)
    trainable_bytes = 4 * extras["trainable_params"]  # fp32 master weights and gradients
    if cfg.strategy == "ddp":  # DDP all-reduces the trainable gradients and nothing else
        assert extras["reduced_bytes_per_step"] == trainable_bytes
        memory = extras["memory_per_rank"][0]
        assert memory["grad_bytes"] == trainable_bytes
        assert memory["optimizer_bytes"] == 2 * trainable_bytes + 4 * len(trainable)  # + step
    saved = extras["bytes_saved_per_rank"]
    if cfg.mode == "full":
        assert saved == [0, 0]
    else:
        full = [sum(m.values()) for m in extras["full_finetune_memory_per_rank"]]
        own = [sum(m.values()) for m in extras["memory_per_rank"]]
        assert saved == [f - o for f, o in zip(full, own)] and min(saved) > 0


def assert_checkpoint_reloads(result, cfg):
    """trainable.pt alone on the base model gives the trained logits; merged.pt loads into the
    plain model class (strict) and gives the same logits as the unmerged, adapted model."""
    targets = finetune.ready_made_targets(cfg.arch).lora_targets
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    trained = finetune.build_arch(cfg.arch, seed=cfg.seed)
    finetune.add_lora(trained, targets=targets, rank=cfg.lora_rank, alpha=cfg.lora_alpha)
    finetune.load_trainable(trained, result.final_state)
    expected = finetune.logits_of(trained(tokens))

    adapters = torch.load(os.path.join(cfg.checkpoint_dir, "trainable.pt"))
    assert adapters and all(".lora_" in name for name in adapters)
    base = finetune.build_arch(cfg.arch, seed=cfg.seed)  # the "pretrained" model you started from
    finetune.add_lora(base, targets=targets, rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=123)
    finetune.load_trainable(base, adapters)
    torch.testing.assert_close(finetune.logits_of(base(tokens)), expected, atol=0, rtol=0)

    plain = finetune.build_arch(cfg.arch, seed=cfg.seed + 99)  # other weights: all must load
    plain.load_state_dict(torch.load(os.path.join(cfg.checkpoint_dir, "merged.pt")), strict=True)
    assert not any(isinstance(m, finetune.LoRA) for m in plain.modules())
    torch.testing.assert_close(finetune.logits_of(plain(tokens)), expected, atol=1e-5, rtol=0)


@pytest.mark.timeout(300)  # about 10 s on an idle 2-core machine; room for a loaded one
def test_cookbook_model_every_mode_and_strategy_equals_one_process(tmp_path):
    configs = [
        with_fields(
            CFG,
            mode=mode,
            strategy=strategy,
            last_k=1,
            checkpoint_dir=str(tmp_path / f"{strategy}-{mode}"),
        )
        for strategy in ("ddp", "fully_shard")
        for mode in finetune.MODES
    ]
    # Pitfall check: fully_shard with frozen parameters and MixedPrecisionPolicy(param_dtype=bf16).
    bf16 = with_fields(CFG, mode="lora", strategy="fully_shard", precision="bf16")
    *results, bf16_result = run_world(recipe_result, 2, configs + [bf16], deadline_s=280)
    for cfg, result in zip(configs, results):
        assert_fine_tuned_like_one_process(result, cfg)
    assert_fine_tuned_like_one_process(bf16_result, bf16, atol=BF16_ATOL)
    for cfg, result in zip(configs, results):
        if cfg.mode == "lora":
            assert_checkpoint_reloads(result, cfg)
    by_name = {(c.strategy, c.mode): r.extras for c, r in zip(configs, results)}
    # fully_shard holds about half of DDP's gradient bytes per rank, for the same trained subset.
    for mode in ("head", "partial", "lora"):
        ddp_grads = by_name["ddp", mode]["memory_per_rank"][0]["grad_bytes"]
        assert by_name["fully_shard", mode]["memory_per_rank"][0]["grad_bytes"] < 0.75 * ddp_grads


# Default run: GPT-2's fused, tied model under DDP, Llama under fully_shard; the rest is slow.
HF_DEFAULT = [("gpt2", "ddp", "lora"), ("llama", "fully_shard", "lora")]
HF_ALL = [
    (arch, strategy, mode)
    for arch in ("gpt2", "llama")
    for strategy in ("ddp", "fully_shard")
    for mode in finetune.MODES
]


def hf_configs(tmp_path, combos, **fields):
    return [
        with_fields(
            CFG,
            arch=arch,
            strategy=strategy,
            mode=mode,
            checkpoint_dir=str(tmp_path / "-".join((arch, strategy, mode, *fields.values()))),
            **fields,
        )
        for arch, strategy, mode in combos
    ]


def assert_hf_parity(configs, results):
    for cfg, result in zip(configs, results):
        assert_fine_tuned_like_one_process(result, cfg)
        if cfg.mode == "lora":
            assert_checkpoint_reloads(result, cfg)


def hf_parity(tmp_path, combos):
    configs = hf_configs(tmp_path, combos)
    assert_hf_parity(configs, run_world(recipe_result, 2, configs, deadline_s=580))


# peft's LoRA (--lora-impl peft) on the same two: GPT-2's fused, tied Conv1D under DDP, Llama's
# q/k/v/o_proj under fully_shard.
PEFT_DEFAULT = HF_DEFAULT
HAS_PEFT = importlib.util.find_spec("peft") is not None
needs_peft = pytest.mark.skipif(not HAS_PEFT, reason="peft's LoRA needs: pip install peft")


@pytest.fixture(scope="module")
def hf_default_world(tmp_path_factory):
    """The default run's Hugging Face models in ONE spawned world: the hand-written LoRA of
    HF_DEFAULT and, with peft installed, peft's of PEFT_DEFAULT (a second world costs ~3 CPU s
    more). Returns [(config, rank 0's result)] for each."""
    tmp = tmp_path_factory.mktemp("finetune-hf")
    hand = hf_configs(tmp, HF_DEFAULT)
    peft = hf_configs(tmp, PEFT_DEFAULT, lora_impl="peft") if HAS_PEFT else []
    results = run_world(recipe_result, 2, hand + peft, deadline_s=580)
    return list(zip(hand, results[: len(hand)])), list(zip(peft, results[len(hand) :]))


@needs_transformers
@pytest.mark.xdist_group("finetune_hf")  # one worker, one world for both tests
@pytest.mark.timeout(600)
def test_gpt2_and_llama_equal_one_process(hf_default_world):
    """GPT-2: LoRA on the fused qkv Conv1D, under DDP; Llama: on q/k/v/o_proj, under fully_shard."""
    hand, _ = hf_default_world
    assert_hf_parity(*zip(*hand))


@needs_transformers
@pytest.mark.slow  # the other 14 mode x strategy pairs of both models: over a minute on 2 cores
@pytest.mark.timeout(600)
def test_gpt2_and_llama_every_mode_and_strategy(tmp_path):
    hf_parity(tmp_path, [combo for combo in HF_ALL if combo not in HF_DEFAULT])


def peft_to_hand(name: str) -> str:
    """A peft parameter's name as the hand-written LoRA's: ``base_model.model.X.base_layer.weight``
    -> ``X.base.weight``, ``X.lora_A.default.weight`` -> ``X.lora_a``; the rest keep theirs."""
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".base.")
    return re.sub(r"\.lora_([AB])\.default\.weight$", lambda m: f".lora_{m[1].lower()}", name)


@needs_transformers
@needs_peft
@pytest.mark.xdist_group("finetune_hf")
# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing: theirs, not ours
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.timeout(600)
def test_peft_lora_equals_hand_written_lora_and_sends_no_frozen_gradient(hf_default_world):
    """peft's get_peft_model, under DDP (GPT-2) and fully_shard (Llama) on 2 ranks, equals the
    hand-written LoRA on one process started from peft's A (same rank, alpha, targets, kaiming A
    and zero B; peft draws A in another order): the losses and every final weight within 1e-5
    (measured: bit for bit, torch 2.13 CPU). assert_fine_tuned_like_one_process also asserts that
    frozen parameters have no gradient on any rank and no AdamW state, and that DDP all-reduces
    the adapters' bytes alone (a comm hook's count). Then the checkpoints reload."""
    _, peft_runs = hf_default_world
    for cfg, result in peft_runs:
        peft_model, _ = finetune.adapt(cfg, "lora")  # the recipe's own seeded get_peft_model
        assert type(peft_model).__name__ == "PeftModel"
        assert result.extras["trainable_names"] == [
            n for n, p in peft_model.named_parameters() if p.requires_grad
        ]  # the run trained peft's lora_A / lora_B, not the hand-written LoRA's
        initial = dict(peft_model.named_parameters())
        assert all(not p.any() for n, p in initial.items() if ".lora_B." in n)  # B starts at zero
        lora_a = {
            peft_to_hand(n).removesuffix(".lora_a"): p.detach()
            for n, p in initial.items()
            if ".lora_A." in n
        }
        as_hand = dataclasses.replace(
            result,
            final_state={peft_to_hand(n): t for n, t in result.final_state.items()},
            extras={
                **result.extras,
                "trainable_names": [peft_to_hand(n) for n in result.extras["trainable_names"]],
            },
        )
        assert_fine_tuned_like_one_process(as_hand, cfg, lora_a=lora_a)
        assert_peft_checkpoint_reloads(result, as_hand.final_state, cfg)


def assert_peft_checkpoint_reloads(result, hand_final, cfg):
    """trainable.pt (get_peft_model_state_dict) alone, set on a fresh get_peft_model whose A had
    other draws, gives the trained logits bit for bit; merged.pt (merge_and_unload) loads strictly
    into the plain class, gives them within 1e-5, and equals merge_lora of the hand-written LoRA
    with the same final weights within 1e-5 (measured: bit for bit)."""
    from peft import set_peft_model_state_dict

    lora = {"targets": finetune.lora_patterns(cfg), "rank": cfg.lora_rank, "alpha": cfg.lora_alpha}
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    trained = finetune.add_peft_lora(finetune.build_arch(cfg.arch, seed=cfg.seed), **lora)
    assert not trained.load_state_dict(result.final_state, strict=False).unexpected_keys
    expected = finetune.logits_of(trained(tokens))

    adapters = torch.load(os.path.join(cfg.checkpoint_dir, "trainable.pt"))
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    base = finetune.add_peft_lora(finetune.build_arch(cfg.arch, seed=cfg.seed), seed=123, **lora)
    assert not set_peft_model_state_dict(base, adapters).unexpected_keys
    torch.testing.assert_close(finetune.logits_of(base(tokens)), expected, atol=0, rtol=0)

    merged = torch.load(os.path.join(cfg.checkpoint_dir, "merged.pt"))
    plain = finetune.build_arch(cfg.arch, seed=cfg.seed + 99)  # other weights: all must load
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(finetune.logits_of(plain(tokens)), expected, atol=1e-5, rtol=0)
    hand = finetune.build_arch(cfg.arch, seed=cfg.seed)
    finetune.add_lora(hand, targets=lora["targets"], rank=cfg.lora_rank, alpha=cfg.lora_alpha)
    finetune.load_trainable(hand, hand_final)
    assert_states_close(merged, finetune.merge_lora(hand).state_dict(), atol=1e-5)


def test_ddp_frozen_after_wrapping_fails_frozen_before_needs_no_find_unused():
    from torch.nn.parallel import DistributedDataParallel as DDP

    tokens = torch.randint(0, 64, (2, 16))
    with join_world("gloo"):
        late = DDP(build_model("tiny"))
        finetune.freeze_for(late.module, "head", head=("output",))  # too late: buckets are built
        lm_loss(late(tokens), tokens).backward()
        with pytest.raises(RuntimeError, match="find_unused_parameters=True"):
            lm_loss(late(tokens), tokens).backward()
        model = build_model("tiny")
        finetune.freeze_for(model, "head", head=("output",))
        early = DDP(model)  # find_unused_parameters=False, the default
        for _ in range(2):
            lm_loss(early(tokens), tokens).backward()
        assert all((p.grad is None) != p.requires_grad for p in model.parameters())


def test_classic_fsdp_mixed_requires_grad_in_one_unit_needs_use_orig_params():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def adapted():
        model = build_model("tiny")
        finetune.add_lora(model, targets=("*.attn.w[qkvo]",), rank=2, alpha=4.0)
        finetune.freeze_for(model, "lora")  # each Block unit: frozen base + trainable adapters
        return model

    wrap = {"auto_wrap_policy": ModuleWrapPolicy({Block}), "device_id": torch.device("cpu")}
    with join_world("gloo"):
        with pytest.raises(
            ValueError,
            match="has both parameters with requires_grad=True and False.*use_orig_params=False",
        ):
            FSDP(adapted(), use_orig_params=False, **wrap)
        with pytest.warns(UserWarning):  # torch says it keeps more gradient memory this way
            model = FSDP(adapted(), use_orig_params=True, **wrap)
        tokens = torch.randint(0, 64, (2, 16))
        lm_loss(model(tokens), tokens).backward()
        assert all((p.grad is None) != p.requires_grad for p in model.parameters())


def test_bad_input_in_the_functions_says_the_fix(monkeypatch):
    model = build_model("tiny")
    with pytest.raises(TuningError, match=r"LoRA rank must be >= 1, got 0"):
        finetune.add_lora(model, targets=("*.attn.wq",), rank=0, alpha=1.0)
    with pytest.raises(
        TuningError,
        match=r"match no module of TransformerLM; its linear layers "
        r"are called output, w_in, w_out, wk, wo, wq, wv",
    ):
        finetune.add_lora(model, targets=("*.q_proj",), rank=2, alpha=1.0)
    with pytest.raises(TuningError, match=r"layers.0.attn, which is not a Linear or Conv1D"):
        finetune.add_lora(model, targets=("*.attn",), rank=2, alpha=1.0)
    with pytest.raises(
        TuningError,
        match=r"last_k=3, but TransformerLM has 2 blocks \(Block\); "
        r"use 1 to 2",
    ):
        finetune.freeze_for(model, "partial", head=("output",), block_types=(Block,), last_k=3)
    with pytest.raises(TuningError, match="found no LoRA adapter; call add_lora"):
        finetune.freeze_for(model, "lora")
    with pytest.raises(TuningError, match=r"missing \['lm_head'\]"):
        finetune.freeze_for(model, "head", head=("lm_head",))
    with pytest.raises(TuningError, match="keys not in the model: layers.0.attn.wq.lora_a"):
        finetune.load_trainable(model, {"layers.0.attn.wq.lora_a": torch.zeros(2, 32)})
    # peft's path: add_lora's matching and refusals (before peft is imported), and one line
    # naming the install when peft is missing
    with pytest.raises(TuningError, match=r"match no module of TransformerLM"):
        finetune.add_peft_lora(model, targets=("*.q_proj",), rank=2, alpha=1.0)
    monkeypatch.setitem(sys.modules, "peft", None)  # what import sees without peft installed
    with pytest.raises(TuningError, match=r"^--lora-impl peft needs peft: pip install peft$"):
        finetune.add_peft_lora(model, targets=("*.attn.wq",), rank=2, alpha=1.0)


def test_bad_config_is_refused_before_any_work():
    # the declared limits (recipes/options.py): a ValueError, one line
    with pytest.raises(ValueError, match="lora_rank must be .*>= 1, got 0"):
        finetune.FinetuneConfig(lora_rank=0)
    with pytest.raises(ValueError, match="last_k must be .*>= 1, got 0"):
        finetune.FinetuneConfig(last_k=0)
    # contradictory options: targets for adapters that another mode would silently not add
    with pytest.raises(TuningError, match=r"lora_targets='\*.attn.wq' applies to mode lora"):
        finetune.FinetuneConfig(mode="full", lora_targets="*.attn.wq")


# argparse's usage lines, and runpy's warning where the test harness forks a process that has
# imported the recipe already (tests/helpers.py run_cli): not a user's stderr
NOT_THE_ERROR = ("usage:", " ", "<frozen runpy>")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--lora-targets", "*.nope"],
            "error: LoRA targets ('*.nope',) match no module of "
            "TransformerLM; its linear layers are called output",
        ),
        # The same path (TuningError -> one line, exit 2), already shown for the functions above.
        pytest.param(
            ["--lora-rank", "0"],
            "error: lora_rank must be a whole number >= 1, got 0",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--mode", "partial", "--last-k", "3"],
            "error: last_k=3, but TransformerLM has 2 blocks",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_bad_command_line_fails_in_one_line(args, message):
    proc = run_cli([PYTHON, "-m", "recipes.finetune", "--steps", "1", *args], timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message.removeprefix("error: ") in proc.stderr and "Traceback" not in proc.stderr
    # one line, after argparse's usage where the config refused the value
    lines = [x for x in proc.stderr.strip().splitlines() if not x.startswith(NOT_THE_ERROR)]
    assert len(lines) == 1, proc.stderr


def test_a_file_where_the_checkpoint_folder_goes_fails_in_one_line(tmp_path):
    """Refused before training (it failed in makedirs after it, in a traceback), on every rank."""
    a_file = tmp_path / "trained"
    a_file.write_text("a file, not a folder")
    proc = run_cli(
        [PYTHON, "-m", "recipes.finetune", "--steps", "1", "--checkpoint-dir", str(a_file)],
        timeout_s=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    *usage, line = proc.stderr.strip().splitlines()  # the config refuses it: argparse's usage
    usage = [text for text in usage if not text.startswith("<frozen runpy>")]
    assert line == (
        f"python -m recipes.finetune: error: --checkpoint-dir {a_file} is a file; name a "
        "directory (created if missing)"
    )
    assert all(text.startswith(("usage:", " ")) for text in usage), usage
    assert not re.search(r"^step \d", proc.stdout, re.M)  # no training happened first
    with pytest.raises(TuningError, match=f"--checkpoint-dir {a_file}/run: {a_file} is a file"):
        finetune.train(with_fields(CFG, checkpoint_dir=str(a_file / "run"), backend="gloo"))
    with pytest.raises(TuningError, match=f"--checkpoint-dir {a_file} is a file"):
        finetune.FinetuneConfig(checkpoint_dir=str(a_file))  # from code: the same refusal


# Slow: a torchrun launch (torchrun and its workers each import torch: ~10 s of CPU).
# The same code runs in a spawned world in the default run; test_ddp_torchrun, test_elastic
# and test_multinode cover the launch path itself there.
@pytest.mark.slow
def test_torchrun_launch_equals_single_process(tmp_path):
    # The recipe prints its steps only: the harness around it prints the result line.
    launched = run_cli(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.core.prove",
            "finetune",
            "--strategy",
            "fully_shard",
            "--precision",
            "fp32",
            "--steps",
            "2",
            "--checkpoint-dir",
            str(tmp_path),
        ],
        timeout_s=170,
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    result = last_json(launched.stdout)
    losses, *_ = reference(with_fields(CFG, steps=2))
    assert result["world_size"] == 2 and result["extras"]["mode"] == "lora"
    assert_losses_close(result["losses"], losses, atol=1e-5)
    assert result["tokens_per_second"] > 0 and result["mfu"] is None
    assert sorted(os.listdir(tmp_path)) == ["merged.pt", "trainable.pt"]
    assert len(re.findall(r"^step \d+ loss ", launched.stdout, re.M)) == 2
    assert "[rank1]" not in launched.stdout
