"""``bench.py --parts titan``: torchtitan's Llama trainer beside recipes.job on one GPU (issue 34).

    bash scripts/gpu_setup.sh && PYTHONPATH=. python3 scripts/bench.py --parts titan
    PYTHONPATH=. python3 scripts/bench.py --parts titan --dry-run     # any machine: no training

For each shape (``llama-100m`` and ``llama-1b`` of recipes/_job_model.py), both systems train
for ``STEPS`` steps under ``torchrun --nproc_per_node=1`` on the same token shards (a 16,384-token
BPE over 10 MB of the Python standard library's sources, recipes/data.py), seq 2048, the same global
batch, bf16 (fully_shard's policy: bf16 compute, fp32 reduce, fp32 master weights), per-block
torch.compile plus a compiled loss, no activation checkpointing, AdamW (lr, betas 0.9/0.95, weight
decay 0.1, clip 1.0), linear warmup then cosine to lr/10. Each run is a child process; this one
collects a JSON line from each and writes results/bench/<device>-titan.json.

What differs, and stays so on purpose (each system as its authors configure it): torchtitan's
Llama3Model (fused wqkv, FlexAttention with a causal block mask) against Hugging Face's
LlamaForCausalLM (separate q/k/v, SDPA); torchtitan 0.3.0 captures forward+backward in a CUDA
graph by default (the table says so; if the capture fails, the run is repeated without and the
first error kept); torchtitan decays every parameter, the job matrices only; their inits differ.
The loss after N steps is recorded, not asserted equal. The data does not differ: the torchtitan
run reads the job's windows in the job's order (``ShardWindowsLoader`` below).

One FLOP formula for both, computed here from the measured tokens/s: the job's
``flops_per_token`` (recipes/_job_model.py): 6 x the matmul weights (embeddings excluded, the
output head included, tied or not) + 12 x layers x hidden x seq_len. torchtitan's own
(``get_dense_model_nparams_and_flops``) has the same attention term (6 x layers x heads x 2
head_dim x seq) and counts every non-embedding parameter, the RMSNorm weights too
((2 x layers + 1) x hidden more: 0.02% at 100m); both are recorded, and its MFU as it printed it.

Time on one H200, estimated (not measured yet): shards ~45 s; each run ~20-30 s to start and
build, ~40-60 s to compile; then 30 steps: 100m ~0.07 s a step, 1b ~0.3 s; the job's final
evaluation, DCP checkpoint and weight checksum add ~40 s at 1b: about 7.5 minutes in all.
Tokens/s is over the steps after the first ``WARMUP`` (compilation, allocator warm-up).

How torchtitan 0.3.0 is driven, found in its source: a config is a ``Trainer.Config`` that a
python function returns (its config_registry; no TOML any more), a model flavor a
``Llama3Model.Config`` built with its ``_build_llama3_layers``; ``config.build()`` then
``trainer.train()`` is what ``torchtitan.train.main`` does after parsing. The data enters as a
``ParallelAwareDataloader`` subclass; the tokenizer it insists on building is our shards' own
``tokenizer.json`` (HuggingFaceTokenizer reads it; nothing is tokenized again). Its metrics come
from a logger added to its MetricsProcessor's LoggerContainer: the dict it logs each step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# The shards: recipes/data.py's format, the settings of results/bench/*-job.json's runs.
DATA_DIR = "data/shards_16k"
VOCAB_SIZE = 16384
MAX_BYTES = 10_000_000
SEQ_LEN = 2048
# shape -> (the job's preset, global batch in sequences, peak lr). The batch fits either system
# on an 80 GB H100 without activation checkpointing (estimated: 1b ~60 GB, 100m ~25 GB).
SHAPES = {
    "100m": ("llama-100m", 16, 6e-4),
    "1b": ("llama-1b", 8, 3e-4),
}
STEPS, WARMUP = 30, 10  # WARMUP: steps left out of tokens/s, and the lr's linear warmup
RESULT = "TITAN_BENCH_RESULT "  # the child's JSON line starts with this
RUN_TIMEOUT_S = 300  # one child; a hang must not eat the GPU session's budget


# ---------------------------------------------------------------- shapes and the FLOP formula
def preset(shape: str) -> dict:
    from recipes._job_model import LLAMA_PRESETS

    return LLAMA_PRESETS[SHAPES[shape][0]]


def flops_per_token(shape: str, *, vocab_size: int = VOCAB_SIZE, seq_len: int = SEQ_LEN) -> int:
    """recipes/_job_model.py's formula, from the preset's numbers (no model built): 6 x matmul
    weights (embedding excluded, head included) + 12 x layers x hidden x seq_len."""
    p = preset(shape)
    hidden, layers, ffn = p["hidden_size"], p["num_hidden_layers"], p["intermediate_size"]
    kv = hidden // p["num_attention_heads"] * p["num_key_value_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn  # q, o; k, v; mlp
    matmul = layers * per_layer + hidden * vocab_size  # + the output head
    return 6 * matmul + 12 * layers * hidden * seq_len


def parameter_count(shape: str, *, vocab_size: int = VOCAB_SIZE) -> int:
    p = preset(shape)
    hidden, layers = p["hidden_size"], p["num_hidden_layers"]
    kv = hidden // p["num_attention_heads"] * p["num_key_value_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * p["intermediate_size"]
    heads = 1 if p["tie_word_embeddings"] else 2  # embedding, and an untied head
    return layers * (per_layer + 2 * hidden) + hidden + heads * hidden * vocab_size


# ---------------------------------------------------------------- the job's side
def job_overrides(shape: str, *, steps: int, warmup: int, data_dir: str, out_dir: str) -> dict:
    """recipes.job's config keys for one shape (the flags the child passes to load_config)."""
    model, batch, lr = SHAPES[shape]
    return dict(
        model=model,
        seq_len=SEQ_LEN,
        data_dir=data_dir,
        vocab_size=VOCAB_SIZE,
        max_bytes=MAX_BYTES,
        prepare=False,
        num_workers=2,
        parallelism="fsdp",
        precision="bf16",
        activation_checkpointing=False,
        compile=True,
        steps=steps,
        global_batch_size=batch,
        accumulation=1,
        lr=lr,
        min_lr=lr / 10,
        warmup_steps=warmup,
        clip=1.0,
        eval_every=steps,
        eval_windows=8,
        checkpoint_every=steps,
        keep=1,
        out_dir=out_dir,
        tensorboard=False,
        log_every=5,
    )


