"""Single flight for encodes on the router: concurrent requests that miss the same image key
send one Encode between them. Bookkeeping only: who leads a key, who waits on it.

The encoder pool has its own per-key single flight across routers; this one saves the second
router request its Encode call and lets the summary say which request actually encoded.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._in_flight: dict[str, Future[T]] = {}
        self._lock = threading.Lock()
        self.num_joined = 0  # keys a request waited on instead of encoding

    def claim(self, keys: Sequence[str]) -> tuple[list[str], dict[str, Future[T]]]:
        """Split ``keys`` into those this caller must do (it then ``resolve``s each one) and the
        futures of those another caller is already doing."""
        led: list[str] = []
        joined: dict[str, Future[T]] = {}
        with self._lock:
            for key in dict.fromkeys(keys):
                future = self._in_flight.get(key)
                if future is None:
                    self._in_flight[key] = Future()
                    led.append(key)
                else:
                    joined[key] = future
            self.num_joined += len(joined)
        return led, joined

    def resolve(self, key: str, result: T | None = None, error: BaseException | None = None) -> None:
        """Hand the outcome of a led key to everyone waiting on it; the key is free again."""
        with self._lock:
            future = self._in_flight.pop(key, None)
        if future is None:
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
