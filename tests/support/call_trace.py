"""Which coordinator files a piece of work enters, from which, and in what order.

``CallTrace`` records, with ``sys.setprofile``, each first entry of a frame in a file under
``src/darkbloom/coordinator`` made from a frame in another such file (a coroutine resumed, a call
within one file, a call from a library or the event loop are not entries). ``Spine`` reads a walk
the way ``docs/architecture.md`` describes one: the root files (a route and the module it hands the
work to), the files the roots enter, in the order first entered, and the *returns* — the distinct
entries from one of those files (not a root) into another file of the walk, each a place where a
reader following the walk must go back to a file already left instead of back to the root.
"""

from __future__ import annotations

import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import darkbloom.coordinator

COORDINATOR = Path(darkbloom.coordinator.__file__).parent


def relative(filename: str) -> str | None:
    """``inference/serving.py`` for a coordinator file, None for any other."""
    try:
        return Path(filename).relative_to(COORDINATOR).as_posix()
    except ValueError:
        return None


@dataclass(frozen=True)
class Entry:
    caller: str  # coordinator file, relative
    callee: str
    function: str


class CallTrace:
    """``with CallTrace() as trace:`` records ``trace.entries`` (every thread the work runs on)."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._frames: dict[int, types.FrameType] = {}  # kept alive so that an id is never reused

    def _profile(self, frame: types.FrameType, event: str, _arg: Any) -> None:
        if event != "call" or id(frame) in self._frames:
            return
        self._frames[id(frame)] = frame
        callee = relative(frame.f_code.co_filename)
        back = frame.f_back
        caller = relative(back.f_code.co_filename) if back is not None else None
        if callee is not None and caller is not None and callee != caller:
            self.entries.append(Entry(caller, callee, frame.f_code.co_name))

    def __enter__(self) -> "CallTrace":
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *_exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        self._frames.clear()

    def spine(self, *roots: str) -> "Spine":
        return Spine.of(self.entries, roots)


@dataclass(frozen=True)
class Spine:
    files: tuple[str, ...]              # the roots, then each file a root entered, in first-entry order
    returns: frozenset[tuple[str, str]]  # (from, to): entries from a non-root file of the walk into another

    @classmethod
    def of(cls, entries: list[Entry], roots: tuple[str, ...]) -> "Spine":
        files = dict.fromkeys(roots)
        for entry in entries:
            if entry.caller in roots:
                files.setdefault(entry.callee)
        walk = set(files)
        returns = frozenset((e.caller, e.callee) for e in entries
                            if e.caller in walk and e.callee in walk and e.caller not in roots)
        return cls(tuple(files), returns)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)