def run_job(shape: str, *, steps: int, warmup: int, data_dir: str, out_dir: str) -> dict:
    """In the torchrun child: recipes.job.train, then what it cannot say of itself."""
    import torch

    from recipes import job

    cfg = job.load_config(
        None, job_overrides(shape, steps=steps, warmup=warmup, data_dir=data_dir, out_dir=out_dir)
    )
    result = job.train(cfg)
    cuda = torch.cuda.is_available()
    per_step = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return {
        "tokens_per_s_by_step": [row["tokens_per_s"] for row in per_step],
        "losses": result["losses"],
        "params": result["model_params"],
        "own_flops_per_token": result["flops_per_token"],
        "own_mfu": result["mfu"],
        # the whole run's peaks (the first step's compile and the evaluations included)
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


# ---------------------------------------------------------------- torchtitan's side
def titan_model_spec(shape: str, vocab_size: int):
    """A torchtitan ModelSpec with the preset's shape: its Llama3Model, its parallelize_llama.
    hidden_dim is given as the preset's intermediate_size (torchtitan's compute_ffn_hidden_dim
    with multiple_of 256 gives 2048 at 768, with multiple_of 1024 and x1.5 gives 8192 at 2048:
    the same numbers). RoPE without Llama-3.1 scaling, as Hugging Face's LlamaConfig default."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models import llama3 as tt
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.protocols.model_spec import ModelSpec

    p = preset(shape)
    dim, heads = p["hidden_size"], p["num_attention_heads"]
    tied = p["tie_word_embeddings"]
    config = tt.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size,
            embedding_dim=dim,
            param_init=tt._EMBEDDING_SKIP_INIT if tied else tt._EMBEDDING_INIT,
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tt._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab_size, param_init=tt._output_linear_init(dim)
        ),
        layers=tt._build_llama3_layers(
            n_layers=p["num_hidden_layers"],
            dim=dim,
            n_heads=heads,
            n_kv_heads=p["num_key_value_heads"],
            hidden_dim=p["intermediate_size"],
            rope=ComplexRoPE.Config(
                dim=dim // heads,
                max_seq_len=p["max_position_embeddings"],
                theta=p.get("rope_theta", 10_000.0),
                scaling="none",
            ),
            attn_backend="flex",  # model_registry's default; sdpa is refused for LMs in 0.3.0
        ),
    )
    return ModelSpec(
        name="llama3",
        flavor=f"cookbook-{shape}",
        model=config,
        parallelize_fn=tt.parallelize_llama,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,  # no checkpoint, no Hugging Face weights: nothing to convert
    )


def shard_windows_loader():
    """The job's data for torchtitan: recipes.data.TokenWindows in recipes.job.GlobalBatches'
    order, epoch after epoch, as ({"input", "positions"}, labels) batches. positions 0..seq-1 in
    every row: one document a window, so its block-causal mask is the plain causal one."""
    from dataclasses import dataclass

    import torch
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from recipes.data import TokenWindows
    from recipes.job import GlobalBatches

    class Windows(torch.utils.data.Dataset):
        def __init__(self, data_dir: str, seq_len: int):
            self.windows = TokenWindows(data_dir, "train", seq_len)
            self.positions = torch.arange(seq_len)

        def __len__(self) -> int:
            return len(self.windows)

        def __getitem__(self, i: int):
            inputs, labels = self.windows[i]
            return {"input": inputs, "positions": self.positions}, labels

    class Epochs(torch.utils.data.Sampler):
        def __init__(self, batches: GlobalBatches):
            self.batches = batches

        def __iter__(self):
            for epoch in range(1_000_000):
                self.batches.set_position(epoch, 0)
                yield from self.batches

    class ShardWindowsLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            seed: int = 0

        def __init__(self, config, *, dp_world_size, dp_rank, seq_len, local_batch_size, **_):
            windows = Windows(config.dataset_path, seq_len)
            order = GlobalBatches(
                len(windows),
                local_batch_size * dp_world_size,
                dp_rank=dp_rank,
                dp_size=dp_world_size,
                seed=config.seed,
            )
            super().__init__(
                windows,
                dp_rank=dp_rank,
                dp_world_size=dp_world_size,
                batch_sampler=Epochs(order),
                num_workers=config.num_workers,
                persistent_workers=config.num_workers > 0,
                pin_memory=config.pin_memory,
            )

    return ShardWindowsLoader


def titan_config(
    shape: str, *, steps: int, warmup: int, data_dir: str, out_dir: str, cuda_graphs: bool = True
):
    """torchtitan's Trainer.Config for one shape: what a config_registry function returns.
    ``cuda_graphs``: 0.3.0 captures forward+backward in a CUDA graph unless told not to."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.trainer import Trainer

    _, batch, lr = SHAPES[shape]
    vocab = json.load(open(os.path.join(data_dir, "index.json")))["vocab_size"]
    return Trainer.Config(
        model_spec=titan_model_spec(shape, vocab),
        hf_assets_path=data_dir,  # the shards' tokenizer.json: built, never used to encode
        dump_folder=out_dir,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)),
        optimizer=default_adamw(lr=lr),  # AdamW, betas (0.9, 0.95), weight decay 0.1, fused
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=warmup, decay_type="cosine", min_lr_factor=0.1
        ),
        # bf16 params and fp32 reduce under fully_shard are TrainingConfig's defaults
        training=TrainingConfig(
            local_batch_size=batch,
            seq_len=SEQ_LEN,
            steps=steps,
            max_norm=1.0,
            disable_cuda_graphs=not cuda_graphs,
        ),
        dataloader=shard_windows_loader().Config(dataset_path=data_dir, num_workers=2),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        compile=CompileConfig(enable=True),  # components: model (per block) and loss
        activation_checkpoint=None,
        checkpoint=CheckpointManager.Config(enable=False),
        debug=DebugConfig(seed=0, enable_structured_logging=False),
    )


