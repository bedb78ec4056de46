"""Drive a running router with a workload: closed loop (C conversations in flight) or open loop
(conversations start at Poisson arrival times), measuring each request from its stream.

Turns of one conversation are sequential (turn t+1 resends turns 0..t with their answers);
conversations run concurrently. Failed requests are recorded, never raised.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from tqdm.auto import tqdm

from bench.metrics import RequestRecord
from bench.workload import Conversation, Turn, Workload
from epd import rpc
from epd.v1 import epd_pb2, epd_pb2_grpc


@dataclass(frozen=True)
class LoadSettings:
    output_tokens: int
    concurrency: int | None  # closed loop: conversations in flight; None: open loop at the arrival times
    timeout_s: float = 600.0  # per request


def user_message(turn: Turn) -> epd_pb2.ChatMessage:
    content = [epd_pb2.ContentPart(image=image.data) for image in turn.images]
    content.append(epd_pb2.ContentPart(text=turn.text))
    return epd_pb2.ChatMessage(role="user", content=content)


def assistant_message(text: str) -> epd_pb2.ChatMessage:
    return epd_pb2.ChatMessage(role="assistant", content=[epd_pb2.ContentPart(text=text)])


class LoadRunner:
    def __init__(self, address: str, settings: LoadSettings) -> None:
        self.address = address
        self.settings = settings
        self.sampling = epd_pb2.SamplingParams(max_tokens=settings.output_tokens, temperature=0.0, ignore_eos=True)

    def run(self, workload: Workload) -> tuple[list[RequestRecord], float]:
        """Every request's record (in completion order) and the run's wall time in seconds."""
        records: list[RequestRecord] = []
        with rpc.channel(self.address) as channel, \
                tqdm(total=workload.num_requests, desc="epd", unit="req", leave=False) as bar:
            stub = epd_pb2_grpc.RouterStub(channel)
            for turn in workload.warmup:  # untimed: first-call costs are not what the run measures
                self._request(stub, epd_pb2.GenerateRequest(messages=[user_message(turn)], sampling=self.sampling),
                              RequestRecord(conversation=-1, turn=0))

            lock = threading.Lock()

            def on_record(record: RequestRecord) -> None:
                with lock:
                    records.append(record)
                    bar.update(1)

            start = time.perf_counter()
            if self.settings.concurrency is None:
                self._open_loop(stub, workload, start, on_record)
            else:
                self._closed_loop(stub, workload, self.settings.concurrency, on_record)
            duration = time.perf_counter() - start
        return records, duration

    def _closed_loop(self, stub, workload: Workload, concurrency: int,
                     on_record: Callable[[RequestRecord], None]) -> None:
        pending = iter(workload.conversations)
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    conversation = next(pending, None)
                if conversation is None:
                    return
                self._conversation(stub, conversation, on_record)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _open_loop(self, stub, workload: Workload, start: float, on_record: Callable[[RequestRecord], None]) -> None:
        threads = []
        for conversation in workload.conversations:
            delay = start + conversation.arrival_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            thread = threading.Thread(target=self._conversation, args=(stub, conversation, on_record), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()

    def _conversation(self, stub, conversation: Conversation, on_record: Callable[[RequestRecord], None]) -> None:
        history: list[epd_pb2.ChatMessage] = []
        failed_turn: int | None = None
        for index, turn in enumerate(conversation.turns):
            record = RequestRecord(conversation=conversation.index, turn=index)
            if failed_turn is not None:
                record.error = f"not sent: turn {failed_turn} of this conversation failed"
                on_record(record)
                continue
            message = user_message(turn)
            request = epd_pb2.GenerateRequest(messages=[*history, message], sampling=self.sampling)
            answer = self._request(stub, request, record)
            on_record(record)
            if not record.ok:
                failed_turn = index
            history += [message, assistant_message(answer)]

    def _request(self, stub, request: epd_pb2.GenerateRequest, record: RequestRecord) -> str:
        """Send one request, filling ``record`` from its stream; returns the answer's text."""
        text: list[str] = []
        summary = None
        record.sent_s = time.perf_counter()
        try:
            for event in stub.Generate(request, timeout=self.settings.timeout_s):
                now = time.perf_counter()
                if event.WhichOneof("event") == "summary":
                    summary = event.summary
                    continue
                if event.chunk.token_ids:
                    record.token_times_s.append(now)
                    record.output_tokens += len(event.chunk.token_ids)
                text.append(event.chunk.text)
        except grpc.RpcError as error:
            record.error = f"{error.code().name}: {error.details()}"
        record.done_s = time.perf_counter()
        if summary is None:
            record.error = record.error or "the stream ended without a Summary"
        else:
            record.stages = {f.name: getattr(summary.timings, f.name) for f in summary.timings.DESCRIPTOR.fields}
            record.prompt_tokens = summary.prompt_tokens
            record.cached_tokens = summary.cached_tokens
            record.images_encoded = summary.images_encoded
            record.images_cached = summary.images_cached
        return "".join(text)
