"""The HTTP front's request checking and error mapping, in-process (the end-to-end behaviour is in
tests/test_http.py): every OpenAI field either maps onto the GenerateRequest or is refused by name,
and every failure of the request path gets its HTTP status."""

from __future__ import annotations

import asyncio
import gc
import json
import time

import grpc
import pytest

from bench.synthetic import make_image
from epd import errors, rpc
from epd.config import HttpConfig
from epd.dataurl import encode_data_url
from router_svc.http import HttpError, HttpFront, http_error
from router_svc.stats import RequestStats

IMAGE = make_image(32, 32, seed=1)


def build(body: dict):
    front = HttpFront(None, HttpConfig(), "tiny", "", lambda: True, RequestStats())
    return asyncio.run(front.build_request(body, "chatcmpl-1"))


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts) or "hi"}]


def test_fields_map_onto_the_request():
    request, options = build({
        "model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, *user(
            {"type": "image_url", "image_url": {"url": encode_data_url(IMAGE), "detail": "auto"}},
            {"type": "text", "text": "What?"})],
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": 3, "stop": ["\n", "."],
        "logprobs": True, "top_logprobs": 0, "stream": True, "stream_options": {"include_usage": True},
        "mm_processor_kwargs": {"max_pixels": 65536}, "chat_template_kwargs": {"enable_thinking": True},
        "ignore_eos": True, "return_token_ids": True, "user": "u1", "presence_penalty": 0, "tools": None, "n": 1})
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, list(s.stop), s.ignore_eos) == (
        7, 0.5, pytest.approx(0.9), 0, 3, ["\n", "."], True)
    assert s.logprobs == 1  # the sampled token's logprob needs at least one from decode
    assert request.max_pixels == 65536 and request.enable_thinking and request.request_id == "chatcmpl-1"
    assert [m.role for m in request.messages] == ["system", "user"]
    assert request.messages[1].content[0].image == IMAGE and request.messages[1].content[1].text == "What?"
    assert (options.stream, options.include_usage, options.logprobs, options.top_logprobs, options.token_ids) == (
        True, True, True, 0, True)
    assert not s.HasField("presence_penalty") or s.presence_penalty == 0
    processed, _ = build({"messages": user(), "stop_token_ids": [7, 9], "min_tokens": 2, "logit_bias": {"5": -100,
                          "12": 2.5}, "min_p": 0.25, "presence_penalty": 0.5, "frequency_penalty": -1,
                          "repetition_penalty": 1.5})
    p = processed.sampling
    assert (list(p.stop_token_ids), p.min_tokens, dict(p.logit_bias), p.min_p, p.presence_penalty,
            p.frequency_penalty, p.repetition_penalty) == ([7, 9], 2, {5: -100.0, 12: 2.5}, 0.25, 0.5, -1.0, 1.5)
    plain, options = build({"messages": user()})
    assert not plain.sampling.HasField("max_tokens") and not plain.sampling.HasField("temperature")
    assert not plain.HasField("max_pixels") and not options.stream