def run_titan(
    shape: str, *, steps: int, warmup: int, data_dir: str, out_dir: str, cuda_graphs: bool = True
) -> dict:
    """In the torchrun child: what torchtitan.train.main does, with our config, and a logger in
    its MetricsProcessor that keeps each step's metrics."""
    import torch
    from torchtitan.tools.logging import init_logger

    init_logger()
    cfg = titan_config(
        shape,
        steps=steps,
        warmup=warmup,
        data_dir=data_dir,
        out_dir=out_dir,
        cuda_graphs=cuda_graphs,
    )
    logged: list[dict] = []

    class Keep:
        def log(self, metrics: dict, step: int) -> None:
            logged.append({"step": step, **metrics})

        def close(self) -> None:
            pass

    trainer = cfg.build()
    try:
        trainer.metrics_processor.logger.add_logger(Keep())
        trainer.train()
        metrics = trainer.metrics_processor
        own = {"flops_per_token": metrics.num_flops_per_token, "peak": metrics.gpu_peak_flops}
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    timed = logged[warmup:] or logged
    return {
        "tokens_per_s_by_step": [row["throughput(tps)"] for row in logged],
        "losses": [row["loss_metrics/global_avg_loss"] for row in logged],
        "params": sum(p.numel() for part in trainer.model_parts for p in part.parameters()),
        "own_flops_per_token": own["flops_per_token"],
        "own_mfu": sum(row.get("mfu(%)", 0) for row in timed) / len(timed) / 100,
        "own_peak_flops": own["peak"],
        "peak_reserved_gib": max(row["memory/max_reserved(GiB)"] for row in logged),
        "peak_allocated_gib": max(row["memory/max_active(GiB)"] for row in logged),
    }


