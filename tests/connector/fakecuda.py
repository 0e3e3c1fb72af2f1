"""torch.cuda's streams, events and devices as a recording, for checking the GPU copy path's order on a CPU.

``install(monkeypatch)`` replaces the calls the connector makes (``Stream``, ``Event``, ``stream``,
``current_stream``, ``set_device``; pinned buffers and host-to-device copies) with ones that append what
they were asked to do, and by which thread, to one :class:`Calls` list, and otherwise do nothing: the
bytes still move, on the CPU, so a test checks both the order of the calls and what landed. A
:class:`~maru_connector.layout.PagedKV` is made to look like a GPU cache with :func:`on_gpu`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from maru_connector import staging
from maru_connector.layout import PagedKV

DEVICE = torch.device("cuda", 1)  # not GPU 0: a thread that never sets its device would still be on 0


@dataclass
class Calls:
    """What was asked, in order: ``(thread name, what, details...)``."""

    log: list[tuple[Any, ...]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *what: Any) -> None:
        with self._lock:
            self.log.append((threading.current_thread().name, *what))

    def of(self, what: str) -> list[tuple[Any, ...]]:
        return [c for c in self.log if c[1] == what]

    def index(self, *prefix: Any) -> int:
        """Where the first call starting with ``prefix`` (after the thread name) is; fails when none is."""
        for i, call in enumerate(self.log):
            if call[1 : 1 + len(prefix)] == prefix:
                return i
        raise AssertionError(f"no call {prefix} in {self.log}")


class FakeStream:
    _names = itertools.count()

    def __init__(self, calls: Calls, name: str | None = None, device: Any = None, **_: Any) -> None:
        self.calls = calls
        self.name = name or f"stream{next(self._names)}"
        self.device = device
        calls.add("stream created", self.name, device)

    def wait_event(self, event: FakeEvent) -> None:
        self.calls.add("wait_event", self.name, event.name)

    def synchronize(self) -> None:
        self.calls.add("stream synchronize", self.name)


class FakeEvent:
    _names = itertools.count()

    def __init__(self, calls: Calls, *, blocking: bool = False, **_: Any) -> None:
        self.calls = calls
        self.name = f"event{next(self._names)}"
        self.blocking = blocking
        calls.add("event created", self.name, blocking)

    def record(self, stream: FakeStream | None = None) -> None:
        self.calls.add("record", self.name, stream.name if stream is not None else None)

    def synchronize(self) -> None:
        self.calls.add("event synchronize", self.name, self.blocking)

    def query(self) -> bool:
        return True


def install(monkeypatch: pytest.MonkeyPatch) -> Calls:
    calls = Calls()
    engine = FakeStream(calls, "engine")
    current = threading.local()

    @contextlib.contextmanager
    def stream(s: FakeStream) -> Iterator[None]:
        calls.add("enter stream", s.name)
        before = getattr(current, "stream", None)
        current.stream = s
        try:
            yield
        finally:
            current.stream = before
            calls.add("leave stream", s.name)

    def current_stream(device: Any = None) -> FakeStream:
        return getattr(current, "stream", None) or engine

    original_to = torch.Tensor.to
    original_tensor = torch.tensor

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
            calls.add("to cuda", self.dtype, bool(kwargs.get("non_blocking", False)), current_stream().name)
            return self
        return original_to(self, *args, **kwargs)

    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            calls.add("tensor on cuda", kwargs.get("dtype"))
            device = None
        return original_tensor(*args, device=device, **kwargs)

    def pin_memory(self: torch.Tensor) -> torch.Tensor:
        calls.add("pin_memory", self.dtype)
        return self

    def device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
        calls.add("device buffer", current_stream().name)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **kw: FakeStream(calls, device=device))
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent(calls, **kw))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.add("set_device", torch.device(device)))
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(staging, "host_buffer", lambda nbytes, pinned: torch.empty(nbytes, dtype=torch.uint8))
    monkeypatch.setattr(staging, "device_buffer", device_buffer)
    return calls


def on_gpu(paged: PagedKV) -> PagedKV:
    """``paged`` (a CPU cache) as the connector sees a GPU cache: its device is ``DEVICE``."""
    paged.device = DEVICE
    return paged
