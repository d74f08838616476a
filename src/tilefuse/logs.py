"""Logging: tilefuse's channels as standard `logging` loggers, following Python's and PyTorch's
conventions.

Each channel logs to the logger of the package that owns the stage (`fusion` →
`tilefuse.fusion`, `code` → `tilefuse.backends`, ...), so every route a user knows works:
`TILEFUSE_LOGS=fusion,code` (or `tilefuse.config.logs`) prints those channels to stderr;
`TORCH_LOGS=+tilefuse` (every channel) or `TORCH_LOGS=+tilefuse.fusion` and
`torch._logging.set_logs(modules={"tilefuse": logging.DEBUG})` go through PyTorch's own
logging setup, which takes module names; a user's own handlers and levels see every record
(loggers propagate, and nothing here sets a level or adds a handler unless TILEFUSE_LOGS asks).

Stage dumps (graph IR, plans, tile IR, sources, tuning) are DEBUG records; one-line summaries
(a graph compiled, a fallback) are INFO.
"""
from __future__ import annotations

import logging
import sys

from .config import LOG_CHANNELS, config

#: channel -> logger name
LOGGERS = {
    "graph": "tilefuse.ir",
    "fusion": "tilefuse.fusion",
    "tile": "tilefuse.tile",
    "code": "tilefuse.backends",
    "tune": "tilefuse.tune",
    "runtime": "tilefuse.runtime",
    "cache": "tilefuse.runtime.cache",
    "compile_time": "tilefuse.compiler",
}
assert set(LOGGERS) == set(LOG_CHANNELS)

_ROOT = logging.getLogger("tilefuse")
_handler: logging.Handler | None = None
_levels_set: set[str] = set()  # loggers whose level TILEFUSE_LOGS set (and may reset)


class _ChannelFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        channel = next((c for c, name in LOGGERS.items() if name == record.name), record.name)
        return f"[tilefuse.{channel}] {record.getMessage()}"


def apply(channels: str) -> None:
    """Follow `TILEFUSE_LOGS`: the named channels' loggers at DEBUG with a stderr handler on
    the `tilefuse` logger; with no channel, nothing of ours stays installed."""
    global _handler
    wanted = {c.strip() for c in channels.split(",") if c.strip()}
    if "all" in wanted:
        wanted = set(LOG_CHANNELS)
    for name in _levels_set:
        logging.getLogger(name).setLevel(logging.NOTSET)
    _levels_set.clear()
    if not wanted:
        if _handler is not None:
            _ROOT.removeHandler(_handler)
            _ROOT.propagate = True
            _handler = None
        return
    for channel, name in LOGGERS.items():
        if channel in wanted:
            logging.getLogger(name).setLevel(logging.DEBUG)
            _levels_set.add(name)
        elif any(name.startswith(LOGGERS[w] + ".") for w in wanted):
            logging.getLogger(name).setLevel(logging.WARNING)  # a sub-channel not asked for
            _levels_set.add(name)
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(_ChannelFormatter())
        _ROOT.addHandler(_handler)
        _ROOT.propagate = False  # printed once, not again by a root handler


def logger(channel: str) -> logging.Logger:
    return logging.getLogger(LOGGERS[channel])


def enabled(channel: str, level: int = logging.DEBUG) -> bool:
    """Whether a record on `channel` would be handled (check before building a costly message)."""
    return logging.getLogger(LOGGERS[channel]).isEnabledFor(level)


def log(channel: str, message: str, *args, level: int = logging.DEBUG) -> None:
    """Log to a channel (cheap when nobody listens)."""
    target = logging.getLogger(LOGGERS[channel])
    if target.isEnabledFor(level):
        target.log(level, message, *args)


def info(channel: str, message: str, *args) -> None:
    log(channel, message, *args, level=logging.INFO)


apply(config.logs)
config.on_change(lambda name, value: apply(value) if name == "logs" else None)
