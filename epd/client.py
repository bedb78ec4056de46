"""A small Python client for the Router: build a request, stream it, collect the result."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from epd import dataurl, rpc
from epd.v1 import epd_pb2, epd_pb2_grpc


@dataclass
class GenerateResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[epd_pb2.TokenLogprobs] = field(default_factory=list)
    summary: epd_pb2.Summary | None = None
    prompt_logprobs: list[epd_pb2.TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., when asked

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
            "resumes": s.resumes,
            "timings": {field.name: getattr(s.timings, field.name) for field in s.timings.DESCRIPTOR.fields},
            **({"logprobs": [{"logprob": entry.logprob, "top": [[alt.token_id, alt.logprob] for alt in entry.top]}
                             for entry in self.logprobs]} if self.logprobs else {}),
            **({"prompt_logprobs": [None] + [
                {"token_id": entry.token_id, "logprob": entry.logprob, "rank": entry.rank,
                 "top": [[alt.token_id, alt.logprob] for alt in entry.top]} for entry in self.prompt_logprobs]}
               if self.prompt_logprobs else {}),
        }


def user_request(prompt: str, images: Sequence[bytes] = (), *, max_pixels: int | None = None,
                 enable_thinking: bool = False, **sampling) -> epd_pb2.GenerateRequest:
    """One user turn: the images first, then the text (the chapter's layout)."""
    content = [epd_pb2.ContentPart(image=data) for data in images]
    content.append(epd_pb2.ContentPart(text=prompt))
    request = epd_pb2.GenerateRequest(
        messages=[epd_pb2.ChatMessage(role="user", content=content)],
        sampling=epd_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
        enable_thinking=enable_thinking,
    )
    if max_pixels is not None:
        request.max_pixels = max_pixels
    return request


def chat_request(messages: Sequence[epd_pb2.ChatMessage], *, max_pixels: int | None = None,
                 enable_thinking: bool = False, **sampling) -> epd_pb2.GenerateRequest:
    """A whole conversation (see ``messages_from_json``)."""
    request = epd_pb2.GenerateRequest(
        messages=list(messages),
        sampling=epd_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
        enable_thinking=enable_thinking,
    )
    if max_pixels is not None:
        request.max_pixels = max_pixels
    return request


def messages_from_json(messages: object, base_dir: str) -> list[epd_pb2.ChatMessage]:
    """The usual chat format -> ChatMessages: a list of ``{"role", "content"}`` where content is a
    string or a list of parts: ``{"type": "text", "text": ...}``, ``{"type": "image", "image"|"path":
    PATH}`` (transformers' chat-template form) or OpenAI's ``{"type": "image_url", "image_url": {"url":
    URL}}`` with a ``data:`` URL, a ``file://`` URL or a file path. Paths are read relative to
    ``base_dir``. Raises ValueError naming the problem."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty JSON list of {role, content} objects")
    out = []
    for m_index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"message {m_index} must be an object with a string role and a content")
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise ValueError(f"message {m_index} content must be a string or a list of parts")
        chat = epd_pb2.ChatMessage(role=message["role"])
        for p_index, part in enumerate(parts):
            chat.content.append(_part_from_json(part, f"message {m_index} part {p_index}", base_dir))
        out.append(chat)
    return out


_PART_FORMS = ('{"type": "text", "text": STR}, {"type": "image", "image": PATH} (or "path": PATH), or '
               '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..." | PATH}}')


def _part_from_json(part: object, where: str, base_dir: str) -> epd_pb2.ContentPart:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return epd_pb2.ContentPart(text=part["text"])
    if kind == "image":
        path = part.get("image", part.get("path"))
        if isinstance(path, str):
            return epd_pb2.ContentPart(image=_read_image(os.path.join(base_dir, path), where))
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if isinstance(url, str) and url:
            return epd_pb2.ContentPart(image=_image_from_url(url, where, base_dir))
    raise ValueError(f"{where} must be {_PART_FORMS}")


def _image_from_url(url: str, where: str, base_dir: str) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        try:
            return dataurl.decode_data_url(url)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    if scheme == "file":
        return _read_image(urllib.parse.unquote(urllib.parse.urlsplit(url).path), where)
    if scheme in ("http", "https"):
        raise ValueError(f"{where}: this client does not fetch URLs; download the image and name its path, or "
                         "send it to the HTTP front, which can fetch URLs when its operator allows it")
    return _read_image(os.path.join(base_dir, url), where)


def _read_image(path: str, where: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as error:
        raise ValueError(f"{where}: cannot read image {path}: {error.strerror}") from None


def read_ca(path: str | None) -> bytes | None:
    """A PEM file's bytes (None for no path); ValueError naming the problem."""
    return rpc.read_pem(path or "")


def connect(address: str, api_key: str | None = None, tls_ca: bytes | None = None) -> tuple[grpc.Channel, tuple]:
    """A channel to a router (TLS when ``tls_ca`` is given) and the metadata every call carries."""
    transport = rpc.Transport("authorization", f"Bearer {api_key}" if api_key else "", ca=tls_ca)
    return transport.channel(address), transport.metadata


def stream(address: str, request: epd_pb2.GenerateRequest, timeout_s: float | None = None,
           api_key: str | None = None, tls_ca: bytes | None = None) -> Iterable[epd_pb2.GenerateResponse]:
    chan, metadata = connect(address, api_key, tls_ca)
    with chan:
        yield from epd_pb2_grpc.RouterStub(chan).Generate(request, timeout=timeout_s, metadata=metadata)


def generate(address: str, request: epd_pb2.GenerateRequest, on_text: Callable[[str], None] | None = None,
             timeout_s: float | None = None, api_key: str | None = None,
             tls_ca: bytes | None = None) -> GenerateResult:
    """Run one request to the end; raises grpc.RpcError on failure. ``api_key`` is sent as
    ``authorization: Bearer KEY``; ``tls_ca`` (PEM bytes) makes the connection TLS."""
    result = GenerateResult()
    for event in stream(address, request, timeout_s, api_key, tls_ca):
        if event.WhichOneof("event") == "summary":
            result.summary = event.summary
            continue
        chunk = event.chunk
        result.token_ids.extend(chunk.token_ids)
        result.logprobs.extend(chunk.logprobs)
        result.prompt_logprobs.extend(chunk.prompt_logprobs)
        result.text += chunk.text
        if on_text and chunk.text:
            on_text(chunk.text)
    return result
