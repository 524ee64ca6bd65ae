"""The functions a user copies stand alone (issue 21).

Each ``apply_*`` function is extracted with ``ast`` from its module, alone: the function, the
module-level definitions it uses (helpers, error classes, constants: recursively) and the import
lines those use. An import from our package is not copied: that is the point. A copyable function
may compose another one (``apply_tp_and_fsdp`` calls ``apply_tp`` and ``apply_fully_shard``): that
one is extracted with it, as a user would copy both.

The extracted files run in ONE interpreter (``python -I -S``: no script directory, no
environment, no site-packages hooks, so our editable install cannot put ``recipes`` back on the
path; torch's own folder is added by hand) with the toy model copied beside them, in a gloo world of
one rank on an in-memory store: a happy path for each function, and one refusal, which must be a
ValueError subclass defined in the extracted code, with a one-line message.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.deadlines import scaled
from tests.helpers import REPO_ROOT

# Each copyable function, with the ready-made values beside it: label -> (module, names). Those in
# recipes/parallelize.py are extracted one group at a time, not as the whole module: each copies
# alone.
PARALLELIZE = "recipes.parallelize"
COPYABLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "activation_checkpointing": (PARALLELIZE, ("apply_activation_checkpointing",)),
    "fsdp2": (PARALLELIZE, ("apply_fully_shard",)),
    "fsdp": (PARALLELIZE, ("apply_fsdp",)),
    "tensor_parallel": (
        PARALLELIZE,
        ("apply_tp", "transformer_lm_plan", "llama_plan", "check_heads_divide", "check_tp_fits"),
    ),
    "speed": (PARALLELIZE, ("apply_compile",)),
    "expert_parallel": ("recipes.expert_parallel", ("apply_ep", "MoE", "check_ep_fits")),
    "float8": ("recipes.float8", ("apply_float8", "float8_filter")),
    "hybrid_parallel": (PARALLELIZE, ("apply_tp_and_fsdp",)),
}
# The error class each one defines beside itself (checked to be there, a ValueError, documented).
ERRORS = {
    "activation_checkpointing": "CheckpointingError",
    "fsdp2": "ShardingError",
    "fsdp": "FSDPWrapError",
    "tensor_parallel": "TPPlanError",
    "speed": "CompileTargetError",
    "expert_parallel": "ExpertParallelError",
}
COMPOSABLE = {name for _, names in COPYABLE.values() for name in names}


def source_path(module: str) -> Path:
    return Path(REPO_ROOT) / (module.replace(".", "/") + ".py")


@functools.cache
def parsed(module: str) -> tuple[str, ast.Module]:
    """A module's source and its tree, parsed once per test process: an extraction visits a
    module once per name it follows (recipes/parallelize.py dozens of times), and parsing it each
    time was most of this file's CPU. Read-only: nothing here changes a tree."""
    text = source_path(module).read_text()
    return text, ast.parse(text)


class Extraction:
    """The code a user copies for some functions: imports first, then definitions in source order,
    module by module (a composed module before the one that uses it). ``package_uses`` lists every
    name the code would need from our package: it must stay empty."""

    def __init__(self) -> None:
        self.modules: list[str] = []  # in the order their code must run
        self.wanted: dict[str, set[str]] = {}
        self.imports: dict[str, list[str]] = {}
        self.package_uses: list[str] = []

    def add(self, module: str, name: str) -> None:
        if name in self.wanted.setdefault(module, set()):
            return
        self.wanted[module].add(name)
        _, tree = parsed(module)
        definitions, imported = top_level_names(tree)
        if name in imported:
            node, alias = imported[name]
            origin = node.module if isinstance(node, ast.ImportFrom) else alias.name
            if origin == "recipes" or origin.startswith("recipes."):
                self.wanted[module].discard(name)
                if alias.name in COMPOSABLE:  # a copyable function composing another one
                    self.add(origin, alias.name)
                else:
                    self.package_uses.append(f"{module}: {name} from {origin}")
            return
        if name not in definitions:
            return  # a builtin, or a name the module never binds (the run would say NameError)
        for used in names_loaded(definitions[name]):
            if used in definitions or used in imported:
                self.add(module, used)
        if module not in self.modules:
            self.modules.append(module)

    def source(self) -> str:
        lines, seen_imports, defined = ["from __future__ import annotations", ""], set(), {}
        for module in self.modules:
            _, tree = parsed(module)
            _, imported = top_level_names(tree)
            for node in tree.body:
                if (
                    isinstance(node, (ast.Import, ast.ImportFrom))
                    and getattr(node, "module", "") != "__future__"
                ):
                    keep = [
                        a
                        for a in node.names
                        if bound_name(a) in self.wanted[module] and bound_name(a) in imported
                    ]
                    if keep:
                        copy = type(node)(
                            names=keep,
                            **(
                                {"module": node.module, "level": 0}
                                if isinstance(node, ast.ImportFrom)
                                else {}
                            ),
                        )
                        text = ast.unparse(copy)
                        if text not in seen_imports:
                            seen_imports.add(text)
                            lines.append(text)
        lines.append("")
        for module in self.modules:
            text, tree = parsed(module)
            definitions, _ = top_level_names(tree)
            for node in tree.body:
                names = [
                    n for n, d in definitions.items() if d is node and n in self.wanted[module]
                ]
                if not names:
                    continue
                for name in names:  # one namespace: two modules must not define a name twice
                    assert defined.setdefault(name, module) == module, (
                        f"{name} is defined in both {defined[name]} and {module}"
                    )
                first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
                lines += ["", "", "\n".join(text.splitlines()[first - 1 : node.end_lineno])]
        return "\n".join(lines) + "\n"


