"""Single flight for encodes on the router: concurrent requests that miss the same image key
send one Encode between them. Bookkeeping only, on the router's event loop: who leads a key, who
waits on it.

The Encoder service has its own per-key single flight across routers; this one saves the second
router request its Encode call and lets the summary say which request actually encoded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._in_flight: dict[str, asyncio.Future[T]] = {}
        self.num_joined = 0  # keys a request waited on instead of encoding

    def claim(self, keys: Sequence[str]) -> tuple[list[str], dict[str, asyncio.Future[T]]]:
        """Split ``keys`` into those this caller must do (it then ``resolve``s each one) and the
        futures of those another caller is already doing."""
        led: list[str] = []
        joined: dict[str, asyncio.Future[T]] = {}
        for key in dict.fromkeys(keys):
            future = self._in_flight.get(key)
            if future is None:
                future = self._in_flight[key] = asyncio.get_running_loop().create_future()
                future.add_done_callback(_retrieve)  # a failure nobody waited on is not an error
                led.append(key)
            else:
                joined[key] = future
        self.num_joined += len(joined)
        return led, joined

    def resolve(self, key: str, result: T | None = None, error: BaseException | None = None) -> None:
        """Hand the outcome of a led key to everyone waiting on it; the key is free again."""
        future = self._in_flight.pop(key, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error if isinstance(error, Exception) else RuntimeError(repr(error)))
        else:
            future.set_result(result)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
