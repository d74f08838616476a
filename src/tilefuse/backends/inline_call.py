"""What a launcher tells the compiled graph's generated call (`runtime.straight_line`) about
one launch for one set of sizes: the callable to call and its arguments, with the buffers it
reads by name, and the layouts the arguments were worked out for.

A launcher offers `inline(buffers, env)`, asked right after it launched on those buffers; it
answers with an `InlineCall`, with `SKIP` (nothing to launch for these sizes), or with None
(launch it the general way, `launch(buffers, env)`, every call). An `InlineCall`'s arguments
are final except the buffers (`Buf`), and the stream (`STREAM`, the current stream, read once
per call). Whatever it baked in from a buffer (a stride, a 16-byte alignment the binary was
specialised for) is in `expects`; the generated call checks it for every buffer it did not
allocate itself, and launches the general way where a check fails.

It sits here, below the runtime, because both backends' launchers and the runtime's library
products answer it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Buf:
    """The graph's buffer `name`, as it is at the launch."""

    name: str


class _Stream:
    def __repr__(self) -> str:
        return "STREAM"


#: the current CUDA stream (an int handle), read once per call
STREAM = _Stream()

#: a launch with nothing to do for this set of sizes (an empty output)
SKIP = object()


@dataclass(frozen=True)
class Expect:
    """A buffer's layout that an `InlineCall` was built for: its strides (None: not baked in)
    and whether its base address is a multiple of 16 bytes (only a True is a promise the
    binary relies on)."""

    strides: tuple | None = None
    aligned: bool = False


@dataclass(frozen=True)
class InlineCall:
    call: object  # the callable
    args: tuple  # values as they are passed; `Buf(name)` and `STREAM` filled in per call
    expects: dict = field(default_factory=dict)  # buffer name -> Expect
    label: str = ""  # what the generated source says it is
    guard: object = None  # () -> bool, once per call: False sends the whole call the general way
    setup: object = None  # () -> None, once per call before the first launch
    stream: object = None  # () -> the current stream, once per call (for `STREAM`)


__all__ = ["Buf", "STREAM", "SKIP", "Expect", "InlineCall"]
