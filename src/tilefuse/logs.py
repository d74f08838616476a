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

`config.logs` set by assignment or the environment configures the loggers for the whole
process; set by `config.patch` or a compile's `options={"logs": ...}` it prints those channels
for that block only, in that thread, and leaves the loggers as they were.
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
    "cache": "tilefuse.runtime.cache",  # the name from when runtime/ held the disk cache, kept for users' log setups
    "compile_time": "tilefuse.compiler",
}
assert set(LOGGERS) == set(LOG_CHANNELS)

_ROOT = logging.getLogger("tilefuse")
_handler: logging.Handler | None = None
_saved: dict[str, tuple] = {}  # logger name -> (level, propagate) before TILEFUSE_LOGS changed it


class _ChannelFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        channel = next((c for c, name in LOGGERS.items() if name == record.name), record.name)
        return f"[tilefuse.{channel}] {record.getMessage()}"


def _channels(text: str) -> set[str]:
    wanted = {c.strip() for c in text.split(",") if c.strip()}
    return set(LOG_CHANNELS) if "all" in wanted else wanted


def _stderr_handler() -> logging.Handler:
    global _handler
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(_ChannelFormatter())
    return _handler


def _change(log: logging.Logger, level: int | None = None, propagate: bool | None = None) -> None:
    _saved.setdefault(log.name, (log.level, log.propagate))
    if level is not None:
        log.setLevel(level)
    if propagate is not None:
        log.propagate = propagate


def apply(channels: str) -> None:
    """Follow `TILEFUSE_LOGS`: the named channels' loggers at DEBUG and a stderr handler on the
    `tilefuse` logger (which then does not pass records on to the root's handlers: printed once).
    What it changes is saved and put back when the channels are turned off."""
    for name, (level, propagate) in _saved.items():
        log = logging.getLogger(name)
        log.setLevel(level)
        log.propagate = propagate
    _saved.clear()
    if _handler is not None:
        _ROOT.removeHandler(_handler)
    wanted = _channels(channels)
    if not wanted:
        return
    for channel, name in LOGGERS.items():
        if channel in wanted:
            _change(logging.getLogger(name), level=logging.DEBUG)
        elif any(name.startswith(LOGGERS[w] + ".") for w in wanted):
            _change(logging.getLogger(name), level=logging.WARNING)  # a sub-channel not asked for
    _ROOT.addHandler(_stderr_handler())
    _change(_ROOT, propagate=False)


def _patched_on(channel: str) -> bool:
    """Whether this thread's `config.patch` (a compile's options) asks for `channel`."""
    text = config.patched("logs")
    return bool(text) and channel in _channels(text)


def logger(channel: str) -> logging.Logger:
    return logging.getLogger(LOGGERS[channel])


def enabled(channel: str, level: int = logging.DEBUG) -> bool:
    """Whether a record on `channel` would be handled (check before building a costly message)."""
    return logging.getLogger(LOGGERS[channel]).isEnabledFor(level) or _patched_on(channel)


def log(channel: str, message: str, *args, level: int = logging.DEBUG) -> None:
    """Log to a channel (cheap when nobody listens)."""
    target = logging.getLogger(LOGGERS[channel])
    if target.isEnabledFor(level):
        target.log(level, message, *args)
    elif _patched_on(channel):
        _stderr_handler().handle(target.makeRecord(target.name, level, "(tilefuse)", 0, message, args, None))


def info(channel: str, message: str, *args) -> None:
    log(channel, message, *args, level=logging.INFO)


apply(config.logs)
config.on_change(lambda name, value: apply(value) if name == "logs" else None)