@pytest.mark.parametrize("body,status,message", [
    ({"messages": user(), "tools": []}, 400, "tools must be a non-empty list of functions"),
    ({"messages": user(), "tools": [{}], "tool_choice": "required"}, 400, "tools[0] must be"),
    ({"messages": user(), "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "'g', which is not one of the tools"),
    ({"messages": user(), "tool_choice": "auto"}, 400, "tool_choice needs tools"),
    ({"messages": user(), "response_format": {"type": "yaml"}}, 400, "response_format.type 'yaml' is not supported"),
    ({"messages": user(), "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400,
     "send one structured output per request"),
    ({"messages": user(), "structured_outputs": {"disable_any_whitespace": True}}, 400,
     "structured_outputs: disable_any_whitespace"),
    ({"messages": user(), "logit_bias": {"1": "2"}}, 400, "logit_bias: the bias of token 1 must be a finite number"),
    ({"messages": user(), "logit_bias": {"-1": 2}}, 400, "logit_bias: key '-1' is not a token id"),
    ({"messages": user(), "logit_bias": [1, 2]}, 400, "logit_bias must be an object"),
    ({"messages": user(), "stop_token_ids": [1, -2]}, 400, "stop_token_ids must be a list of token ids"),
    ({"messages": user(), "stop_token_ids": 5}, 400, "stop_token_ids must be a list of token ids"),
    ({"messages": user(), "min_tokens": -1}, 400, "min_tokens must be an integer"),
    ({"messages": user(), "min_p": "0.1"}, 400, "min_p must be a finite number"),
    ({"messages": user(), "repetition_penalty": True}, 400, "repetition_penalty must be a finite number"),
    ({"messages": user(), "n": 17}, 400, "n must be an integer in [1, 16]"),
    ({"messages": user(), "n": True}, 400, "n must be an integer in [1, 16]"),
    ({"messages": user(), "n": 0}, 400, "n must be an integer in [1, 16]"),
    ({"messages": user(), "cache_salt": ""}, 400, "cache_salt must be a non-empty string"),
    ({"messages": user(), "cache_salt": 5}, 400, "cache_salt must be a non-empty string"),
    ({"messages": user(), "model": "other"}, 404, "`other` does not exist"),
    ({"messages": user(), "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    ({"messages": user(), "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs must be an integer in [0, 20]"),
    ({"messages": user(), "max_tokens": 5, "max_completion_tokens": 6}, 400, "differ"),
    ({"messages": user(), "max_tokens": "5"}, 400, "max_tokens must be an integer"),
    # The deployment's real bounds in the request path's words, not int32's range.
    ({"messages": user(), "max_tokens": 10**12}, 400, "max_tokens must be at most 4096, got 1000000000000"),
    ({"messages": user(), "max_completion_tokens": 4097}, 400, "max_completion_tokens must be at most 4096, got 4097"),
    ({"messages": user(), "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0"),
    ({"messages": user(), "max_tokens": -2**40}, 400, "max_tokens must be at least 1, got -1099511627776"),
    ({"messages": user(), "temperature": 1e9}, 400, "temperature must be in [0, 1e+06], got 1e+09"),
    ({"messages": user(), "temperature": -1}, 400, "temperature must be in [0, 1e+06], got -1"),
    ({"messages": user(), "temperature": "hot"}, 400, "temperature must be a finite number"),
    ({"messages": user(), "seed": -1}, 400, "seed must be an integer"),
    ({"messages": user(), "stop": [""]}, 400, "stop must be"),
    ({"messages": user(), "stream": "yes"}, 400, "stream must be true or false"),
    ({"messages": user(), "stream_options": {"include_usage": True}}, 400, "only allowed with stream"),
    ({"messages": user(), "stream": True, "stream_options": {"continuous_usage_stats": 1}}, 400,
     "stream_options.continuous_usage_stats must be true or false"),
    ({"messages": user(), "mm_processor_kwargs": {"min_pixels": 1}}, 400, "mm_processor_kwargs: min_pixels"),
    ({"messages": user(), "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs: tools"),
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, 400, "messages[0].name must be a string"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]}, 400, "tool_calls[0] must be"),
    ({"messages": user({"type": "input_audio", "input_audio": {}})}, 400, "got type 'input_audio'"),
    ({"messages": user({"type": "text", "text": 3})}, 400, "must be"),
    ({"messages": user({"type": "image_url", "image_url": {"url": encode_data_url(IMAGE), "detail": "low"}})}, 400,
     "only 'auto'"),
    ({"messages": user({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}})}, 400,
     "messages[0].content[0]: the data: URL is not valid base64"),
    ({"messages": user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})}, 400,
     "--allow-media-urls"),
    ({"messages": user({"type": "image_url", "image_url": {"url": "file:///etc/hosts"}})}, 400,
     "--allowed-local-media-path"),
])
def test_refusals_name_the_field(body, status, message):
    with pytest.raises(HttpError) as raised:
        build(body)
    assert raised.value.status == status
    assert message in raised.value.message


@pytest.mark.parametrize("error,status,kind", [
    (ValueError("max_tokens must be at least 1, got 0"), 400, "invalid_request_error"),
    (errors.ResourceExhausted("router: 64 requests already wait; retry in a moment"), 429, "rate_limit_error"),
    (errors.Unavailable("prefill: no replica takes work"), 503, "service_unavailable"),
    (errors.DeadlineExceeded("request passed its deadline in decode"), 504, "timeout_error"),
    (rpc.RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "image 0: corrupt"), 400, "invalid_request_error"),
    (rpc.RpcFailure(grpc.StatusCode.UNAUTHENTICATED, "no key"), 401, "authentication_error"),
    (errors.ServiceError("decode failed this request"), 500, "internal_error"),
    (RuntimeError("boom"), 500, "internal_error"),
])
def test_request_path_failures_map_to_http_statuses(error, status, kind):
    failure = http_error(error)
    assert (failure.status, failure.kind) == (status, kind)
    assert failure.message == rpc.status_of(error)[1]  # the gRPC front's message, word for word
    body = failure.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert failure.response().headers.get("retry-after") == ("1" if status in (429, 503) else None)


