"""Decode: one loop thread that steps every running request together and publishes the tokens.

``DecodeEngine`` owns the runner, the ``DecodeBatch`` (tensors) and the loop; ``DecodeScheduler``
(bookkeeping) decides who is admitted, who sits in which slot and who is done. Continuous
batching: between two steps, finished requests leave the batch and handed-off ones join it; each
step then runs one batched forward for every request in it (``TextModelRunner.decode_step``),
samples each row with the request's own settings and publishes the tokens. A handoff is decoded
as soon as it arrives, so tokens are ready when the router claims the stream.

Every change of a request's status happens under the engine's lock, admission included (the
state is copied into its slot while the lock is held), so a cancel can never be overwritten by
an admission running beside it. Only the forward itself runs outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from decode_svc.batch import DecodeBatch
from decode_svc.scheduler import DecodeRequest, DecodeScheduler, RequestStatus, TokenEvent
from epd.config import DecodeConfig
from epd.lm import HybridState, TextModelRunner
from epd.metrics import Family, counter, gauge
from epd.request import FinishReason
from epd.sampling import SamplingConfig, sample

log = logging.getLogger(__name__)


class DecodeEngine:
    def __init__(self, runner: TextModelRunner, eos_token_ids: frozenset[int], config: DecodeConfig) -> None:
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.scheduler = DecodeScheduler(config.max_batch_size)
        self._batch = DecodeBatch(runner)  # owned by the loop thread, changed under the lock
        self.steps = 0
        self.batch_sizes_total = 0  # sum of batch sizes over steps: mean batch = this / steps
        self.largest_batch = 0
        self.finished: Counter[str] = Counter()  # requests by finish reason
        self._lock = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ called by the server's threads

    def submit(self, request_id: str, prompt_len: int, rope_delta: int, first_token: int,
               sampling: SamplingConfig, state: HybridState, deadline_unix: float, num_generated: int = 1) -> None:
        """A handed-off request; ``num_generated`` counts the tokens it already produced (the
        last of them is ``first_token``): more than one when a request resumes elsewhere."""
        now = time.monotonic()
        request = DecodeRequest(
            request_id=request_id,
            prompt_len=prompt_len,
            rope_delta=rope_delta,
            sampling=sampling,
            state=state,
            last_token=first_token,
            lease_deadline=now + self.config.handoff_lease_s,
            deadline=now + max(0.0, deadline_unix - time.time()) if deadline_unix else float("inf"),
            num_generated=num_generated,
        )
        with self._lock:
            self.scheduler.add(request)
            self._lock.notify()

    def claim(self, request_id: str, sink: Callable[[TokenEvent], None]) -> DecodeRequest | None:
        """Send the request's events to ``sink`` (called from the loop thread: it must not block)."""
        with self._lock:
            return self.scheduler.claim(request_id, sink)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish(request, FinishReason.CANCELLED)

    def num_unfinished(self) -> int:
        with self._lock:
            return self.scheduler.num_unfinished()

    def num_held(self) -> int:
        """Requests decode still holds, finished ones whose stream has not come yet included."""
        with self._lock:
            return len(self.scheduler.requests)

    def metrics(self) -> list[Family]:
        with self._lock:
            running, waiting = len(self.scheduler.slots), self.scheduler.num_waiting()
            finished = dict(self.scheduler.finished)
        family = counter("epd_decode_requests_finished_total", "Requests decode finished, by reason", "reason")
        for reason, count in sorted(finished.items()):
            family.add(count, reason)
        return [
            gauge("epd_decode_running_requests", "Requests in the decode batch").add(running),
            gauge("epd_decode_waiting_requests", "Handed-off requests waiting for a slot in the batch").add(waiting),
            counter("epd_decode_steps_total", "Batched decode steps").add(self.steps),
            counter("epd_decode_batch_rows_total", "Rows over all decode steps (mean batch = this / steps)")
            .add(self.batch_sizes_total),
            gauge("epd_decode_largest_batch", "The largest batch a step has run").add(self.largest_batch),
            family,
        ]

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------ the loop thread

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not self._prepare_step():
                    self._lock.wait(timeout=min(0.5, self.scheduler.next_wake(time.monotonic()) + 0.01))
                if self._stopped:
                    return
                members = self.scheduler.running
            try:
                logits = self._forward(members)
            except Exception:  # noqa: BLE001 - a failed step ends its requests, never the loop
                log.exception("decode step failed for a batch of %d", len(members))
                with self._lock:
                    for request in members:
                        self.scheduler.finish(request, FinishReason.ERROR)
                continue
            with self._lock:
                self._publish(members, logits)

    def _prepare_step(self) -> bool:
        """Under the lock: expire, drop finished requests, admit waiting ones. True when there is a
        batch to step."""
        now = time.monotonic()
        self.scheduler.expire(now)
        self.scheduler.reap(now)
        self._compact()
        for request in self.scheduler.admit():
            try:
                self._batch.add(request.state)
            except Exception as error:  # noqa: BLE001 - a malformed state fails its own request only
                log.warning("decode refused the state of %s: %s", request.request_id, error)
                self.scheduler.reject(request)
                continue
            request.state = None  # the batch holds it now
        return bool(self.scheduler.slots)

    def _compact(self) -> None:
        for src, dst in self.scheduler.compact():
            self._batch.move(src, dst)
        self._batch.truncate(len(self.scheduler.slots))

    def _forward(self, members: list[DecodeRequest]) -> torch.Tensor:
        tokens = [r.last_token for r in members]
        positions_ = [r.position for r in members]
        logits = self.runner.decode_step(self._batch, tokens, positions_)
        self.steps += 1
        self.batch_sizes_total += len(members)
        self.largest_batch = max(self.largest_batch, len(members))
        return logits

    def _publish(self, members: list[DecodeRequest], logits: torch.Tensor) -> None:
        """Under the lock: sample each row and hand the token to its request. A row whose logits
        are not finite (a numerical blow-up in that request alone) fails only that request."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        for row, request in enumerate(members):
            if request.status is RequestStatus.FINISHED:  # cancelled during the step
                continue
            if not finite[row]:
                log.warning("decode: non-finite logits for %s at step %d; failing it", request.request_id,
                            request.num_generated)
                self.scheduler.finish(request, FinishReason.ERROR)
                continue
            token, logprobs = sample(logits[row], request.sampling, step=request.num_generated)
            reason = self.scheduler.after_token(request, token, self.eos_token_ids)
            request.publish(TokenEvent(token_id=token, logprobs=logprobs, finish_reason=reason))
            if reason is not None:
                self.scheduler.finish(request, reason)