def bound_name(alias: ast.alias) -> str:
    return alias.asname or alias.name.split(".")[0]


def top_level_names(tree: ast.Module):
    definitions: dict[str, ast.stmt] = {}
    imported: dict[str, tuple[ast.stmt, ast.alias]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            definitions[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        definitions[leaf.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                imported[bound_name(alias)] = (node, alias)
    return definitions, imported


def names_loaded(node: ast.AST) -> set[str]:
    return {
        leaf.id
        for leaf in ast.walk(node)
        if isinstance(leaf, ast.Name) and isinstance(leaf.ctx, ast.Load)
    }


def extract(module: str, names: tuple[str, ...]) -> Extraction:
    extraction = Extraction()
    for name in names:
        extraction.add(module, name)
    return extraction


# Runs in the isolated interpreter, from the folder that holds the extracted files and toy.py.
DRIVER = r'''
import importlib.util, json, sys
sys.path.append(sys.argv[1])  # torch's site-packages, without its .pth hooks (-S)
sys.path.insert(0, ".")  # the user's folder: the copied files
assert importlib.util.find_spec("recipes") is None, "our package is importable here"

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel

import toy

torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
messages = {}


def refused(module, key, call):
    """The refusal is a ValueError subclass of the extracted module, with a one-line message."""
    try:
        call()
    except ValueError as exc:
        cls = type(exc)
        assert cls.__module__ == module.__name__ and getattr(module, cls.__name__) is cls, cls
        assert cls is not ValueError and cls.__doc__, cls
        assert str(exc) and "\n" not in str(exc), str(exc)
        messages[key] = [cls.__name__, str(exc)]
        return
    raise AssertionError(f"{key}: not refused")


def step(model, tokens):
    loss = toy.lm_loss(model(tokens), tokens)
    loss.backward()
    # classic FSDP's names carry its wrapper's prefix
    return loss.item(), {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone()
                         for n, p in model.named_parameters()}


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


tokens = toy.make_dataset("tiny", 4, seed=0)[0][0].unsqueeze(0).repeat(2, 1)
expected_loss, expected_grads = step(toy.build_model("tiny"), tokens)


def same_step(model, atol=1e-6):
    loss, grads = step(model, tokens)
    assert abs(loss - expected_loss) < atol, (loss, expected_loss)
    for name, grad in grads.items():
        assert torch.allclose(full(grad), expected_grads[name], atol=atol), name


import standalone_activation_checkpointing as ac
model = toy.build_model("tiny")
assert len(ac.apply_activation_checkpointing(model, block_types=(toy.Block,))) == 2
same_step(model)
refused(ac, "ac", lambda: ac.apply_activation_checkpointing(nn.Linear(2, 2),
                                                              block_types=(toy.Block,)))

import standalone_speed as speed
model = toy.build_model("tiny")
speed.apply_compile(model, block_types=(toy.Block,), backend="eager")
assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in model.layers.values())
same_step(model)  # the blocks run compiled (Dynamo's eager backend: no compiler needed)
refused(speed, "compile", lambda: speed.apply_compile(nn.Linear(2, 2), block_types=(toy.Block,)))

import standalone_fsdp2 as fsdp2
model = fsdp2.apply_fully_shard(toy.build_model("tiny"), mesh, block_types=(toy.Block,))
assert all(isinstance(p, DTensor) for p in model.parameters())
same_step(model)
refused(fsdp2, "fully_shard", lambda: fsdp2.apply_fully_shard(nn.Linear(2, 2), mesh,
                                                               block_types=(toy.Block,)))

import standalone_fsdp as fsdp
model = fsdp.apply_fsdp(toy.build_model("tiny"), auto_wrap_policy=ModuleWrapPolicy({toy.Block}),
                        device=torch.device("cpu"))
assert type(model.layers["0"]).__name__ == "FullyShardedDataParallel"
same_step(model)
refused(fsdp, "fsdp", lambda: fsdp.apply_fsdp(toy.build_model("tiny"), device=torch.device("cpu"),
                                              auto_wrap_policy=ModuleWrapPolicy({nn.Conv2d})))

import standalone_tensor_parallel as tp
model = tp.apply_tp(toy.build_model("tiny"), mesh, plan=tp.transformer_lm_plan())
assert all(isinstance(p, DTensor) for p in model.parameters())
same_step(model)
assert "lm_head" in tp.llama_plan()
refused(tp, "tp", lambda: tp.apply_tp(toy.build_model("tiny"), mesh,
                                      plan={"nowhere": ColwiseParallel()}))
refused(tp, "heads", lambda: tp.check_heads_divide(2, n_heads=3))
refused(tp, "fits", lambda: tp.check_tp_fits(3, n_heads=4, mlp_width=128, seq_len=15))

import standalone_expert_parallel as ep
torch.manual_seed(0)
moe = ep.MoE(dim=8, hidden=16, num_experts=4, top_k=2)
x = torch.randn(2, 3, 8)
before = moe(x)
assert ep.apply_ep(nn.Sequential(moe), mesh) == [moe]
assert torch.equal(moe(x), before)  # one rank holds every expert
refused(ep, "ep", lambda: ep.apply_ep(nn.Sequential(nn.Linear(2, 2)), mesh))

import standalone_float8 as float8
assert not float8.float8_filter(nn.Linear(32, 32), "output")
assert float8.float8_filter(nn.Linear(32, 32), "layers.0.attn.wq")
if importlib.util.find_spec("torchao") is not None:
    converted = float8.apply_float8(toy.build_model("tiny"))
    assert any(type(m).__name__ == "Float8Linear" for m in converted.modules())

import standalone_hybrid_parallel as hybrid
mesh_2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
model = hybrid.apply_tp_and_fsdp(toy.build_model("tiny"), mesh_2d,
                                 plan=tp.transformer_lm_plan(), block_types=(toy.Block,))
same_step(model)
refused(hybrid, "hybrid", lambda: hybrid.apply_tp_and_fsdp(
    toy.build_model("tiny"), mesh_2d, plan={"nowhere": ColwiseParallel()},
    block_types=(toy.Block,)))

dist.destroy_process_group()
print(json.dumps(messages))
'''


def extracted_sources() -> dict[str, Extraction]:
    return {label: extract(module, names) for label, (module, names) in COPYABLE.items()}


def test_each_copyable_function_extracts_without_our_package():
    for module, extraction in extracted_sources().items():
        assert not extraction.package_uses, (
            f"{module}: the copyable functions use our package: {extraction.package_uses}"
        )
        source = extraction.source()
        assert "recipes" not in {
            n.split(".")[0] for n in re.findall(r"^(?:from|import) ([\w.]+)", source, flags=re.M)
        }, source
        if module in ERRORS:  # the refusals' class sits beside the function, documented
            tree = ast.parse(source)
            (cls,) = [
                n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == ERRORS[module]
            ]
            assert [ast.unparse(b) for b in cls.bases] == ["ValueError"] and ast.get_docstring(cls)


def test_a_package_import_is_found():
    """The check above must see a copyable function that picks up a name from our package."""
    # the harness's check_port_free raises RecipeError (recipes/fsdp.py's hybrid_mesh did, until
    # fsdp became copyable: no recipe imports the harness now, so the example is the harness's)
    extraction = extract("recipes.core.spawn", ("check_port_free",))
    assert extraction.package_uses == ["recipes.core.spawn: RecipeError from recipes.core.errors"]


@pytest.mark.timeout(180)
def test_extracted_functions_run_alone(tmp_path):
    for label, extraction in extracted_sources().items():
        name = "standalone_" + label
        (tmp_path / f"{name}.py").write_text(extraction.source())
    shutil.copy(Path(REPO_ROOT) / "recipes" / "toy.py", tmp_path / "toy.py")
    (tmp_path / "driver.py").write_text(DRIVER)
    site_packages = str(Path(torch.__file__).parent.parent)
    env = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "driver.py", site_packages],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(150),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    messages = json.loads(proc.stdout.strip().splitlines()[-1])
    # The same classes and one-line messages as the package's own functions give.
    from recipes import activation_checkpointing, expert_parallel, parallelize
    from recipes.core.workload import Block

    same = {
        "ac": lambda: activation_checkpointing.apply_activation_checkpointing(
            nn.Linear(2, 2), block_types=(Block,)
        ),
        "compile": lambda: parallelize.apply_compile(nn.Linear(2, 2), block_types=(Block,)),
        "fully_shard": lambda: parallelize.apply_fully_shard(
            nn.Linear(2, 2), None, block_types=(Block,)
        ),
        "ep": lambda: expert_parallel.apply_ep(nn.Sequential(nn.Linear(2, 2)), None),
    }
    for key, call in same.items():
        with pytest.raises(ValueError) as caught:
            call()
        assert messages[key] == [type(caught.value).__name__, str(caught.value)]
    assert messages["fsdp"][0] == "FSDPWrapError"
    assert messages["fsdp"][1].startswith("the FSDP wrap policy matched nothing in TransformerLM")
    assert messages["tp"][0] == messages["hybrid"][0] == messages["heads"][0] == "TPPlanError"
    assert messages["tp"][1].startswith("TP plan key 'nowhere' matches no module of TransformerLM")
    assert messages["hybrid"][1] == messages["tp"][1]
    assert messages["heads"][1] == (
        "3 attention heads do not split over 2 tensor-parallel ranks; "
        "use a tensor-parallel size of 1, 3"
    )
    assert messages["fits"] == [
        "TPPlanError",
        "tensor parallel over 3 ranks cannot split "
        "n_heads=4, mlp_width=128; use a tensor-parallel size of 1",
    ]
