"""The OpenAI-compatible HTTP front of a router replica: ``POST /v1/chat/completions`` (plain and
streamed as server-sent events), ``GET /v1/models``, ``GET /health``, and vLLM's ``GET /version``,
``POST /tokenize`` and ``POST /detokenize``. Every POST body must be ``application/json`` (415
otherwise: no simple cross-site request from a browser reaches the request path).

It runs in the router's own process, on the router's event loop (uvicorn's ``Server.serve`` as a
task beside the gRPC server), and calls the same ``RouterCore.generate`` the gRPC front calls: no
extra hop, the same validation, the same messages. What the request path raises maps to an HTTP
status once (``http_status``): bad input 400, unknown model 404, body too large 413, refused for
load 429, unavailable 503, past its deadline 504; the body is OpenAI's error shape. A request is
checked whole before anything is sent: fields this server does not implement are refused by name
(400), never ignored. A client that goes away cancels its request (the generate task is
cancelled, which frees its decode slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from epd import limits, logs, rpc
from epd.config import HttpConfig, RouterConfig
from epd.metrics import render
from epd.v1 import epd_pb2
from router_svc import chat_output
from router_svc.chat_output import AnswerParser
from router_svc.core import RouterCore
from router_svc.media import MediaError, MediaLoader
from router_svc.stats import RequestStats

log = logging.getLogger(__name__)

MAX_LOGPROBS = limits.MAX_LOGPROBS
MAX_CHOICES = 16  # n: each choice is a request of its own
OFF_LOOP_BYTES = 256 * 1024
"""A JSON body or data: URL at least this large is parsed on the loop's executor, not on the loop."""
# Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
# Fields of OpenAI's chat completion request this server implements (None counts as absent).
SUPPORTED = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "logprobs", "top_logprobs", "n", "stream", "stream_options", "mm_processor_kwargs", "chat_template_kwargs",
    "ignore_eos", "return_token_ids", "user", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_p", "min_tokens", "logit_bias", "stop_token_ids", "cache_salt", *STRUCTURED_FIELDS,
    "tools", "tool_choice", "parallel_tool_calls", "prompt_logprobs",
}
# POST /v1/completions' fields (the legacy API; None counts as absent).
COMPLETION_FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "echo", "n",
    "stream", "stream_options", "ignore_eos", "return_token_ids", "user", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_p", "min_tokens", "logit_bias", "stop_token_ids", "cache_salt", *STRUCTURED_FIELDS,
    "prompt_logprobs",
}
# POST /tokenize's fields, vLLM's two forms (None counts as absent).
TOKENIZE_TEXT = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT = {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                 "return_token_strs", "chat_template_kwargs", "mm_processor_kwargs", "tools"}
try:
    VERSION = importlib.metadata.version("epd")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown"
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


# The status label of a request the HTTP front refused itself (requests_total counts them as the gRPC front would).
STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                408: "DEADLINE_EXCEEDED",
                413: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE",
                504: "DEADLINE_EXCEEDED"}


class HttpError(Exception):
    """A request refused with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"retry-after": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def http_error(error: BaseException) -> HttpError:
    """What an error of the request path becomes at the HTTP front (the gRPC front's mapping, then HTTP's)."""
    if isinstance(error, HttpError):
        return error
    code, message = rpc.status_of(error)
    status, kind = HTTP_STATUS.get(code, (500, "internal_error"))
    return HttpError(status, message, kind, code=code.name.lower())


@dataclass(frozen=True)
class ChatOptions:
    """What shapes the response rather than the generation."""

    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    token_ids: bool = False
    n: int = 1  # choices: n requests run concurrently (seeds seed, seed + 1, ...)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    tools: list | None = None  # parse the answer's tool calls against these (tool_choice auto)
    single_call: bool = False  # parallel_tool_calls: false
    reasoning: bool = False  # the server's reasoning parser is on
    in_reasoning: bool = False  # ... and the prompt opened a think block (enable_thinking)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked: the response's top-level list

    def parser(self) -> AnswerParser | None:
        if self.tools is None and not self.reasoning:
            return None
        return AnswerParser(self.reasoning, self.in_reasoning, self.tools, 1 if self.single_call else None)


@dataclass(frozen=True)
class CompletionOptions:
    """What shapes a (legacy) completion's response."""

    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # the legacy integer: alternatives per token (0: the sampled token's only)
    echo: str = ""  # the prompt's text, put before the completion (echo: true)
    token_ids: bool = False
    prompt_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    continuous_usage: bool = False
    prompt_logprobs: bool = False  # each choice's prompt_logprobs list (asked, or implied by echo with logprobs)
    echo_logprobs: bool = False  # echo with logprobs: the logprobs object covers the prompt's tokens first