# ---------------------------------------------------------------- the parent: runs and results
def commands(shapes, *, steps: int, warmup: int, data_dir: str, work: str) -> list[tuple]:
    """(shape, system, argv) for each run, in the order they run."""
    runs = []
    for shape in shapes:
        for system in ("job", "titan"):
            runs.append(
                (
                    shape,
                    system,
                    [
                        # torchrun, from this Python (a venv's bin may not be on PATH)
                        *(sys.executable, "-m", "torch.distributed.run"),
                        *("--standalone", "--nproc_per_node=1"),
                        os.path.abspath(__file__),
                        *(system, "--shape", shape, "--steps", str(steps)),
                        *("--warmup", str(warmup), "--data-dir", data_dir),
                        *("--out-dir", os.path.join(work, f"{system}-{shape}")),
                    ],
                )
            )
    return runs


def prepare_command(data_dir: str) -> list[str]:
    return [
        *(sys.executable, "-m", "recipes.data", "--steps", "0", "--data-dir", data_dir),
        *("--vocab-size", str(VOCAB_SIZE), "--max-bytes", str(MAX_BYTES)),
    ]


def summarize(raw: dict, shape: str, *, warmup: int, peak_flops: float | None) -> dict:
    """Tokens/s over the steps after ``warmup`` (total tokens over total time), MFU with the
    job's formula for both systems, the last loss."""
    _, batch = SHAPES[shape][:2]
    rates = raw["tokens_per_s_by_step"][warmup:] or raw["tokens_per_s_by_step"]
    seconds = sum(batch * SEQ_LEN / r for r in rates)
    tokens_per_s = len(rates) * batch * SEQ_LEN / seconds
    flops = flops_per_token(shape)
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops / peak_flops if peak_flops else None,
        "peak_reserved_gib": raw["peak_reserved_gib"],
        "peak_allocated_gib": raw["peak_allocated_gib"],
        "loss_first": raw["losses"][0],
        "loss_last": raw["losses"][-1],
        "steps_timed": len(rates),
        "params": raw["params"],
        "own_flops_per_token": raw["own_flops_per_token"],
        "own_mfu": raw["own_mfu"],
    }


