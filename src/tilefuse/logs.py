"""Channel logging: `TILEFUSE_LOGS=graph,fusion,tile,code` prints each stage as it happens.

Each channel is a standard `logging` logger named `tilefuse.<channel>`; enabling a channel
sets it to INFO and attaches a stderr handler once.
"""
from __future__ import annotations

import logging
import sys

from .config import config

CHANNELS = ("graph", "fusion", "tile", "code", "tune", "runtime", "cache")
_handler: logging.Handler | None = None


def _ensure_handler(logger: logging.Logger) -> None:
    global _handler
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter("[tilefuse.%(channel)s] %(message)s"))
    if _handler not in logger.handlers:
        logger.addHandler(_handler)


class _ChannelAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["channel"] = self.extra["channel"]
        return msg, kwargs


def enabled(channel: str) -> bool:
    chans = config.log_channels()
    return channel in chans or "all" in chans


def get(channel: str) -> logging.LoggerAdapter:
    logger = logging.getLogger(f"tilefuse.{channel}")
    logger.propagate = False
    return _ChannelAdapter(logger, {"channel": channel})


def log(channel: str, message: str, *args) -> None:
    """Log to a channel if it is enabled (cheap when it is not)."""
    if not enabled(channel):
        return
    adapter = get(channel)
    _ensure_handler(adapter.logger)
    adapter.logger.setLevel(logging.INFO)
    adapter.info(message, *args)
