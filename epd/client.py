"""A small Python client for the Router: build a request, stream it, collect the result."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from epd import rpc
from epd.v1 import epd_pb2, epd_pb2_grpc


@dataclass
class GenerateResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[epd_pb2.TokenLogprobs] = field(default_factory=list)
    summary: epd_pb2.Summary | None = None

    def to_json(self) -> dict:
        s = self.summary
        return {
            "request_id": s.request_id,
            "token_ids": self.token_ids,
            "text": self.text,
            "prompt_tokens": s.prompt_tokens,
            "image_tokens": s.image_tokens,
            "completion_tokens": s.completion_tokens,
            "finish_reason": s.finish_reason,
            "ttft_s": s.ttft_s,
            "e2e_s": s.e2e_s,
            "images": s.images,
            "images_encoded": s.images_encoded,
            "seed": s.seed,
            "cached_tokens": s.cached_tokens,
            "images_cached": s.images_cached,
            "timings": {field.name: getattr(s.timings, field.name) for field in s.timings.DESCRIPTOR.fields},
        }


def user_request(prompt: str, images: Sequence[bytes] = (), *, max_pixels: int | None = None,
                 **sampling) -> epd_pb2.GenerateRequest:
    """One user turn: the images first, then the text (the chapter's layout)."""
    content = [epd_pb2.ContentPart(image=data) for data in images]
    content.append(epd_pb2.ContentPart(text=prompt))
    request = epd_pb2.GenerateRequest(
        messages=[epd_pb2.ChatMessage(role="user", content=content)],
        sampling=epd_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
    )
    if max_pixels is not None:
        request.max_pixels = max_pixels
    return request


def stream(address: str, request: epd_pb2.GenerateRequest, timeout_s: float | None = None) -> Iterable[epd_pb2.GenerateResponse]:
    with rpc.channel(address) as chan:
        yield from epd_pb2_grpc.RouterStub(chan).Generate(request, timeout=timeout_s)


def generate(address: str, request: epd_pb2.GenerateRequest, on_text: Callable[[str], None] | None = None,
             timeout_s: float | None = None) -> GenerateResult:
    """Run one request to the end; raises grpc.RpcError on failure."""
    result = GenerateResult()
    for event in stream(address, request, timeout_s):
        if event.WhichOneof("event") == "summary":
            result.summary = event.summary
            continue
        chunk = event.chunk
        result.token_ids.extend(chunk.token_ids)
        result.logprobs.extend(chunk.logprobs)
        result.text += chunk.text
        if on_text and chunk.text:
            on_text(chunk.text)
    return result
