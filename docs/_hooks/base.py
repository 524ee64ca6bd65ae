"""What every part of the generated site shares: where the repository and its results are, the
error a marker raises, and the text helpers (escaping, byte and number formats, imports that fail
the build with their error)."""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path
from typing import Any

# Under the "mkdocs" logger, so that --strict counts these warnings as errors.
log = logging.getLogger("mkdocs.hooks.recipes")

REPO_ROOT = Path(__file__).resolve().parents[2]
# Read as ``base.RESULTS_DIR`` at call time, never imported by value: a test points it at a folder
# of its own for every module at once.
RESULTS_DIR = REPO_ROOT / "results"
# The opening line of a fenced code block: markers and links inside one are left alone.
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


class MarkerError(Exception):
    """A marker names something that does not exist, or its data is unusable."""


def escape(text: str) -> str:
    """Plain text for markdown: no raw HTML, and no snippet include (--8<--) by accident."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def kib(num_bytes: float) -> str:
    return f"{num_bytes / 1024:,.1f} KiB" if num_bytes < 2**20 else f"{num_bytes / 2**20:,.2f} MiB"


def number(value: Any, top: bool = True) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(number(v, False) for v in value) + "]"
    if isinstance(value, dict):
        text = ", ".join(f"{k}: {number(v, False)}" for k, v in value.items())
        return text if top else "{" + text + "}"
    return str(value)


def import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    # A module that fails to import fails the build with its error.
    except Exception as exc:  # noqa: BLE001
        raise MarkerError(f"cannot import {name}: {type(exc).__name__}: {exc}") from None


def import_attribute(module_name: str, attribute: str) -> Any:
    module = import_module(module_name) if module_name else None
    if module is None or not hasattr(module, attribute):
        raise MarkerError(f"{module_name or '(no module)'} has no {attribute!r}")
    return getattr(module, attribute)
