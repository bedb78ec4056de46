"""Drive a running router with a workload: closed loop (C conversations in flight) or open loop
(conversations start at Poisson arrival times), measuring each request from its stream.

Over either public front: gRPC (``epd.v1.Router/Generate``) or the OpenAI-compatible HTTP front
(``api="openai"``: streamed ``/v1/chat/completions`` with images and clips as data: URLs, tokens counted from
each chunk's ``token_ids``, prompt and cached tokens from the usage chunk). The HTTP front has no
per-stage timings, so the store and handoff figures come from gRPC runs only.

Turns of one conversation are sequential (turn t+1 resends turns 0..t with their answers);
conversations run concurrently. Failed requests are recorded, never raised.
"""

from __future__ import annotations

import base64
import http.client
import json
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
    content += [epd_pb2.ContentPart(video=epd_pb2.VideoPart(data=video.data)) for video in turn.videos]
    content.append(epd_pb2.ContentPart(text=turn.text))
    return epd_pb2.ChatMessage(role="user", content=content)


def assistant_message(text: str) -> epd_pb2.ChatMessage:
    return epd_pb2.ChatMessage(role="assistant", content=[epd_pb2.ContentPart(text=text)])


APIS = ("grpc", "openai")


class LoadRunner:
    def __init__(self, address: str, settings: LoadSettings, api: str = "grpc", api_key: str | None = None,
                 label: str = "epd") -> None:
        if api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {api!r}")
        self.address = address
        self.settings = settings
        self.api = api
        self.api_key = api_key
        self.label = label  # the progress bar's name
        self.sampling = epd_pb2.SamplingParams(max_tokens=settings.output_tokens, temperature=0.0, ignore_eos=True)

    def run(self, workload: Workload) -> tuple[list[RequestRecord], float]:
        """Every request's record (in completion order) and the run's wall time in seconds."""
        records: list[RequestRecord] = []
        with rpc.channel(self.address) as channel, \
                tqdm(total=workload.num_requests, desc=self.label, unit="req", leave=False) as bar:
            if self.api == "openai":
                stub = OpenAIStub(self.address, self.settings.timeout_s, self.api_key)
            else:
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
        clips = {video.index: video.sampled_frames for turn in conversation.turns for video in turn.videos}
        for index, turn in enumerate(conversation.turns):
            record = RequestRecord(conversation=conversation.index, turn=index, video_frames=sum(clips.values()))
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
        metadata = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None
        try:
            for event in stub.Generate(request, timeout=self.settings.timeout_s, metadata=metadata):
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
        except HttpFailure as error:
            record.error = str(error)
        record.done_s = time.perf_counter()
        if summary is None:
            record.error = record.error or "the stream ended without a Summary"
        else:
            record.stages = {f.name: getattr(summary.timings, f.name) for f in summary.timings.DESCRIPTOR.fields}
            record.prompt_tokens = summary.prompt_tokens
            record.cached_tokens = summary.cached_tokens
            record.images_encoded = summary.images_encoded
            record.images_cached = summary.images_cached
            record.videos = summary.videos
            record.video_tokens = summary.video_tokens
            record.video_chunks = summary.video_chunks
            record.video_chunks_encoded = summary.video_chunks_encoded
        return "".join(text)


class HttpFailure(Exception):
    """A request the HTTP front refused or broke off (the message names the status)."""


class OpenAIStub:
    """``Generate`` over the OpenAI-compatible HTTP front: the same request as a streamed chat
    completion, its chunks turned back into ``GenerateResponse`` events (one HTTP connection per
    thread, kept alive)."""

    def __init__(self, address: str, timeout_s: float, api_key: str | None = None) -> None:
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.timeout_s = timeout_s
        self.headers = {"content-type": "application/json", **({"authorization": f"Bearer {api_key}"} if api_key
                                                                else {})}
        self._local = threading.local()

    def Generate(self, request: epd_pb2.GenerateRequest, timeout: float | None = None, metadata=None):  # noqa: N802
        body = json.dumps(chat_body(request)).encode()
        connection = self._connection()
        try:
            connection.request("POST", "/v1/chat/completions", body=body, headers=self.headers)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as error:
            self._local.connection = None
            raise HttpFailure(f"HTTP: {type(error).__name__}: {error}") from None
        if response.status != 200:
            text = response.read().decode(errors="replace")
            try:
                message = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = text[:200]
            raise HttpFailure(f"HTTP {response.status}: {message}")
        usage = None
        try:
            while True:
                line = response.readline()
                if not line:
                    raise HttpFailure("HTTP: the stream ended without [DONE]")
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    response.read()  # the chunked body's end, so the connection can carry the next request
                    break
                event = json.loads(data)
                if "error" in event:
                    raise HttpFailure(f"HTTP stream error: {event['error'].get('message')}")
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    ids = choice.get("token_ids") or []
                    text = (choice.get("delta") or {}).get("content") or ""
                    if ids or text:
                        yield epd_pb2.GenerateResponse(chunk=epd_pb2.TokenChunk(token_ids=ids, text=text))
        except (OSError, http.client.HTTPException) as error:
            self._local.connection = None
            raise HttpFailure(f"HTTP: {type(error).__name__}: {error}") from None
        if usage is not None:
            details = usage.get("prompt_tokens_details") or {}
            yield epd_pb2.GenerateResponse(summary=epd_pb2.Summary(
                prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
                cached_tokens=details.get("cached_tokens", 0)))

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = http.client.HTTPConnection(self.host, self.port,
                                                                             timeout=self.timeout_s)
        return connection


def chat_body(request: epd_pb2.GenerateRequest) -> dict:
    """A GenerateRequest as an OpenAI chat completion request (streamed, with usage and token ids)."""
    messages = []
    for message in request.messages:
        parts = []
        for part in message.content:
            if part.WhichOneof("part") == "image":
                url = f"data:{_media_type(part.image)};base64,{base64.b64encode(part.image).decode()}"
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif part.WhichOneof("part") == "video":
                url = f"data:video/mp4;base64,{base64.b64encode(part.video.data).decode()}"
                parts.append({"type": "video_url", "video_url": {"url": url}})
            else:
                parts.append({"type": "text", "text": part.text})
        messages.append({"role": message.role, "content": parts})
    sampling = request.sampling
    body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "ignore_eos": sampling.ignore_eos}
    if sampling.HasField("max_tokens"):
        body["max_tokens"] = sampling.max_tokens
    if sampling.HasField("temperature"):
        body["temperature"] = sampling.temperature
    return body


def _media_type(data: bytes) -> str:
    if data.startswith(b"\x89PNG"):
        return "image/png"
    if data.startswith(b"\xff\xd8"):
        return "image/jpeg"
    return "application/octet-stream"