def post(front: HttpFront, path: str, body: bytes, content_type: str | None, key: str | None = None
         ) -> tuple[int, dict]:
    """One request through the front's ASGI app, in-process: its status and JSON body."""
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type is not None:
        headers.append((b"content-type", content_type.encode()))
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    sent = []
    incoming = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(front.app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


@pytest.mark.parametrize("content_type,body", [
    ("text/plain", b'{"messages": [{"role": "user", "content": "hi"}]}'),
    ("text/plain; charset=utf-8", b'{"messages": [{"role": "user", "content": "hi"}]}'),
    ("application/x-www-form-urlencoded", b'{"messages": [{"role": "user", "content": "hi"}]}'),
    ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\n{}\r\n--x--\r\n'),
    ("application/jsonp", b'{"messages": [{"role": "user", "content": "hi"}]}'),
    (None, b'{"messages": [{"role": "user", "content": "hi"}]}'),
])
def test_a_body_that_is_not_declared_json_is_refused_with_415(content_type, body):
    """The types a browser sends cross-site without a preflight are never parsed as JSON."""
    stats = RequestStats()
    front = HttpFront(None, HttpConfig(), "tiny", "", lambda: True, stats)
    status, reply = post(front, "/v1/chat/completions", body, content_type)
    assert status == 415
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["code"] == "unsupported_media_type"
    assert "Content-Type: application/json" in reply["error"]["message"]
    assert (content_type or "no Content-Type") in reply["error"]["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_a_json_body_is_read(content_type):
    front = HttpFront(None, HttpConfig(), "tiny", "", lambda: True, RequestStats())
    # Past the Content-Type check, the body's own fault is what is reported.
    status, reply = post(front, "/v1/chat/completions", b'{"messages": []}', content_type)
    assert (status, reply["error"]["message"]) == (400, "messages must be a non-empty list")


@pytest.mark.parametrize("field", ["functions", "function_call", "audio", "modalities",
                                   "reasoning_effort", "prediction", "store", "metadata", "service_tier",
                                   "best_of", "use_beam_search", "length_penalty",
                                   "allowed_token_ids", "bad_words", "include_stop_str_in_output",
                                   "skip_special_tokens", "truncate_prompt_tokens", "add_generation_prompt",
                                   "continue_final_message", "chat_template", "priority", "kv_transfer_params"])
def test_the_refused_fields_docs_list_are_refused_by_name(field):
    """docs/OPERATIONS.md lists these as refused: each is, with its name in the message."""
    with pytest.raises(HttpError) as raised:
        build({"messages": user(), field: 1})
    assert raised.value.status == 400 and raised.value.message.startswith(f"{field}: not supported")
    front = HttpFront(None, HttpConfig(), "tiny", "", lambda: True, RequestStats())
    if field in ("best_of", "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words",
                 "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens", "priority",
                 "kv_transfer_params"):
        with pytest.raises(HttpError) as raised:
            asyncio.run(front.build_completion({"prompt": "hi", field: 1}, "cmpl-1"))
        assert raised.value.message.startswith(f"{field}: not supported")


def test_one_source_for_the_sampling_bounds_of_every_front_and_the_cli():
    """epd.limits is what the HTTP front, the request path and `epd generate` all check against."""
    from control import cli
    from epd import limits, sampling

    assert limits.MAX_LOGPROBS == sampling.MAX_LOGPROBS
    request, _ = build({"messages": user(), "temperature": limits.MAX_TEMPERATURE})
    assert request.sampling.temperature == pytest.approx(limits.MAX_TEMPERATURE)
    with pytest.raises(HttpError, match=r"temperature must be in \[0, 1e\+06\]"):
        build({"messages": user(), "temperature": limits.MAX_TEMPERATURE * 1.5})
    parser = cli._parser()
    args = parser.parse_args(["generate", "--addr", "h:1", "--prompt", "x", "--temperature",
                              str(limits.MAX_TEMPERATURE), "--max-pixels", "0"])
    assert args.temperature == limits.MAX_TEMPERATURE and args.max_pixels == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--addr", "h:1", "--prompt", "x", "--temperature",
                           str(limits.MAX_TEMPERATURE * 1.5)])


