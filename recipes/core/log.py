"""The rank-0 logger: one line per step from rank 0, nothing from the other ranks unless they
fail."""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

__all__ = ["get_logger", "current_rank"]


def current_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        return record.rank == 0 or record.levelno >= logging.ERROR


def get_logger(name: str = "recipes") -> logging.Logger:
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.addFilter(_RankZeroFilter())
        handler.setFormatter(logging.Formatter("[rank%(rank)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("RECIPES_LOG_LEVEL", "INFO"))
        logger.propagate = False
    return logger