def versions() -> dict:
    import importlib.metadata as md

    import torch

    found = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        found["torchtitan"] = md.version("torchtitan")
    except md.PackageNotFoundError:
        found["torchtitan"] = None
    return found


def titan_importable() -> str | None:
    """None if torchtitan's trainer imports here, else why not (one line)."""
    from importlib.util import find_spec

    if find_spec("torchtitan") is None:
        return "torchtitan is not installed (pip install -e '.[titan]', or scripts/gpu_setup.sh)"
    if find_spec("triton") is None:  # asked first: the failing import below costs ~8 CPU s
        return "torchtitan 0.3.0 imports triton (models.common), which this torch build lacks"
    try:
        import torchtitan.trainer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or triton's own on a CPU build
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return None


def run(
    *,
    steps: int = STEPS,
    warmup: int = WARMUP,
    shapes=tuple(SHAPES),
    data_dir: str = DATA_DIR,
    out: str = "",
    dry_run: bool = False,
) -> int:
    import torch

    if steps <= warmup:
        print(f"error: steps {steps} must exceed warmup {warmup}", file=sys.stderr)
        return 2
    on_gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if on_gpu else f"CPU ({platform.processor() or '?'})"
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    path = out or os.path.join(REPO, "results", "bench", f"{slug}-titan.json")
    work = tempfile.mkdtemp(prefix="titan-bench-")
    try:
        runs = commands(shapes, steps=steps, warmup=warmup, data_dir=data_dir, work=work)
        print(f"# torchtitan vs recipes.job on {device}; {versions()}", flush=True)
        for shape in shapes:
            model, batch, lr = SHAPES[shape]
            print(
                f"## {shape}: {model}, {parameter_count(shape):,} parameters with a "
                f"{VOCAB_SIZE} vocabulary, global batch {batch} x {SEQ_LEN}, lr {lr}, "
                f"{steps} steps ({warmup} left out of tokens/s), flops_per_token "
                f"{flops_per_token(shape):,}",
                flush=True,
            )
        have_shards = os.path.exists(os.path.join(data_dir, "index.json"))
        if dry_run:
            return dry(runs, shapes, data_dir, have_shards, steps, warmup, work)
        if not on_gpu:
            print("error: --parts titan trains on a GPU; here use --dry-run", file=sys.stderr)
            return 2
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if not have_shards:
            print("$ " + " ".join(prepare_command(data_dir)), flush=True)
            subprocess.run(prepare_command(data_dir), cwd=REPO, env=env, check=True)
        peak = _peak_flops()
        report = {
            "what": (
                "torchtitan's Llama trainer and recipes.job on one GPU (torchrun, 1 process), "
                f"the same shapes, token shards and global batch; seq {SEQ_LEN}, bf16 under "
                "fully_shard, per-block compile and a compiled loss, no activation "
                f"checkpointing; {steps} steps, tokens/s over the last {steps - warmup}"
            ),
            "device": device,
            **versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seq_len": SEQ_LEN,
            "steps": steps,
            "warmup_steps": warmup,
            "data": " ".join(prepare_command(DATA_DIR)[1:]),
            "flop_formula": (
                "6 x matmul weights (embeddings excluded, output head included) + "
                "12 x layers x hidden x seq_len (recipes/_job_model.py), for both systems"
            ),
            "peak_flops": peak,
            "shapes": {},
        }
        for shape, system, argv in runs:
            model, batch, lr = SHAPES[shape]
            entry = report["shapes"].setdefault(
                shape,
                {
                    "preset": model,
                    "global_batch_size": batch,
                    "lr": lr,
                    "flops_per_token": flops_per_token(shape),
                },
            )
            print("$ " + " ".join(argv), flush=True)
            entry[system] = child(argv, env, shape, warmup, peak)
            if system == "titan":  # its default captures a CUDA graph: without, if that failed
                entry[system]["cuda_graphs"] = "failed" not in entry[system]
                if "failed" in entry[system]:
                    first = entry[system]["failed"]
                    print(f"torchtitan failed ({first}); again with --no-cuda-graphs", flush=True)
                    entry[system] = child([*argv, "--no-cuda-graphs"], env, shape, warmup, peak)
                    entry[system].update(cuda_graphs=False, first_try=first)
            print(json.dumps({shape: {system: entry[system]}}), flush=True)
            write(path, report)  # after each run: a later hang keeps the earlier numbers
        print(table(report))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def child(argv, env, shape: str, warmup: int, peak) -> dict:
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {RUN_TIMEOUT_S} s"}
    sys.stderr.write(proc.stderr[-4000:])
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {"failed": f"exit {proc.returncode}: {tail}"}
    row = summarize(json.loads(lines[-1][len(RESULT) :]), shape, warmup=warmup, peak_flops=peak)
    return {**row, "wall_s": time.perf_counter() - started}


