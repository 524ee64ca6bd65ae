"""``<!-- api: module -->``: a module's API reference from its docstrings and signatures;
``<!-- api: package.* -->``: every public module of the package (new modules appear without a docs
edit)."""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil
import pprint
import re
import textwrap
from typing import Any, Callable

from .base import escape, import_module


def render_api(target: str, **_: Any) -> str:
    # every public module of a package: new modules appear without a docs edit
    if target.endswith(".*"):
        package = import_module(target[:-2])
        names = sorted(
            m.name
            for m in pkgutil.iter_modules(package.__path__)
            if not m.ispkg and not m.name.startswith("_")
        )
        return "\n\n".join(_module_api(f"{package.__name__}.{name}") for name in names)
    return _module_api(target)


def _module_api(module_name: str) -> str:
    module = import_module(module_name)
    parts = [f"## `{module_name}` {{ #{module_name} }}\n", _docstring(module.__doc__)]
    for name in _public_names(module):
        obj = getattr(module, name)
        anchor = f"{module_name}.{name}"
        parts.append(f"### `{name}` {{ #{anchor} }}\n")
        if inspect.isclass(obj):
            declaration = _class_declaration(obj)
        elif callable(obj):
            declaration = f"def {name}{_signature(obj)}"
        else:  # a constant: its value (an instance's __doc__ would be its type's, so none is shown)
            declaration = f"{name} = {_value(obj, width=96 - len(name) - 3)}"
        parts.append(f"```python\n{declaration}\n```\n")
        if inspect.isclass(obj) or callable(obj):
            parts.append(_docstring(_own_doc(obj)))
        if inspect.isclass(obj):
            for member_name, member in _public_members(obj):
                parts.append(f"#### `{name}.{member_name}` {{ #{anchor}.{member_name} }}\n")
                if isinstance(member, property):
                    returns = _signature(member.fget).rpartition(" -> ")[2] if member.fget else ""
                    parts.append(
                        f"```python\n{member_name}: {returns or 'property'}  # property\n```\n"
                    )
                else:
                    parts.append(f"```python\ndef {member_name}{_signature(member)}\n```\n")
                parts.append(_docstring(_own_doc(member)))
    return "\n".join(part for part in parts if part)


def _public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:  # a recipe module: the classes and functions it defines itself
        names = [
            name
            for name, obj in vars(module).items()
            if not name.startswith("_")
            and (inspect.isclass(obj) or inspect.isfunction(obj))
            and getattr(obj, "__module__", None) == module.__name__
        ]
    return [name for name in names if hasattr(module, name)]


def _public_members(cls: type) -> list[tuple[str, Any]]:
    members = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            members.append((name, member))
    return members


class _Annotation:
    """An annotation kept as the source text (``from __future__ import annotations``), shown
    unquoted."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj: Callable, *, indent: str = "") -> str:
    """``(a: int, *, b: str = 'x') -> bool``, one parameter per line when it is long."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have none
        return "(...)"

    def unquoted(annotation: Any) -> Any:
        return _Annotation(annotation) if isinstance(annotation, str) else annotation

    params = [p.replace(annotation=unquoted(p.annotation)) for p in signature.parameters.values()]
    parts, positional_only, keyword_marker = [], False, True
    for param in params:
        if param.kind is param.POSITIONAL_ONLY:
            positional_only = True
        elif positional_only:
            parts.append("/")
            positional_only = False
        if param.kind is param.VAR_POSITIONAL:
            keyword_marker = False
        elif param.kind is param.KEYWORD_ONLY and keyword_marker:
            parts.append("*")
            keyword_marker = False
        parts.append(str(param))
    if positional_only:
        parts.append("/")
    returns = ""
    if signature.return_annotation is not inspect.Signature.empty:
        returns = " -> " + inspect.formatannotation(unquoted(signature.return_annotation))
    one_line = f"({', '.join(parts)}){returns}"
    if len(one_line) <= 80:
        return one_line
    return "(\n" + "".join(f"{indent}    {part},\n" for part in parts) + f"{indent}){returns}"


def _value(obj: Any, max_lines: int = 30, width: int = 96) -> str:
    lines = pprint.pformat(obj, width=width, sort_dicts=False).splitlines()
    # pprint cannot break a dataclass repr: wrap what is still too wide for the code column.
    lines = [part for line in lines for part in (
        textwrap.wrap(line, width, subsequent_indent=" " * (len(line) - len(line.lstrip()) + 4),
                      break_long_words=False) if len(line) > width else [line])]
    return "\n".join(lines[:max_lines] + (["..."] if len(lines) > max_lines else []))


def _class_declaration(cls: type) -> str:
    """A dataclass as its fields (with their help as comments); another class as its bases and
    __init__."""
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    head = f"class {cls.__name__}({', '.join(bases)}):" if bases else f"class {cls.__name__}:"
    if dataclasses.is_dataclass(cls):
        hints = vars(cls).get("__annotations__", {})
        lines = [f"@dataclass\n{head}"]
        # inherited fields: see the base
        own = [f for f in dataclasses.fields(cls) if f.name in hints]
        for f in own:
            annotation = f.type if isinstance(f.type, str) else inspect.formatannotation(f.type)
            if f.default is not dataclasses.MISSING:
                default = f" = {f.default!r}"
            elif f.default_factory is not dataclasses.MISSING:
                default = f" = {f.default_factory()!r}"
            else:
                default = ""
            help_text = f.metadata.get("help", "")
            field = f"    {f.name}: {annotation}{default}"
            if help_text and len(field) + len(help_text) + 4 > 96:
                # A long help goes above its field, wrapped: the code column holds 100 characters.
                lines += ["    # " + part for part in textwrap.wrap(help_text, 90)]
                help_text = ""
            if len(field) > 96:  # e.g. a long Literal: continue inside its brackets
                field = "\n".join(textwrap.wrap(field, 96, subsequent_indent=" " * 8,
                                                 break_long_words=False, break_on_hyphens=False,
                                                 drop_whitespace=True))
            lines.append(field + (f"  # {help_text}" if help_text else ""))
        if not own:
            lines.append("    ...  # no fields of its own" if bases else "    ...")
        return "\n".join(lines)
    init = vars(cls).get("__init__")
    if inspect.isfunction(init):
        return f"{head}\n    def __init__{_signature(init, indent='    ')}"
    return head


def _own_doc(obj: Any) -> str:
    doc = obj.__doc__ if isinstance(obj, property) else getattr(obj, "__doc__", None)
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        # A dataclass without a docstring gets its signature as __doc__: that is not documentation.
        if doc and doc.startswith(f"{obj.__name__}("):
            doc = None
    return doc or ""


def _docstring(doc: str | None) -> str:
    """A docstring as markdown: ``literal`` -> `literal`, and <words> kept as text, not HTML."""
    if not doc:
        return ""
    lines = inspect.cleandoc(doc).splitlines()
    out = []
    for line in lines:
        if line.startswith("    "):  # an indented block stays code
            out.append(line)
            continue
        line = line.replace("``", "`")
        spans = re.split(r"(`[^`]*`)", line)
        out.append("".join(span if span.startswith("`") else escape(span) for span in spans))
    return "\n".join(out) + "\n"