class HttpFront:
    def __init__(self, core: RouterCore, config: HttpConfig, model_name: str, api_key: str,
                 healthy: Callable[[], bool], stats: RequestStats,
                 metrics: Callable[[], list] | None = None, tls_cert: str = "", tls_key: str = "",
                 max_request_mb: int = 64, max_images: int | None = None, max_open_requests: int = 4096,
                 max_tokens_limit: int | None = None) -> None:
        self.core, self.config, self.model_name = core, config, model_name
        self.tls = (tls_cert, tls_key) if tls_cert and tls_key else None  # the public gRPC port's certificate
        self.read_metrics = metrics
        self._api_key = api_key.encode()
        self.healthy, self.stats = healthy, stats
        self.media = MediaLoader(config)
        self.max_body = max_request_mb << 20  # the Router's cap (--max-request-mb), as on the gRPC port
        # max_tokens' bound is the deployment's (--max-tokens-limit), the one the gRPC front applies.
        self.max_tokens_limit = max_tokens_limit if max_tokens_limit is not None else RouterConfig().max_tokens_limit
        self.created = int(time.time())
        # Counted before any image URL is fetched: the request path would refuse more anyway.
        self.max_images = max_images if max_images is not None else RouterConfig().max_images_per_request
        self.max_open_requests = max_open_requests
        self.open_requests = 0
        self.starlette = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})
        self.server = None
        self._task: asyncio.Task | None = None
        self.port = 0

    async def app(self, scope, receive, send) -> None:
        """The ASGI app uvicorn serves: Starlette's routes behind the open-request cap. Past
        ``max_open_requests`` a request is answered 429 with Retry-After before anything of it is
        read (counted in epd_requests_total{front="http",status="RESOURCE_EXHAUSTED"}, as the
        router's own admission refusals are); /health and /metrics always pass, so a full front
        still says how it is."""
        if scope["type"] != "http" or scope.get("path") in ("/health", "/metrics"):
            return await self.starlette(scope, receive, send)
        if self.open_requests >= self.max_open_requests:
            self.stats.refused("http", "RESOURCE_EXHAUSTED", f"{self.open_requests} HTTP requests open")
            error = HttpError(429, f"router: {self.open_requests} HTTP requests are open (limit "
                              f"{self.max_open_requests}, --http-max-open-requests); retry in a few seconds or on "
                              "another router", "rate_limit_error", code="resource_exhausted")
            return await _send_json(send, 429, error.body(), {"retry-after": "1", "connection": "close"})
        self.open_requests += 1
        try:
            await self.starlette(scope, receive, send)
        finally:
            self.open_requests -= 1

    # ------------------------------------------------------------ lifecycle (on the router's loop)

    async def start(self, host: str, port: int) -> int:
        """Bind ``host:port`` (0: a free port) and serve; returns the port."""
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            sock.close()
            raise OSError(f"cannot bind the HTTP front to {host}:{port}: {error.strerror}") from None
        sock.listen(1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        tls = {"ssl_certfile": self.tls[0], "ssl_keyfile": self.tls[1]} if self.tls else {}
        # uvicorn's own connection cap stands behind the open-request cap (idle keep-alive
        # connections count there too): past it uvicorn answers 503 itself.
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", server_header=False,
                                timeout_graceful_shutdown=5, h11_max_incomplete_event_size=64 * 1024,
                                limit_concurrency=2 * self.max_open_requests + 64, interface="asgi3", **tls)
        self.server = uvicorn.Server(config)
        self._task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise OSError("the HTTP front stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self.server is not None and self._task is not None:
            self.server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            except Exception:  # noqa: BLE001 - stopping regardless
                self.server.force_exit = True

    # ------------------------------------------------------------ endpoints

    async def health(self, request: Request) -> Response:
        """The same truth as gRPC health: every role this router calls has a replica, and it is not shutting down."""
        if self.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        """This router's Prometheus metrics (the same as --router-metrics-port serves), as vLLM serves them."""
        if self.read_metrics is None:
            return HttpError(404, "no metrics here", "not_found_error").response()
        body, content_type = await asyncio.get_running_loop().run_in_executor(None, render, self.read_metrics)
        return Response(body, media_type=content_type)

    async def models(self, request: Request) -> Response:
        refused = self._unauthorized(request)
        if refused:
            return refused.response()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        refused = self._unauthorized(request)
        if refused:
            return refused.response()
        if request.path_params["model"] != self.model_name:
            return self._unknown_model(request.path_params["model"]).response()
        return JSONResponse(self._model_card())

    async def version(self, request: Request) -> Response:
        """vLLM's ``GET /version``: this server's version (open, as /health is)."""
        return JSONResponse({"version": VERSION})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: ``{"prompt": str}`` tokenized as it is, or ``{"messages": [...]}``
        as a chat request's prompt (the same template and plain-text rules, image placeholders
        expanded to each image's token count: what ``usage.prompt_tokens`` counts). Answers
        ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        async def answer(body: dict) -> dict:
            body = {key: value for key, value in body.items() if value is not None}
            self._check_model(body)
            strs = _bool(body, "return_token_strs")
            tokenizer = self.core.builder.tokenizer
            loop = asyncio.get_running_loop()
            if "messages" in body:
                _refuse_unknown(body, TOKENIZE_CHAT)
                if body.get("continue_final_message"):
                    raise HttpError(400, "continue_final_message is not supported by this server",
                                    param="continue_final_message", code="unsupported_parameter")
                if _bool(body, "add_special_tokens"):
                    raise HttpError(400, "add_special_tokens with messages is not supported by this server: the "
                                    "chat template places every special token", param="add_special_tokens",
                                    code="unsupported_parameter")
                generation = _bool({"add_generation_prompt": True, **body}, "add_generation_prompt")
                template = _object(body, "chat_template_kwargs", {"enable_thinking"})
                thinking = _bool(template, "enable_thinking", "chat_template_kwargs.enable_thinking")
                mm = _object(body, "mm_processor_kwargs", MM_KWARGS)
                max_pixels = _integer(mm, "max_pixels", 0, limits.MAX_PIXELS, "mm_processor_kwargs.max_pixels") \
                    if "max_pixels" in mm else None
                messages = await self._messages(body.get("messages"), _video_options(mm, "mm_processor_kwargs"))
                tools, _ = _tools({"tools": body["tools"], "tool_choice": "none"}) if "tools" in body else (None, 0)
                prompt = await loop.run_in_executor(None, self.core.builder.build, messages, max_pixels, thinking,
                                                    generation, json.dumps(tools) if tools else "")
                ids = prompt.token_ids
            elif "prompt" in body:
                _refuse_unknown(body, TOKENIZE_TEXT)
                if not isinstance(body["prompt"], str):
                    raise HttpError(400, "prompt must be a string", param="prompt")
                special = _bool({"add_special_tokens": True, **body}, "add_special_tokens")
                limit = self.core.builder.max_text_chars
                if limit is not None and len(body["prompt"]) > limit:
                    raise HttpError(400, f"prompt is {len(body['prompt'])} characters, more than the {limit} a "
                                    f"context window of {self.core.max_model_len} tokens can hold", param="prompt")
                ids = (await loop.run_in_executor(None, lambda: tokenizer(body["prompt"],
                                                                          add_special_tokens=special)))["input_ids"]
            else:
                raise HttpError(400, "send either prompt (a string) or messages (a chat)", param="prompt")
            return {"count": len(ids), "max_model_len": self.core.max_model_len, "tokens": list(ids),
                    "token_strs": tokenizer.convert_ids_to_tokens(list(ids)) if strs else None}

        return await self._utility(request, answer)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
        async def answer(body: dict) -> dict:
            body = {key: value for key, value in body.items() if value is not None}
            self._check_model(body)
            _refuse_unknown(body, {"model", "tokens"})
            tokens = body.get("tokens")
            size = len(self.core.builder.tokenizer)
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise HttpError(400, "tokens must be a list of token ids (integers)", param="tokens")
            bad = [t for t in tokens if not 0 <= t < size]
            if bad:
                raise HttpError(400, f"tokens: {bad[0]} is not a token id of this model (0 to {size - 1})",
                                param="tokens")
            text = await asyncio.get_running_loop().run_in_executor(None, self.core.builder.tokenizer.decode, tokens)
            return {"prompt": text}

        return await self._utility(request, answer)

    async def _utility(self, request: Request, answer) -> Response:
        """A tokenizer endpoint: the API key, a JSON body, the answer or OpenAI's error shape."""
        try:
            refused = self._unauthorized(request)
            if refused:
                raise refused
            return JSONResponse(await answer(await self._read_json(request)))
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as error:  # noqa: BLE001 - every refusal leaves in OpenAI's shape
            failure = http_error(error)
            if failure.status >= 500:
                log.warning("http %s: %s", request.url.path, failure.message)
            return failure.response()

    def _check_model(self, body: dict) -> None:
        if "model" in body and body["model"] != self.model_name:
            if not isinstance(body["model"], str):
                raise HttpError(400, "model must be a string", param="model")
            raise self._unknown_model(body["model"])

    async def chat_completions(self, request: Request) -> Response:
        return await self._generation(request, f"chatcmpl-{uuid.uuid4().hex}", self.build_request, _ChatCall)

    async def completions(self, request: Request) -> Response:
        """The legacy ``POST /v1/completions``: a prompt (text or token ids) completed as it is."""
        return await self._generation(request, f"cmpl-{uuid.uuid4().hex}", self.build_completion, _CompletionCall)

    async def _generation(self, request: Request, request_id: str, build, call) -> Response:
        logs.REQUEST_ID.set(request_id)
        try:
            refused = self._unauthorized(request)
            if refused:
                raise refused
            body = await self._read_json(request)
            proto, options = await build(body, request_id)
        except ClientDisconnect:  # gone before its request was whole: nothing to answer
            return Response(status_code=499)
        except Exception as error:  # noqa: BLE001 - every refusal leaves in OpenAI's shape
            failure = http_error(error)
            if failure.status >= 500:
                log.warning("http request %s: %s", request_id, failure.message)
            self.stats.refused("http", STATUS_NAMES.get(failure.status, "INTERNAL"), failure.message)
            return failure.response()
        return call(self, proto, options, request_id)

    async def _not_found(self, request: Request, exc) -> Response:
        return HttpError(404, f"no route {request.method} {request.url.path}", "not_found_error").response()

    async def _not_allowed(self, request: Request, exc) -> Response:
        return HttpError(405, f"{request.method} is not allowed on {request.url.path}", "invalid_request_error"
                         ).response()

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "epd",
                "max_model_len": self.core.max_model_len}

    def _unknown_model(self, name: str) -> HttpError:
        return HttpError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                         "invalid_request_error", "model", "model_not_found")

    def _unauthorized(self, request: Request) -> HttpError | None:
        if not self._api_key:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._api_key):
            return None
        # Never echo what was sent: it may be a real key meant for somewhere else.
        return HttpError(401, "missing or wrong API key: send Authorization: Bearer KEY", "authentication_error",
                         code="invalid_api_key")

    async def _read_json(self, request: Request) -> dict:
        _check_json_type(request)
        length = request.headers.get("content-length", "")
        chunks, size = [], 0
        too_large = length.isdigit() and int(length) > self.max_body
        try:
            async with asyncio.timeout(self.config.body_timeout_s):  # a client that trickles its body
                async for chunk in request.stream():
                    size += len(chunk)
                    too_large = too_large or size > self.max_body
                    if size > 4 * self.max_body:
                        break
                    if not too_large:
                        chunks.append(chunk)
                    # Past the cap the rest is read and dropped (up to a bound) before answering: most clients
                    # send the whole body before they read a reply, and would see a reset connection, not the 413.
        except TimeoutError:
            raise HttpError(408, f"the request body took longer than {self.config.body_timeout_s:g} s to arrive "
                            "(--http-body-timeout-s)", code="request_timeout") from None
        if too_large:
            raise self._too_large()
        data = b"".join(chunks)
        try:
            # A large body is parsed on the executor: the loop keeps serving every other request meanwhile.
            body = json.loads(data) if len(data) < OFF_LOOP_BYTES else \
                await asyncio.get_running_loop().run_in_executor(None, json.loads, data)
        except (ValueError, UnicodeDecodeError) as error:
            raise HttpError(400, f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        return body

    def _too_large(self) -> HttpError:
        return HttpError(413, f"the request body is larger than {self.max_body} bytes (--max-request-mb); send "
                         "smaller images, or fewer", code="request_too_large")

    # ------------------------------------------------------------ request -> GenerateRequest

    def _common_fields(self, body: dict, allowed: set[str]) -> tuple[dict, int, bool, bool, bool]:
        """What chat and completions check alike: unknown fields, the model, ``n``, ``stream`` and
        its options. Returns the body without null fields, n, stream, include_usage, continuous."""
        body = {key: value for key, value in body.items() if value is not None}
        unsupported = sorted(set(body) - allowed)
        if unsupported:
            raise HttpError(400, f"{', '.join(unsupported)}: not supported by this server", param=unsupported[0],
                            code="unsupported_parameter")
        if "model" in body and body["model"] != self.model_name:
            if not isinstance(body["model"], str):
                raise HttpError(400, "model must be a string", param="model")
            raise self._unknown_model(body["model"])
        n = _integer(body, "n", 1, MAX_CHOICES) if "n" in body else 1
        stream = _bool(body, "stream")
        stream_options = _object(body, "stream_options", {"include_usage", "continuous_usage_stats"})
        if stream_options and not stream:
            raise HttpError(400, "stream_options is only allowed with stream: true", param="stream_options")
        include_usage = _bool(stream_options, "include_usage", "stream_options.include_usage")
        continuous = _bool(stream_options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
        return body, n, stream, include_usage, continuous

    async def build_request(self, body: dict, request_id: str) -> tuple[epd_pb2.GenerateRequest, ChatOptions]:
        """Check every field and build the request; raises HttpError naming the field."""
        body, n, stream, include_usage, continuous = self._common_fields(body, SUPPORTED)
        logprobs = _bool(body, "logprobs")
        top_logprobs = _integer(body, "top_logprobs", 0, MAX_LOGPROBS) if "top_logprobs" in body else 0
        if top_logprobs and not logprobs:
            raise HttpError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

        sampling = _sampling_params(body, self.max_tokens_limit)
        if logprobs:
            sampling.logprobs = max(1, top_logprobs)  # the sampled token's logprob comes with the top list
        if "prompt_logprobs" in body:
            sampling.prompt_logprobs = _prompt_logprobs(body)

        request = epd_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
        mm = _object(body, "mm_processor_kwargs", MM_KWARGS)
        if "max_pixels" in mm:
            request.max_pixels = _integer(mm, "max_pixels", 0, limits.MAX_PIXELS, "mm_processor_kwargs.max_pixels")
        template = _object(body, "chat_template_kwargs", {"enable_thinking"})
        request.enable_thinking = _bool(template, "enable_thinking", "chat_template_kwargs.enable_thinking")
        if "user" in body and not isinstance(body["user"], str):
            raise HttpError(400, "user must be a string", param="user")
        request.cache_salt = _cache_salt(body)
        request.messages.extend(await self._messages(body.get("messages"), _video_options(mm, "mm_processor_kwargs")))
        tools, parse_tools = _tools(body)
        if tools:
            request.tools_json = json.dumps(tools)
        forced = _forced_calls(body, tools)
        if forced:
            if request.sampling.HasField("structured"):
                raise HttpError(400, "tool_choice 'required' or a named function constrains the answer itself: it "
                                "cannot be combined with a structured output", param="tool_choice")
            request.sampling.structured.grammar = forced
        options = ChatOptions(stream=stream, include_usage=include_usage, logprobs=logprobs, top_logprobs=top_logprobs,
                              token_ids=_bool(body, "return_token_ids"), n=n, continuous_usage=continuous,
                              tools=tools if parse_tools else None,
                              single_call=body.get("parallel_tool_calls") is False,
                              reasoning=bool(self.config.reasoning_parser), in_reasoning=request.enable_thinking,
                              prompt_logprobs=sampling.HasField("prompt_logprobs"))
        request.return_prompt_token_ids = options.token_ids
        return request, options

    async def build_completion(self, body: dict, request_id: str) -> tuple[epd_pb2.GenerateRequest, CompletionOptions]:
        """``POST /v1/completions``: check every field and build the request (the prompt tokenized
        here, as the request path would, so ``echo`` and ``return_token_ids`` know it)."""
        body, n, stream, include_usage, continuous = self._common_fields(body, COMPLETION_FIELDS)
        logprobs = _integer(body, "logprobs", 0, MAX_LOGPROBS) if "logprobs" in body else None
        echo = _bool(body, "echo")
        if "user" in body and not isinstance(body["user"], str):
            raise HttpError(400, "user must be a string", param="user")
        text, ids = _completion_prompt(body.get("prompt"))
        sampling = _sampling_params(body, self.max_tokens_limit)
        if logprobs is not None:
            sampling.logprobs = max(1, logprobs)
        if "prompt_logprobs" in body:
            sampling.prompt_logprobs = _prompt_logprobs(body)
        elif echo and logprobs is not None:  # vLLM: the echoed prompt's logprobs come with as many alternatives
            sampling.prompt_logprobs = logprobs
        builder = self.core.builder
        prompt = await asyncio.get_running_loop().run_in_executor(None, builder.build_completion, text, ids)
        request = epd_pb2.GenerateRequest(request_id=request_id, sampling=sampling, prompt_token_ids=prompt.token_ids,
                                          cache_salt=_cache_salt(body))
        echoed = (text if text else builder.tokenizer.decode(prompt.token_ids)) if echo else ""
        options = CompletionOptions(stream=stream, include_usage=include_usage, logprobs=logprobs, echo=echoed,
                                    token_ids=_bool(body, "return_token_ids"), prompt_token_ids=prompt.token_ids,
                                    n=n, continuous_usage=continuous,
                                    prompt_logprobs=sampling.HasField("prompt_logprobs"),
                                    echo_logprobs=echo and logprobs is not None)
        return request, options


    async def _messages(self, messages, video_options: dict | None = None) -> list[epd_pb2.ChatMessage]:
        """``video_options``: the request's ``fps`` / ``max_frames`` for every clip (a clip's own
        ``video_url`` object may set them, and ``max_pixels``, for itself)."""
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", param="messages")
        out, loads = [], []
        for m_index, message in enumerate(messages):
            where = f"messages[{m_index}]"
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise HttpError(400, f"{where} must be an object with a string role", param="messages")
            extra = sorted(set(k for k, v in message.items() if v is not None)
                           - {"role", "content", "name", "tool_calls", "tool_call_id"})
            if extra:
                raise HttpError(400, f"{where}: {', '.join(extra)} not supported by this server", param="messages",
                                code="unsupported_parameter")
            content = message.get("content")
            if content is None and message["role"] == "assistant" and message.get("tool_calls"):
                content = ""  # a turn of calls only (OpenAI sends content null)
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(parts, list):
                raise HttpError(400, f"{where}.content must be a string or a list of parts", param="messages")
            name = message.get("name")
            if name is not None and not isinstance(name, str):
                raise HttpError(400, f"{where}.name must be a string", param="messages")
            chat = epd_pb2.ChatMessage(role=message["role"], name=name or "")
            _message_tools(message, chat, where)
            for p_index, part in enumerate(parts):
                here = f"{where}.content[{p_index}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
                    chat.content.append(epd_pb2.ContentPart(text=part["text"]))
                elif kind == "image_url":
                    chat.content.append(epd_pb2.ContentPart(image=b""))
                    loads.append((chat.content[-1], _image_url(part, here), here, "image"))
                elif kind == "video_url":
                    url, options = _video_url(part, here)
                    chat.content.append(epd_pb2.ContentPart(video=epd_pb2.VideoPart(**{**(video_options or {}),
                                                                                       **options})))
                    loads.append((chat.content[-1], url, here, "video"))
                else:
                    raise HttpError(400, f'{here} must be {{"type": "text", "text": STR}}, {{"type": "image_url", '
                                    f'"image_url": {{"url": URL}}}} or {{"type": "video_url", "video_url": {{"url": '
                                    f'URL}}}}; got type {kind!r}', param="messages",
                                    code="unsupported_parameter" if kind else None)
            out.append(chat)
        if len(loads) > self.max_images:  # before any URL is fetched or any data: URL decoded
            raise HttpError(400, f"request has {len(loads)} images; at most {self.max_images} images per request "
                            "are allowed (router.max_images_per_request; a video clip counts as an image)", param="messages")
        if loads:
            results = await asyncio.gather(*(self.media.load(url, where, kind) for _, url, where, kind in loads),
                                           return_exceptions=True)
            for (part, _, _, _), result in zip(loads, results):
                if isinstance(result, MediaError):
                    raise HttpError(400, str(result), param="messages")
                if isinstance(result, BaseException):
                    raise result
                if part.WhichOneof("part") == "video":
                    part.video.data = result
                else:
                    part.image = result
        return out

    # ------------------------------------------------------------ response pieces

    def logprobs_json(self, entries, options: ChatOptions, token_ids) -> list[dict]:
        tokenizer = self.core.builder.tokenizer
        out = []
        for token_id, entry in zip(token_ids, entries):
            text = tokenizer.decode([token_id])
            top = []
            for alt in list(entry.top)[:options.top_logprobs]:
                alt_text = tokenizer.decode([alt.token_id])
                top.append({"token": alt_text, "logprob": alt.logprob, "bytes": list(alt_text.encode())})
            out.append({"token": text, "logprob": entry.logprob, "bytes": list(text.encode()), "top_logprobs": top})
        return out

    def prompt_logprobs_json(self, entries) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: null for the first prompt token, then for each next one
        ``{token id: {"logprob", "rank", "decoded_token"}}``: the prompt token itself first, then
        the top alternatives (ranks 1, 2, ...), the prompt token once if it is among them."""
        decoded = _Decoded(self.core.builder.tokenizer)
        out: list[dict | None] = [None]
        for entry in entries:
            step = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                          "decoded_token": decoded(entry.token_id)}}
            for rank, alt in enumerate(entry.top, start=1):
                step.setdefault(str(alt.token_id), {"logprob": alt.logprob, "rank": rank,
                                                    "decoded_token": decoded(alt.token_id)})
            out.append(step)
        return out


class _Decoded:
    """Each token id's text, decoded once per response (a prompt's logprobs repeat ids often)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.texts = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = self.tokenizer.decode([token_id])
        return text


def _prompt_logprobs(body: dict) -> int:
    """vLLM's ``prompt_logprobs``: alternatives per prompt token, [0, MAX_PROMPT_LOGPROBS] (vLLM's
    -1, the whole vocabulary, is refused: an answer of vocabulary x prompt entries)."""
    value = body["prompt_logprobs"]
    if isinstance(value, int) and not isinstance(value, bool) and value == -1:
        raise HttpError(400, f"prompt_logprobs -1 (the whole vocabulary) is not supported by this server; at most "
                        f"{limits.MAX_PROMPT_LOGPROBS}", param="prompt_logprobs", code="unsupported_parameter")
    return _integer(body, "prompt_logprobs", 0, limits.MAX_PROMPT_LOGPROBS)


def _sampling_params(body: dict, max_tokens_limit: int) -> epd_pb2.SamplingParams:
    """The generation fields chat and completions share (``logprobs`` is each one's own), bounded
    as every front bounds them (``epd.limits``, the deployment's ``--max-tokens-limit``)."""
    sampling = epd_pb2.SamplingParams()
    tokens = [name for name in ("max_completion_tokens", "max_tokens") if name in body]
    if len(tokens) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise HttpError(400, "max_tokens and max_completion_tokens differ; send one", param="max_tokens")
    if tokens:  # the deployment's own limit (--max-tokens-limit), in the gRPC front's words
        sampling.max_tokens = _max_tokens(body, tokens[0], max_tokens_limit)
    if "temperature" in body:
        sampling.temperature = _number(body, "temperature")
        try:
            limits.check_temperature(sampling.temperature)  # the bound (and words) of every front
        except ValueError as error:
            raise HttpError(400, str(error), param="temperature", code="invalid_argument") from None
    if "top_p" in body:
        sampling.top_p = _number(body, "top_p")
    if "top_k" in body:
        top_k = _integer(body, "top_k", -1, limits.MAX_TOP_K)
        sampling.top_k = 0 if top_k == -1 else top_k  # vLLM's -1 means off, as 0 does here
    if "seed" in body:
        sampling.seed = _integer(body, "seed", 0, limits.MAX_SEED)
    if "stop" in body:
        stop = body["stop"]
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise HttpError(400, "stop must be a non-empty string or a list of them", param="stop")
        sampling.stop.extend(stops)
    sampling.ignore_eos = _bool(body, "ignore_eos")
    _logits_processing(body, sampling)
    structured = _structured(body)
    if structured is not None:
        sampling.structured.CopyFrom(structured)
    return sampling


def _structured(body: dict) -> epd_pb2.StructuredOutput | None:
    """OpenAI's ``response_format`` (text, json_object, json_schema), vLLM's ``structured_outputs``
    (json, regex, choice, grammar, json_object) or its older ``guided_*`` fields, as one
    ``StructuredOutput`` (None: unconstrained). At most one constraint per request. Whether a schema,
    regex or grammar is valid is the request path's check (``epd.grammar``: 400 naming the problem)."""
    found: list[tuple[str, str, object]] = []  # (field as the client named it, kind, value)
    if "response_format" in body:
        fmt = body["response_format"]
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise HttpError(400, 'response_format must be an object with a type: "text", "json_object" or '
                            '"json_schema"', param="response_format")
        kind = fmt["type"]
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
                raise HttpError(400, 'response_format.json_schema must be {"name": ..., "schema": {...}}',
                                param="response_format")
            unknown = sorted(set(spec) - {"name", "schema", "json_schema", "strict", "description"})
            if unknown:
                raise HttpError(400, f"response_format.json_schema: {', '.join(unknown)} not supported by this "
                                "server", param="response_format", code="unsupported_parameter")
            found.append(("response_format", "json_schema", spec.get("schema", spec.get("json_schema"))))
        elif kind == "json_object":
            found.append(("response_format", "json_object", True))
        elif kind != "text":
            raise HttpError(400, f"response_format.type {kind!r} is not supported by this server (text, json_object "
                            "or json_schema)", param="response_format", code="unsupported_parameter")
    if "structured_outputs" in body:
        spec = _object(body, "structured_outputs", set(STRUCTURED_KINDS))
        for key in STRUCTURED_KINDS:
            if key in spec and not (key == "json_object" and spec[key] is False):
                found.append((f"structured_outputs.{key}", STRUCTURED_KINDS[key], spec[key]))
    for key in ("json", "regex", "choice", "grammar"):
        if f"guided_{key}" in body:
            found.append((f"guided_{key}", STRUCTURED_KINDS[key], body[f"guided_{key}"]))
    if not found:
        return None
    if len(found) > 1:
        raise HttpError(400, f"{found[0][0]} and {found[1][0]}: send one structured output per request",
                        param=found[1][0].split(".")[0])
    name, kind, value = found[0]
    out = epd_pb2.StructuredOutput()
    param = name.split(".")[0]
    if kind == "json_schema":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            text = value
        elif isinstance(value, (dict, bool)):
            text = json.dumps(value)
        else:
            raise HttpError(400, f"{name} must be a JSON Schema (an object)", param=param)
        out.json_schema = text
    elif kind == "json_object":
        if value is not True:
            raise HttpError(400, f"{name} must be true", param=param)
        out.json_object = True
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise HttpError(400, f"{name} must be a non-empty list of strings", param=param)
        out.choice.values.extend(value)
    else:
        if not isinstance(value, str) or not value:
            raise HttpError(400, f"{name} must be a non-empty string", param=param)
        setattr(out, kind, value)
    return out


def _tools(body: dict) -> tuple[list | None, bool]:
    """``tools`` and ``tool_choice``: the tools (rendered by the chat template; their shape is the
    request path's check) and whether the answer's calls are parsed (``auto``, the default; not
    with ``none``; ``required`` and a named function are also forced: ``_forced_calls``)."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if "parallel_tool_calls" in body:
        _bool(body, "parallel_tool_calls")
    if tools is None:
        if choice != "none":
            raise HttpError(400, "tool_choice needs tools", param="tool_choice")
        return None, False
    if not isinstance(tools, list) or not tools:
        raise HttpError(400, "tools must be a non-empty list of functions", param="tools")
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str):
            raise HttpError(400, 'a named tool_choice is {"type": "function", "function": {"name": STR}}',
                            param="tool_choice")
        return tools, True
    if choice not in ("auto", "none", "required"):
        raise HttpError(400, "tool_choice must be 'auto', 'none', 'required' or a named function",
                        param="tool_choice")
    return tools, choice != "none"


def _forced_calls(body: dict, tools: list | None) -> str:
    """``tool_choice`` ``required`` or a named function: the Lark grammar that makes the answer
    such a call (``chat_output.forced_calls_grammar``, decoded under llguidance like any
    structured output); "" otherwise."""
    choice = body.get("tool_choice")
    if not tools or not (choice == "required" or isinstance(choice, dict)):
        return ""
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise HttpError(400, f'tools[{index}] must be {{"type": "function", "function": {{"name": STR, ...}}}}',
                            param="tools")
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    try:
        return chat_output.forced_calls_grammar(tools, name, body.get("parallel_tool_calls") is not False)
    except ValueError as error:
        raise HttpError(400, str(error), param="tool_choice") from None


def _message_tools(message: dict, chat: epd_pb2.ChatMessage, where: str) -> None:
    """An assistant message's ``tool_calls`` and a tool message's ``tool_call_id`` into ``chat``."""
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise HttpError(400, f"{where}.tool_calls must be a list", param="messages")
        for c_index, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise HttpError(400, f'{where}.tool_calls[{c_index}] must be {{"id", "type": "function", "function": '
                                '{"name": STR, "arguments": JSON TEXT}}', param="messages")
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, dict):
                arguments = json.dumps(arguments)
            if not isinstance(arguments, str):
                raise HttpError(400, f"{where}.tool_calls[{c_index}].function.arguments must be a JSON text",
                                param="messages")
            call_id = call.get("id") or ""
            if not isinstance(call_id, str):
                raise HttpError(400, f"{where}.tool_calls[{c_index}].id must be a string", param="messages")
            chat.tool_calls.append(epd_pb2.ToolCall(id=call_id, name=function["name"], arguments=arguments))
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise HttpError(400, f"{where}.tool_call_id must be a string", param="messages")
        chat.tool_call_id = call_id


def _cache_salt(body: dict) -> str:
    """vLLM's ``cache_salt``: a non-empty string (its length is checked by the request path)."""
    salt = body.get("cache_salt", "")
    if not isinstance(salt, str) or ("cache_salt" in body and not salt):
        raise HttpError(400, "cache_salt must be a non-empty string", param="cache_salt")
    return salt


def _completion_prompt(prompt) -> tuple[str, list[int]]:
    """A completion's ``prompt``: a string, token ids, or a list holding one of those."""
    shape = "prompt must be a string, a list of token ids, or a list of one of those"
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise HttpError(400, f"prompt: one prompt per request on this server, got {len(prompt)}; send them as "
                            "separate requests", param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise HttpError(400, "prompt is empty", param="prompt")
        return prompt, []
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                                   for t in prompt):
        return "", prompt
    raise HttpError(400, shape, param="prompt")


def _logits_processing(body: dict, sampling: epd_pb2.SamplingParams) -> None:
    """vLLM's logits-processing fields into ``sampling``: the JSON shapes are checked here, the
    ranges by the request path (``RouterCore``; the same INVALID_ARGUMENT message as gRPC's)."""
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if name in body:
            setattr(sampling, name, _number(body, name))
    if "min_tokens" in body:
        sampling.min_tokens = _integer(body, "min_tokens", 0, 2**31 - 1)
    if "stop_token_ids" in body:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                                for t in ids):
            raise HttpError(400, "stop_token_ids must be a list of token ids (integers >= 0)", param="stop_token_ids")
        sampling.stop_token_ids.extend(ids)
    if "logit_bias" in body:
        bias = body["logit_bias"]
        if not isinstance(bias, dict):
            raise HttpError(400, 'logit_bias must be an object mapping token ids to a bias, e.g. {"50256": -100}',
                            param="logit_bias")
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10 else None
            if token is None:
                raise HttpError(400, f"logit_bias: key {key[:20]!r} is not a token id", param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise HttpError(400, f"logit_bias: the bias of token {key} must be a finite number", param="logit_bias")
            sampling.logit_bias[token] = float(value)


def _refuse_unknown(body: dict, allowed: set[str]) -> None:
    unsupported = sorted(set(body) - allowed)
    if unsupported:
        raise HttpError(400, f"{', '.join(unsupported)}: not supported by this server", param=unsupported[0],
                        code="unsupported_parameter")


def _check_json_type(request: Request) -> None:
    """A body is read only when it says it is JSON (``application/json``, parameters such as charset
    allowed). ``text/plain``, form and multipart bodies, or none declared, are what a browser sends
    cross-site without asking first (no CORS preflight): parsing them as JSON would let any web
    page spend this server's compute through a visitor's browser."""
    declared = request.headers.get("content-type", "")
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = f"Content-Type {declared!r}" if declared else "no Content-Type"
        raise HttpError(415, f"the request body must be JSON sent as Content-Type: application/json; got {shown}",
                        code="unsupported_media_type")


def _media_url(part: dict, where: str, kind: str) -> tuple[str, object]:
    """A content part's ``kind`` (image_url, video_url) URL and the object it came in (a dict, or
    the URL string itself)."""
    extra = set(part) - {"type", kind}
    if extra:
        raise HttpError(400, f"{where}: {', '.join(sorted(extra))} not supported by this server", param="messages")
    media = part.get(kind)
    url = media.get("url") if isinstance(media, dict) else media if isinstance(media, str) else None
    if not isinstance(url, str):
        raise HttpError(400, f'{where}.{kind} must be {{"url": URL}}', param="messages")
    return url, media


def _image_url(part: dict, where: str) -> str:
    url, image = _media_url(part, where, "image_url")
    if isinstance(image, dict):
        unknown = set(image) - {"url", "detail"}
        if unknown:
            raise HttpError(400, f"{where}.image_url: {', '.join(sorted(unknown))} not supported by this server",
                            param="messages")
        if image.get("detail", "auto") not in ("auto", None):
            raise HttpError(400, f"{where}.image_url.detail: only 'auto' is supported; lower the resolution with "
                            "mm_processor_kwargs.max_pixels", param="messages", code="unsupported_parameter")
    return url


MM_KWARGS = {"max_pixels", "fps", "max_frames"}
"""mm_processor_kwargs this server takes: max_pixels (each image's cap), fps and max_frames (every clip's
sampling, as vLLM's Qwen video processor takes them)."""
VIDEO_OPTIONS = {"fps", "max_frames", "max_pixels"}  # a video_url object's own (max_pixels: the clip's budget)


def _video_options(body: dict, shown: str, names=("fps", "max_frames")) -> dict:
    """Checked video overrides, as VideoPart fields (the server's caps are checked by the router)."""
    out: dict = {}
    if "fps" in body and "fps" in names:
        out["fps"] = _number({f"{shown}.fps": body["fps"]}, f"{shown}.fps")
        if out["fps"] < 0:
            raise HttpError(400, f"{shown}.fps must be a positive number", param=shown)
    if "max_frames" in body and "max_frames" in names:
        out["max_frames"] = _integer(body, "max_frames", 0, 2**32 - 1, f"{shown}.max_frames")
    if "max_pixels" in body and "max_pixels" in names:
        out["max_pixels"] = _integer(body, "max_pixels", 0, limits.MAX_PIXELS, f"{shown}.max_pixels")
    return out


def _video_url(part: dict, where: str) -> tuple[str, dict]:
    url, clip = _media_url(part, where, "video_url")
    if not isinstance(clip, dict):
        return url, {}
    unknown = set(clip) - {"url"} - VIDEO_OPTIONS
    if unknown:
        raise HttpError(400, f"{where}.video_url: {', '.join(sorted(unknown))} not supported by this server "
                        f"(supported: url, {', '.join(sorted(VIDEO_OPTIONS))})", param="messages")
    return url, _video_options({k: v for k, v in clip.items() if v is not None}, f"{where}.video_url",
                               tuple(VIDEO_OPTIONS))


def _bool(body: dict, name: str, shown: str = "") -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise HttpError(400, f"{shown or name} must be true or false", param=shown or name)
    return value


def _number(body: dict, name: str) -> float:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HttpError(400, f"{name} must be a finite number", param=name)
    return float(value)


def _max_tokens(body: dict, name: str, limit: int) -> int:
    """max_tokens (or max_completion_tokens) in [1, the deployment's limit], refused in the words
    the request path uses (so a value past int32 reads as what it is: more than the limit)."""
    value = body[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"{name} must be an integer in [1, {limit}]", param=name)
    got = str(value) if abs(value) < 10**30 else f"{value:.3g}"
    if value < 1:
        raise HttpError(400, f"{name} must be at least 1, got {got}", param=name, code="invalid_argument")
    if value > limit:
        raise HttpError(400, f"{name} must be at most {limit}, got {got}", param=name, code="invalid_argument")
    return value


def _integer(body: dict, name: str, low: int, high: int, shown: str = "") -> int:
    value = body[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"{shown or name} must be an integer in [{low}, {high}]", param=shown or name)
    if not low <= value <= high:
        got = str(value) if abs(value) < 10**30 else f"{value:.3g}"
        raise HttpError(400, f"{shown or name} must be an integer in [{low}, {high}], got {got}", param=shown or name)
    return value


def _object(body: dict, name: str, allowed: set[str]) -> dict:
    value = body.get(name, {})
    if not isinstance(value, dict):
        raise HttpError(400, f"{name} must be an object", param=name)
    value = {key: item for key, item in value.items() if item is not None}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise HttpError(400, f"{name}: {', '.join(unknown)} not supported by this server (supported: "
                        f"{', '.join(sorted(allowed))})", param=name, code="unsupported_parameter")
    return value


class _ChatCall:
    """The ASGI response of one chat completion: runs the request, and cancels it the moment the
    client disconnects (the status waits for the first event, so early failures get their code)."""

    def __init__(self, front: HttpFront, request: epd_pb2.GenerateRequest, options: ChatOptions,
                 request_id: str) -> None:
        self.front, self.request, self.options, self.id = front, request, options, request_id
        self.created = int(time.time())
        self._head: bytes | None = None  # the streamed chunks' envelope, once built
        self.prompt_entries: list = []  # the prompt's TokenLogprobs (1..), from the first choice

    async def __call__(self, scope, receive, send) -> None:
        logs.REQUEST_ID.set(self.id)  # every line logged for it names it (the producer task inherits it)
        self.started = False  # the status line has gone out
        self.streaming = False  # ... and it was a stream's (200, text/event-stream)
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not producer.done():
                producer.cancel()  # the client left (or this task was cancelled): drop the request
                with contextlib.suppress(asyncio.CancelledError):
                    await producer
                log.info("http request %s: client disconnected; cancelled", self.id)
                return
        if producer.cancelled():  # cut by a shutdown's drain timeout, not by the client: say so, retryably
            error = HttpError(503, "router: shut down before the answer finished", "service_unavailable",
                              code="unavailable")
            if not self.started:
                await _send_json(send, 503, error.body(), {"retry-after": "1"})
            elif self.options.stream:
                await send({"type": "http.response.body", "body": _sse(error.body()) + b"data: [DONE]\n\n",
                            "more_body": False})
            return
        producer.result()

    def _requests(self) -> list[epd_pb2.GenerateRequest]:
        """One request per choice (``n``), run concurrently: the same request, except that choice
        ``i``'s seed is ``seed + i`` when the client gave a seed (without one each draws its own).
        The prompt's logprobs are the same for every choice: only the first choice asks prefill
        for them (the others may take the prompt from the prefix cache), and every choice's
        answer shows the first one's."""
        out = []
        for index in range(self.options.n):
            request = epd_pb2.GenerateRequest()
            request.CopyFrom(self.request)
            if index and request.sampling.HasField("seed"):
                request.sampling.seed = (request.sampling.seed + index) % 2**64
            if index:
                request.request_id = f"{self.id}-{index}"
                request.sampling.ClearField("prompt_logprobs")
            out.append(request)
        return out

    async def _produce(self, send) -> None:
        front = self.front
        requests = self._requests()
        accepted = [asyncio.Event() for _ in requests]
        streams = [front.stats.track("http", front.core.generate(request, None, on_accepted=event.set))
                   for request, event in zip(requests, accepted)]
        headers = None
        if self.options.stream and not self.options.continuous_usage:
            # A stream's status line, headers and opening chunks go out as soon as every choice's
            # request has passed its checks, not at the first token (seconds later under load): a
            # refusal still gets its own status, a failure after that is an error event in the stream.
            async def flush_headers() -> None:
                for event in accepted:
                    await event.wait()
                await self._start_stream(send, len(requests))

            headers = asyncio.ensure_future(flush_headers())
        try:
            try:
                firsts = await _all([_next(stream) for stream in streams])
            except Exception as error:  # noqa: BLE001 - a refusal before anything was sent: its own status
                await self._settle(headers, accepted)
                if self.streaming:
                    _, body, _ = self._error(error)
                    await send({"type": "http.response.body", "body": _sse(body) + b"data: [DONE]\n\n",
                                "more_body": False})
                    return
                self.started = True
                await _send_json(send, *self._error(error))
                return
            await self._settle(headers, accepted)
            if self.options.stream:
                await self._stream(send, firsts, streams)
            else:
                await self._whole(send, firsts, streams)
        finally:
            if headers is not None and not headers.done():
                headers.cancel()
            for stream in streams:
                await stream.aclose()

    @staticmethod
    async def _settle(headers: asyncio.Future | None, accepted: list[asyncio.Event]) -> None:
        """Wait for the headers being sent, or call them off if a request never was accepted."""
        if headers is None:
            return
        if not all(event.is_set() for event in accepted):
            headers.cancel()  # still waiting on the event: nothing was sent (no await since the check)
        with contextlib.suppress(asyncio.CancelledError):
            await headers

    def _error(self, error: BaseException) -> tuple[int, dict, dict]:
        failure = http_error(error)
        if failure.status >= 500:
            log.warning("http request %s: %s %s", self.id, failure.status, failure.message)
        headers = {"retry-after": "1"} if failure.status in (429, 503) else {}
        return failure.status, failure.body(), headers

    # ------------------------------------------------------------ the shapes (chat here, completions below)

    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"

    def _whole_choice(self, index: int, got: _Collected) -> dict:
        message = {"role": "assistant", "content": "".join(got.text)}
        finish = _finish(got.summary)
        parser = self.options.parser()
        if parser is not None:
            split = chat_output.whole(message["content"], parser)
            message["content"] = split["content"]
            if self.options.reasoning:
                message["reasoning_content"] = split["reasoning_content"]
            if self.options.tools is not None:
                message["tool_calls"] = split["tool_calls"]
                if split["tool_calls"]:
                    finish = "tool_calls"
        choice = {"index": index, "message": message,
                  "logprobs": None, "finish_reason": finish, "stop_reason": _stop_reason(got.summary)}
        if self.options.logprobs:
            choice["logprobs"] = {"content": self.front.logprobs_json(got.logprobs, self.options, got.token_ids)}
        if self.options.token_ids:
            choice["token_ids"] = got.token_ids
        return choice

    def _whole_extra(self, results: list[_Collected]) -> dict:
        extra = {"prompt_token_ids": results[0].prompt_token_ids} if self.options.token_ids else {}
        if self.options.prompt_logprobs:  # vLLM's chat: top-level, once for the n choices
            extra["prompt_logprobs"] = self.front.prompt_logprobs_json(self.prompt_entries)
        return extra

    def _opening_choices(self, index: int, state: dict) -> list[dict]:
        return [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]

    def _delta_choice(self, index: int, chunk: epd_pb2.TokenChunk, state: dict) -> dict:
        if "parser" not in state:
            state["parser"] = self.options.parser()
        parser = state["parser"]
        delta = {"content": chunk.text} if parser is None else _merge(parser.feed(chunk.text))
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        if self.options.logprobs:
            choice["logprobs"] = {"content": self.front.logprobs_json(chunk.logprobs, self.options, chunk.token_ids)}
        if self.options.token_ids:
            choice["token_ids"] = list(chunk.token_ids)
        return choice

    def _delta_json(self, index: int, chunk: epd_pb2.TokenChunk, state: dict, encode=None) -> bytes:
        """``_delta_choice`` as JSON; the common piece (plain content, no logprobs) straight from a
        template: what every streamed token of a chat costs the router."""
        if self.options.logprobs or self.options.tools is not None or self.options.reasoning:
            return (encode or _json)(self._delta_choice(index, chunk, state))
        ids = b',"token_ids":[' + ",".join(map(str, chunk.token_ids)).encode() + b"]" if self.options.token_ids \
            else b""
        return (b'{"index":%d,"delta":{"content":' % index + _json(chunk.text)
                + b'},"logprobs":null,"finish_reason":null' + ids + b"}")

    def _final_choice(self, index: int, summary, state: dict) -> dict:
        parser = state.get("parser")
        delta = {} if parser is None else _merge(parser.finish())
        finish = "tool_calls" if parser is not None and parser.calls and self.options.tools is not None \
            else _finish(summary)
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish,
                "stop_reason": _stop_reason(summary)}

    PROMPT_PER_CHOICE = False  # chat: the prompt's token ids and logprobs once, top-level on choice 0's first chunk

    def _chunk_extra(self, index: int, chunk: epd_pb2.TokenChunk) -> dict:
        """Top-level fields of a streamed chunk: vLLM's chat puts prompt_token_ids on the first
        (prompt_logprobs go there too), once for the n choices."""
        if index or not chunk.prompt_tokens:
            return {}
        extra = {"prompt_token_ids": list(chunk.prompt_token_ids)} if self.options.token_ids else {}
        if self.options.prompt_logprobs:
            extra["prompt_logprobs"] = self.front.prompt_logprobs_json(self.prompt_entries)
        return extra

    def _carries_prompt(self, index: int, chunk: epd_pb2.TokenChunk) -> bool:
        """This piece shows the prompt's logprobs (a large JSON: built off the event loop)."""
        return self.options.prompt_logprobs and bool(chunk.prompt_tokens) and (self.PROMPT_PER_CHOICE or index == 0)

    # ------------------------------------------------------------ the response

    async def _whole(self, send, firsts, streams) -> None:
        try:
            results = await _all([_collect(first, stream) for first, stream in zip(firsts, streams)])
        except Exception as error:  # noqa: BLE001 - nothing sent yet: the error gets its status
            self.started = True
            await _send_json(send, *self._error(error))
            return
        self.prompt_entries = results[0].prompt_logprobs  # asked of the first choice only, shown for all

        def encode() -> bytes:
            body = {"id": self.id, "object": self.OBJECT, "created": self.created, "model": self.front.model_name,
                    "choices": [self._whole_choice(index, got) for index, got in enumerate(results)],
                    "usage": _usage([got.summary for got in results]), "system_fingerprint": None,
                    **self._whole_extra(results)}
            return _json_in_pieces(body) if self.prompt_entries else _json(body)

        # A prompt's logprobs can be 131,072 entries (megabytes of JSON): built on the executor, so the
        # loop goes on serving every other stream and health probe meanwhile.
        data = await asyncio.get_running_loop().run_in_executor(None, encode) if self.prompt_entries else encode()
        self.started = True
        await _send_body(send, 200, data, {"x-request-id": self.id})

    def _envelope(self) -> bytes:
        """The start of every streamed chunk of this response (id, object, created, model), built once."""
        if self._head is None:
            head = {"id": self.id, "object": self.CHUNK_OBJECT, "created": self.created,
                    "model": self.front.model_name, "system_fingerprint": None}
            self._head = b"data: " + _json(head)[:-1] + b',"choices":['
        return self._head

    def _chunk_bytes(self, choices: list[bytes], usage: dict | None = None, encode=None, **extra) -> bytes:
        """One server-sent event: the envelope, the choices (JSON already), the top-level extras
        (``encode``: how, ``_json`` by default)."""
        encode = encode or _json
        tail = b"]"
        if extra:
            tail += b"," + encode(extra)[1:-1]
        if self.options.include_usage:
            tail += b',"usage":' + _json(usage)
        return self._envelope() + b",".join(choices) + tail + b"}\n\n"

    async def _start_stream(self, send, num_choices: int, usage: dict | None = None) -> None:
        """The stream's status line, headers and each choice's opening chunk, flushed now."""
        self.started = self.streaming = True
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"), (b"x-request-id", self.id.encode())]})
        self._states = [{} for _ in range(num_choices)]
        opening = [self._chunk_bytes([_json(choice)], usage) for index, state in enumerate(self._states)
                   for choice in self._opening_choices(index, state)]
        if opening:
            await send({"type": "http.response.body", "body": b"".join(opening), "more_body": True})

    async def _stream(self, send, firsts, streams) -> None:
        options = self.options
        prompt_tokens = next((f.chunk.prompt_tokens for f in firsts if f is not None
                              and f.WhichOneof("event") == "chunk"), 0)
        completion = [0] * len(streams)

        def running() -> dict | None:
            """continuous_usage_stats: the usage so far on every chunk (else null until the last)."""
            if not options.continuous_usage:
                return None
            return {"prompt_tokens": prompt_tokens, "completion_tokens": sum(completion),
                    "total_tokens": prompt_tokens + sum(completion)}

        if not self.streaming:  # not flushed ahead (continuous usage stats want the prompt's size first)
            await self._start_stream(send, len(streams), running())
        states = self._states
        loop = asyncio.get_running_loop()
        # The later choices of a completion show the first one's prompt logprobs: they wait for them.
        prompt_ready = asyncio.Event() if self.PROMPT_PER_CHOICE and options.prompt_logprobs else None

        def piece(index: int, chunk: epd_pb2.TokenChunk, encode=None) -> bytes:
            return self._chunk_bytes([self._delta_json(index, chunk, states[index], encode)], running(), encode,
                                     **self._chunk_extra(index, chunk))

        summaries, failure = [None] * len(streams), None
        async with contextlib.aclosing(_merged(firsts, streams, prompt_ready)) as merged:
            async for batch in merged:
                out = []  # the events that arrived together leave in one write
                for index, event, error in batch:
                    if event is None:
                        failure = failure or error
                        if index == 0 and prompt_ready is not None:
                            prompt_ready.set()
                    elif event.WhichOneof("event") == "summary":
                        summaries[index] = event.summary
                        out.append(self._chunk_bytes([_json(self._final_choice(index, event.summary, states[index]))],
                                                     running()))
                    elif event.chunk.text or event.chunk.token_ids:
                        chunk = event.chunk
                        completion[index] += len(chunk.token_ids)
                        if index == 0 and chunk.prompt_tokens:
                            self.prompt_entries = chunk.prompt_logprobs
                        if self._carries_prompt(index, chunk):  # megabytes of JSON, maybe: off the loop
                            out.append(await loop.run_in_executor(None, piece, index, chunk, _json_in_pieces))
                        else:
                            out.append(piece(index, chunk))
                        if index == 0 and prompt_ready is not None:
                            prompt_ready.set()
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                if failure is not None:
                    break
        if failure is not None:  # the status line is gone: say it in the stream
            _, body, _ = self._error(failure)
            await send({"type": "http.response.body", "body": _sse(body), "more_body": True})
        elif options.include_usage:
            await send({"type": "http.response.body", "body": self._chunk_bytes([], _usage(summaries)),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


class _CompletionCall(_ChatCall):
    """A legacy completion's response: ``text`` instead of a message, the legacy logprobs object."""

    OBJECT = CHUNK_OBJECT = "text_completion"

    PROMPT_PER_CHOICE = True  # each choice carries the prompt's logprobs (the first choice's)

    def _logprobs(self, entries, token_ids, offset: int) -> dict:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` of these tokens, their
        text offsets counted from ``offset`` characters into the choice's text. Each token's
        ``top_logprobs`` is one ``{text: logprob}`` object holding the sampled token itself, then
        the best ``logprobs`` alternatives (up to logprobs + 1 entries, as OpenAI's legacy API and
        vLLM give them; ``logprobs: 0`` gives the sampled token's alone)."""
        decoded = _Decoded(self.front.core.builder.tokenizer)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries):
            text = decoded(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(entry.logprob)
            top = {text: entry.logprob}
            for alt in list(entry.top)[:self.options.logprobs]:
                top.setdefault(decoded(alt.token_id), alt.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def _prompt_part(self, entries) -> dict:
        """echo with logprobs: the legacy logprobs of the prompt's tokens, as vLLM gives them (the
        first token's logprob and alternatives null; each next one's alternatives: the prompt token
        itself, then the best ``logprobs``), text offsets from 0."""
        decoded = _Decoded(self.front.core.builder.tokenizer)
        ids = self.options.prompt_token_ids
        out = {"tokens": [decoded(t) for t in ids], "token_logprobs": [None], "top_logprobs": [None],
               "text_offset": []}
        for entry in entries:
            out["token_logprobs"].append(entry.logprob)
            top = {decoded(entry.token_id): entry.logprob}
            for alt in list(entry.top)[:self.options.logprobs]:
                top.setdefault(decoded(alt.token_id), alt.logprob)
            out["top_logprobs"].append(top)
        offset = 0
        for text in out["tokens"]:
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def _with_prompt(self, choice: dict, entries) -> dict:
        """A choice that carries the prompt: its prompt_logprobs, and with echo and logprobs the
        prompt's tokens before the completion's in the logprobs object."""
        if self.options.prompt_logprobs:
            choice["prompt_logprobs"] = self.front.prompt_logprobs_json(entries)
        if self.options.echo_logprobs:
            prompt = self._prompt_part(entries)
            choice["logprobs"] = {key: prompt[key] + choice["logprobs"][key] for key in prompt}
        return choice

    def _choice(self, index: int, text: str, token_ids, logprobs, state: dict, finish: str | None = None,
                stop_reason: str | int | None = None) -> dict:
        """One choice, or a streamed piece of one; ``state`` keeps its text offset and whether the
        prompt's token ids went out yet."""
        offset = state.get("offset", 0)
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        if self.options.logprobs is not None:
            choice["logprobs"] = self._logprobs(logprobs, token_ids, offset)
        if self.options.token_ids:
            choice["token_ids"] = list(token_ids)
            if not state.get("sent_prompt"):
                choice["prompt_token_ids"] = list(self.options.prompt_token_ids)
                state["sent_prompt"] = True
        state["offset"] = offset + len(text)
        return choice

    def _whole_choice(self, index: int, got: _Collected) -> dict:
        echo = self.options.echo
        state = {"offset": len(echo)}
        choice = self._choice(index, "".join(got.text), got.token_ids, got.logprobs, state, _finish(got.summary),
                              _stop_reason(got.summary))
        choice["text"] = echo + choice["text"]
        return self._with_prompt(choice, self.prompt_entries)

    def _whole_extra(self, results: list[_Collected]) -> dict:
        return {}

    def _opening_choices(self, index: int, state: dict) -> list[dict]:
        if not self.options.echo or self.options.prompt_logprobs:  # the prompt goes with the first token's piece
            return []
        return [self._choice(index, self.options.echo, [], [], state)]

    def _delta_choice(self, index: int, chunk: epd_pb2.TokenChunk, state: dict) -> dict:
        if not (self.options.prompt_logprobs and chunk.prompt_tokens):
            return self._choice(index, chunk.text, chunk.token_ids, chunk.logprobs, state)
        # The first piece of a stream whose prompt's logprobs were asked: the echo, if any, and the prompt's
        # logprobs come with it (they are known only once prefill ran).
        echo = self.options.echo
        state["offset"] = state.get("offset", 0) + len(echo)
        choice = self._choice(index, chunk.text, chunk.token_ids, chunk.logprobs, state)
        choice["text"] = echo + choice["text"]
        return self._with_prompt(choice, self.prompt_entries)

    def _delta_json(self, index: int, chunk: epd_pb2.TokenChunk, state: dict, encode=None) -> bytes:
        return (encode or _json)(self._delta_choice(index, chunk, state))

    def _final_choice(self, index: int, summary, state: dict) -> dict:
        return self._choice(index, "", [], [], state, _finish(summary), _stop_reason(summary))

    def _chunk_extra(self, index: int, chunk: epd_pb2.TokenChunk) -> dict:
        return {}


@dataclass
class _Collected:
    """One choice's whole answer."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    summary: epd_pb2.Summary | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs of prompt tokens 1..


async def _next(stream):
    return await anext(stream, None)


async def _collect(first, stream) -> _Collected:
    got, event = _Collected(), first
    while event is not None:
        if event.WhichOneof("event") == "summary":
            got.summary = event.summary
        else:
            got.text.append(event.chunk.text)
            got.token_ids.extend(event.chunk.token_ids)
            got.logprobs.extend(event.chunk.logprobs)
            got.prompt_token_ids.extend(event.chunk.prompt_token_ids)
            got.prompt_logprobs.extend(event.chunk.prompt_logprobs)
        event = await anext(stream, None)
    return got


async def _all(awaitables: list) -> list:
    """Run them together; the first failure cancels the rest (and is raised once they stopped)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _merge(deltas: list[dict]) -> dict:
    """An answer parser's deltas for one piece as one chunk's delta."""
    out: dict = {}
    for delta in deltas:
        for kind, value in delta.items():
            if kind == "tool_calls":
                out.setdefault(kind, []).extend(value)
            else:
                out[kind] = out.get(kind, "") + value
    return out


def _stop_reason(summary) -> str | int | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the choice, else null."""
    kind = summary.WhichOneof("stop_reason") if summary is not None else None
    return getattr(summary, kind) if kind else None


def _finish(summary) -> str | None:
    return FINISH_REASONS.get(summary.finish_reason, summary.finish_reason) if summary is not None else None


def _usage(summaries) -> dict | None:
    """Usage of the n choices of one request: the prompt once (and its cached tokens: the first
    choice's), the completion tokens of all."""
    if not summaries or any(summary is None for summary in summaries):
        return None
    prompt, completion = summaries[0].prompt_tokens, sum(summary.completion_tokens for summary in summaries)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": summaries[0].cached_tokens}}


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # one, not one per chunk (json.dumps')


def _json(obj) -> bytes:
    return _ENCODER.encode(obj).encode()


def _json_in_pieces(obj, depth: int = 4, size: int = 256) -> bytes:
    """``_json(obj)`` for megabytes of it, off the loop: the C encoder holds the GIL for the whole
    of one call, so one call over a 131,072-entry list would stall the event loop from any thread.
    Containers down to ``depth`` are walked, long lists encoded ``size`` items a call."""
    if depth and isinstance(obj, dict):
        return b"{" + b",".join(_json(str(key)) + b":" + _json_in_pieces(value, depth - 1, size)
                                for key, value in obj.items()) + b"}"
    if depth and isinstance(obj, list):
        if len(obj) > size:
            return b"[" + b",".join(_json(obj[i:i + size])[1:-1] for i in range(0, len(obj), size)) + b"]"
        return b"[" + b",".join(_json_in_pieces(item, depth - 1, size) for item in obj) + b"]"
    return _json(obj)


def _sse(obj: dict) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


async def _merged(firsts: list, streams: list, prompt_ready: asyncio.Event | None = None):
    """Every choice's events as they come, in batches of ``(index, event, error)`` that arrived
    together (``event`` None: that choice's stream ended, ``error`` what broke it, if anything).
    One stream is read directly (no task and queue per token); several through a queue, a reader
    task each; with ``prompt_ready``, the choices after the first start once it is set."""
    if len(streams) == 1:
        event = firsts[0]
        try:
            while event is not None:
                yield [(0, event, None)]
                event = await anext(streams[0], None)
        except Exception as error:  # noqa: BLE001 - handed to the writer
            yield [(0, None, error)]
            return
        yield [(0, None, None)]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, event, stream) -> None:
        try:
            if index and prompt_ready is not None:
                await prompt_ready.wait()
            while event is not None:
                queue.put_nowait((index, event, None))
                event = await anext(stream, None)
            queue.put_nowait((index, None, None))
        except Exception as error:  # noqa: BLE001 - handed to the writer
            queue.put_nowait((index, None, error))

    pumps = [asyncio.ensure_future(pump(i, first, stream)) for i, (first, stream) in enumerate(zip(firsts, streams))]
    open_streams = len(streams)
    try:
        while open_streams:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            open_streams -= sum(event is None for _, event, _ in batch)
            yield batch
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    """A whole JSON response (the caller marks itself started first when it matters)."""
    await _send_body(send, status, json.dumps(body, ensure_ascii=False).encode(), headers)


async def _send_body(send, status: int, data: bytes, headers: dict | None = None) -> None:
    """A whole response of JSON ``data``."""
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def default_model_name(model_dir: str) -> str:
    return os.path.basename(os.path.normpath(model_dir))