def _peak_flops() -> float | None:
    import torch

    from recipes.core.throughput import peak_flops

    return peak_flops(torch.device("cuda", 0), "bf16")


def dry(runs, shapes, data_dir, have_shards, steps, warmup, work) -> int:
    """Build what can be built without a GPU, and print what would run."""
    from recipes import job

    if not have_shards:
        print("$ " + " ".join(prepare_command(data_dir)) + "   # would prepare the shards")
    for shape in shapes:
        over = job_overrides(shape, steps=steps, warmup=warmup, data_dir=data_dir, out_dir=work)
        cfg = job.JobConfig(**over)  # its own checks: the preset, seq_len, the schedule
        print(f"job {shape}: JobConfig ok ({cfg.model}, {cfg.parallelism}, {cfg.precision})")
    why = titan_importable()
    if why:
        print(f"torchtitan config: not built here ({why})")
    elif have_shards:
        for shape in shapes:
            cfg = titan_config(shape, steps=steps, warmup=warmup, data_dir=data_dir, out_dir=work)
            layers = cfg.model_spec.model.layers
            print(f"torchtitan {shape}: Trainer.Config ok ({len(layers)} layers)")
    for _, _, argv in runs:
        print("$ " + " ".join(argv))
    return 0


def write(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as file:
        json.dump(report, file, indent=1)
    print(f"wrote {path}", flush=True)


def table(data: dict) -> str:
    """The markdown table of a <device>-titan.json (the docs page renders it too)."""
    lines = [
        "| shape | system | tokens/s | MFU (our formula) | MFU (as torchtitan counts) "
        "| peak reserved GiB | loss after N steps |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {"job": "recipes.job", "titan": "torchtitan"}
    for shape, entry in data["shapes"].items():
        for system in ("job", "titan"):
            row = entry.get(system)
            if row is None:
                continue
            label = f"{shape} (batch {entry['global_batch_size']})"
            if "failed" in row:
                lines.append(f"| {label} | {names[system]} | failed: {row['failed']} ||||")
                continue
            own = row["own_mfu"] if system == "titan" else None
            if system == "titan" and row.get("cuda_graphs"):
                label += ", CUDA graph"
            lines.append(
                f"| {label} | {names[system]} | {row['tokens_per_s']:,.0f} | "
                f"{_pct(row['mfu'])} | {_pct(own)} | {_gib(row['peak_reserved_gib'])} | "
                f"{row['loss_last']:.3f} |"
            )
    return "\n".join(lines)


def _gib(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


# ---------------------------------------------------------------- the torchrun child
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one run of bench.py --parts titan (a child)")
    parser.add_argument("system", choices=["job", "titan"])
    parser.add_argument("--shape", choices=list(SHAPES), required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--data-dir", default=DATA_DIR)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="titan: no CUDA graph")
    args = parser.parse_args(argv)
    where = dict(steps=args.steps, warmup=args.warmup, data_dir=args.data_dir)
    if args.system == "job":
        raw = run_job(args.shape, **where, out_dir=args.out_dir)
    else:
        cuda_graphs = not args.no_cuda_graphs
        raw = run_titan(args.shape, **where, out_dir=args.out_dir, cuda_graphs=cuda_graphs)
    print(RESULT + json.dumps(raw), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