def _scope(path: str = "/v1/chat/completions", length: int | None = None) -> dict:
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}


def _requests_total(stats: RequestStats, status: str) -> float:
    family = next(f for f in stats.families() if f.name == "epd_requests_total")
    return sum(value for labels, value in family.samples.items() if labels[0] == "http" and labels[1] == status)


def test_past_the_open_request_cap_a_request_is_429_with_retry_after_and_counted():
    """Requests held open (here: bodies that have not arrived) fill the cap; the next one is
    answered 429 + Retry-After at once, before its body is read, and counted; /health still answers."""
    stats = RequestStats()
    front = HttpFront(None, HttpConfig(body_timeout_s=30), "tiny", "", lambda: True, stats, max_open_requests=2)

    async def scenario():
        never = asyncio.Event()

        async def stalled():  # a client that sent its headers and then nothing
            await never.wait()
            return {"type": "http.disconnect"}

        async def drop(message):
            pass

        held = [asyncio.ensure_future(front.app(_scope(length=100), stalled, drop)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert front.open_requests == 2
        sent = []

        async def send(message):
            sent.append(message)

        async def unread():
            raise AssertionError("the refused request's body was read")

        await front.app(_scope(length=100), unread, send)
        health = []

        async def health_send(message):
            health.append(message)

        await front.app({**_scope("/health"), "method": "GET"}, unread, health_send)
        never.set()
        await asyncio.gather(*held)
        assert front.open_requests == 0
        return sent, health

    sent, health = asyncio.run(scenario())
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = dict(start["headers"])
    assert start["status"] == 429 and headers[b"retry-after"] == b"1"
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert body["error"]["code"] == "resource_exhausted" and "limit 2" in body["error"]["message"]
    assert _requests_total(stats, "RESOURCE_EXHAUSTED") == 1
    assert next(m for m in health if m["type"] == "http.response.start")["status"] == 200


def test_a_body_that_does_not_arrive_in_time_is_408():
    stats = RequestStats()
    front = HttpFront(None, HttpConfig(body_timeout_s=0.3), "tiny", "", lambda: True, stats)
    parts = [{"type": "http.request", "body": b'{"messages": ', "more_body": True}]

    async def scenario():
        sent = []

        async def receive():  # the first bytes, then nothing more
            if parts:
                return parts.pop(0)
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)

        started = time.monotonic()
        await asyncio.wait_for(front.app(_scope(length=10_000), receive, send), 10)
        return sent, time.monotonic() - started

    sent, took = asyncio.run(scenario())
    assert next(m["status"] for m in sent if m["type"] == "http.response.start") == 408
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert "took longer than 0.3 s" in body["error"]["message"] and took < 5
    assert _requests_total(stats, "DEADLINE_EXCEEDED") == 1


def test_the_image_count_is_checked_before_any_url_is_fetched():
    from tests.media_server import MediaServer

    server = MediaServer({"/a.png": IMAGE})
    try:
        config = HttpConfig(allow_media_urls=True, allowed_media_domains=("127.0.0.1",))
        front = HttpFront(None, config, "tiny", "", lambda: True, RequestStats(), max_images=3)
        parts = [{"type": "image_url", "image_url": {"url": server.url(f"/a.png?n={n}")}} for n in range(4)]
        with pytest.raises(HttpError, match=r"request has 4 images; at most 3 images per request"):
            asyncio.run(front.build_request({"messages": user(*parts)}, "chatcmpl-1"))
        assert server.requests == []  # not one was fetched
        request, _ = asyncio.run(front.build_request({"messages": user(*parts[:3])}, "chatcmpl-2"))
        assert len(server.requests) == 3 and request.messages[0].content[0].image == IMAGE
    finally:
        server.close()


def test_a_large_body_and_data_url_are_parsed_off_the_event_loop():
    """A multi-megabyte body (JSON, then base64) is parsed on the executor: the loop stays free."""
    import threading

    from router_svc import http as http_module
    from router_svc import media as media_module

    front = HttpFront(None, HttpConfig(), "tiny", "", lambda: True, RequestStats())
    import io

    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(5).integers(0, 256, (512, 512, 3), dtype=np.uint8)  # does not compress
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="PNG")
    big = buffer.getvalue()
    body = json.dumps({"messages": user({"type": "image_url", "image_url": {"url": encode_data_url(big)}})}).encode()
    assert len(body) > http_module.OFF_LOOP_BYTES and len(body) > media_module.DATA_OFF_LOOP_CHARS
    threads = []
    real_loads, real_decode = json.loads, media_module.decode_data_url

    def watch(real):
        def call(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return real(*args, **kwargs)
        return call

    http_module.json.loads = watch(real_loads)
    media_module.decode_data_url = watch(real_decode)
    try:
        status_seen = []

        async def scenario():
            loop_thread = threading.current_thread().name
            incoming = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                return incoming.pop(0) if incoming else {"type": "http.disconnect"}

            from starlette.requests import Request

            request = Request(_scope(length=len(body)), receive)
            parsed = await front._read_json(request)
            messages = await front._messages(parsed["messages"])
            status_seen.append(loop_thread)
            return messages

        messages = asyncio.run(scenario())
    finally:
        http_module.json.loads = real_loads
        media_module.decode_data_url = real_decode
    assert messages[0].content[0].image == big
    assert len(threads) == 2 and status_seen[0] not in threads, threads


def test_a_named_tool_choice_constrains_the_request_with_its_grammar():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}]
    request, options = build({"messages": user(), "tools": tools,
                              "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert "<function=f>" in request.sampling.structured.grammar and options.tools == tools
    assert json.loads(request.tools_json) == tools
    with pytest.raises(HttpError, match="cannot be combined with a structured output"):
        build({"messages": user(), "tools": tools, "tool_choice": "required", "guided_regex": "x"})


def test_prompt_logprobs_maps_onto_the_request_and_its_bounds_are_named():
    request, options = build({"messages": user(), "prompt_logprobs": 5})
    assert request.sampling.prompt_logprobs == 5 and options.prompt_logprobs
    request, options = build({"messages": user(), "prompt_logprobs": 0})
    assert request.sampling.HasField("prompt_logprobs") and options.prompt_logprobs
    request, options = build({"messages": user(), "prompt_logprobs": None})
    assert not request.sampling.HasField("prompt_logprobs") and not options.prompt_logprobs
    for value, message in [(21, "prompt_logprobs must be an integer in [0, 20], got 21"),
                           (-1, "prompt_logprobs -1 (the whole vocabulary) is not supported"),
                           ("3", "prompt_logprobs must be an integer in [0, 20]"),
                           (True, "prompt_logprobs must be an integer in [0, 20]")]:
        with pytest.raises(HttpError) as raised:
            build({"messages": user(), "prompt_logprobs": value})
        assert raised.value.status == 400 and raised.value.message.startswith(message)
        assert raised.value.param == "prompt_logprobs"


class _Answers:
    """A RouterCore's generate and tokenizer, nothing else: the response side of the HTTP front in
    isolation (the events are the ones the request path yields)."""

    def __init__(self, tokenizer, events: list) -> None:
        self.builder, self.events = type("Builder", (), {"tokenizer": tokenizer})(), events

    async def generate(self, request, timeout_s, on_accepted=None):
        if on_accepted is not None:
            on_accepted()
        for event in self.events:
            yield event


def test_the_largest_prompt_logprobs_answer_is_encoded_off_the_event_loop(tiny_model_dir):
    """A prompt_logprobs answer at its bound (131,072 entries, megabytes of JSON) is built on the
    executor: the loop's longest stall while it is answered is a small part of the answer's time,
    so other streams and health probes go on being served. Whole and streamed."""
    from transformers import AutoTokenizer

    from epd import limits
    from epd.v1 import epd_pb2
    from router_svc.http import CompletionOptions, _CompletionCall

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    num_top = limits.MAX_PROMPT_LOGPROBS
    num = limits.MAX_PROMPT_LOGPROB_ENTRIES // (num_top + 1)
    entries = [epd_pb2.TokenLogprobs(token_id=(7 * p) % 600, logprob=-1.5, rank=3, top=[
        epd_pb2.TokenLogprob(token_id=(p + k) % 600, logprob=-0.1 * k) for k in range(num_top)]) for p in range(num)]
    first = epd_pb2.GenerateResponse(chunk=epd_pb2.TokenChunk(token_ids=[5], text="x", prompt_tokens=num + 1,
                                                               prompt_logprobs=entries))
    summary = epd_pb2.GenerateResponse(summary=epd_pb2.Summary(prompt_tokens=num + 1, completion_tokens=1,
                                                               finish_reason="length"))
    front = HttpFront(_Answers(tokenizer, [first, summary]), HttpConfig(), "tiny", "", lambda: True, RequestStats())

    async def answer(stream: bool) -> tuple[float, float, bytes]:
        options = CompletionOptions(stream=stream, prompt_logprobs=True, prompt_token_ids=list(range(num + 1)))
        call = _CompletionCall(front, epd_pb2.GenerateRequest(), options, "cmpl-1")
        sent: list[bytes] = []
        gaps, done = [0.0], asyncio.Event()

        async def send(message) -> None:
            sent.append(message.get("body", b""))

        async def receive():
            await done.wait()
            return {"type": "http.disconnect"}

        async def ticker() -> None:  # what every other stream and probe on this loop sees
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticking = asyncio.ensure_future(ticker())
        start = time.perf_counter()
        await call({"type": "http"}, receive, send)
        took = time.perf_counter() - start
        done.set()
        await ticking
        return max(gaps), took, b"".join(sent)

    # the objects earlier tests left in this process are not the answer's: a full collection over
    # them (hundreds of ms late in the suite) would stall the loop whoever holds the GIL
    gc.collect()
    gc.freeze()
    try:
        for stream in (False, True):
            stall, took, body = asyncio.run(answer(stream))
            text = body.decode()
            start = text.index('"prompt_logprobs":')
            assert text.count('"decoded_token"') >= num * num_top and start > 0
            assert stall < took / 3, (stream, stall, took)
    finally:
        gc.unfreeze()
