"""The OpenAI-compatible HTTP front and gRPC reflection, through a real `epd serve` with two routers
(fixed ports for the first, free ports for the second), driven by the official `openai` client and
by raw HTTP: token-identical to the gRPC path and to transformers, images by data: URL, by an
allow-listed loopback URL (a real HTTP server this test runs) and by an allowed local file; refused
URLs never fetched; errors in OpenAI's shape; a client that leaves cancels its request; metrics on
both fronts; `epd bench --api openai`; `epd generate --messages` in OpenAI's format."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import torch

from bench.synthetic import make_image
from control import cli
from epd import client
from epd.dataurl import encode_data_url
from tests.conftest import ServeProcess, epd_status, ray_address
from tests.media_server import MediaServer

KEY = "test-key-0123456789"
MODEL = "epd-tiny"
SQUARE = make_image(448, 448, seed=1)
WIDE = make_image(320, 120, seed=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    def __init__(self, serve: ServeProcess, grpc_port: int, http_port: int, media_dir: str, images: MediaServer,
                 forbidden: MediaServer) -> None:
        self.serve, self.media_dir, self.images, self.forbidden = serve, media_dir, images, forbidden
        self.grpc = f"127.0.0.1:{grpc_port}"
        self.http = f"127.0.0.1:{http_port}"
        self.openai = openai.OpenAI(base_url=f"http://{self.http}/v1", api_key=KEY, max_retries=0, timeout=120)

    def generate(self, prompt, images=(), **sampling) -> client.GenerateResult:
        return client.generate(self.grpc, client.user_request(prompt, list(images), **sampling), timeout_s=120,
                               api_key=KEY)

    def post(self, body: dict | bytes, key: str | None = KEY, address: str | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(f"http://{address or self.http}/v1/chat/completions", data=data,
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def metrics(self, address: str | None = None) -> str:
        return urllib.request.urlopen(f"http://{address or self.http}/metrics", timeout=10).read().decode()


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    media_dir = tmp_path_factory.mktemp("media")
    (media_dir / "square.png").write_bytes(SQUARE)
    images = MediaServer({"/square.png": SQUARE, "/wide.png": WIDE})
    forbidden = MediaServer({"/square.png": SQUARE}, host="127.0.0.2")  # loopback too, but not allow-listed
    grpc_port, http_port = _free_port(), _free_port()
    os.environ["EPD_API_KEY"] = KEY  # as an operator passes it: never on the command line
    serve = None
    try:
        serve = ServeProcess(
            tiny_model_dir, "--encoders", "1", "--routers", "2", "--port", str(grpc_port), "--http-port",
            str(http_port), "--served-model-name", MODEL, "--allow-media-urls", "--allowed-media-domains",
            "127.0.0.1", "--allowed-local-media-path", str(media_dir), "--max-request-mb", "2",
            log_path=str(tmp_path_factory.mktemp("logs") / "serve.log"))
        yield Stack(serve, grpc_port, http_port, str(media_dir), images, forbidden)
    finally:
        os.environ.pop("EPD_API_KEY", None)
        images.close()
        forbidden.close()
        if serve is not None:
            assert serve.stop() == [], "epd serve left processes behind"
            log = open(serve.log.name).read()
            assert KEY not in log, "the API key reached the log"


def _chat(prompt: str, image_url: str | None = None) -> list[dict]:
    content = ([{"type": "image_url", "image_url": {"url": image_url}}] if image_url else [])
    return [{"role": "user", "content": [*content, {"type": "text", "text": prompt}]}]


def test_each_router_serves_http_and_reflection_on_its_own_ports(stack):
    http_lines = [line.split("http://", 1)[1].strip().removesuffix("/v1") for line in stack.serve.lines
                  if line.startswith("epd http at ")]
    routers = epd_status(ray_address(stack.serve))["roles"]["router"]
    assert len(routers) == 2
    addresses = {r["address"] for r in routers}
    https = {r["http_address"] for r in routers}
    assert stack.grpc in addresses and stack.http in https and set(http_lines) == https
    assert len(addresses | https) == 4  # four distinct ports
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def reflect(channel, metadata=None) -> list[str]:
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=30)
        return [service.name for reply in replies for service in reply.list_services_response.service]

    for router in routers:
        with urllib.request.urlopen(f"http://{router['http_address']}/health", timeout=10) as response:
            assert (response.status, json.loads(response.read())) == (200, {"status": "ok"})
        models = openai.OpenAI(base_url=f"http://{router['http_address']}/v1", api_key=KEY).models.list()
        assert [m.id for m in models.data] == [MODEL]
        with grpc.insecure_channel(router["address"]) as channel:
            assert "epd.v1.Router" in reflect(channel, (("authorization", f"Bearer {KEY}"),))
            with pytest.raises(grpc.RpcError) as raised:  # under the API's access rules
                reflect(channel)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The other router answers a request too (not only the one with the fixed ports).
        status, body = stack.post({"model": MODEL, "messages": _chat("hi"), "max_tokens": 2},
                                  address=router["http_address"])
        assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_streamed_answer_about_a_data_url_image_is_token_identical(stack, oracle):
    prompt, n = "What is in this picture?", 24
    expected = oracle.generate(prompt, [SQUARE], max_new_tokens=n)[0]
    via_grpc = stack.generate(prompt, [SQUARE], max_tokens=n, logprobs=5)
    stream = stack.openai.chat.completions.create(
        model=MODEL, messages=_chat(prompt, encode_data_url(SQUARE)), max_tokens=n, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=5, extra_body={"return_token_ids": True})
    token_ids, text, logprobs, finish, usage = [], "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            text += choice.delta.content or ""
            logprobs += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
            finish = choice.finish_reason or finish
    assert token_ids == expected == via_grpc.token_ids
    assert text == via_grpc.text
    assert finish == ("length" if via_grpc.summary.finish_reason == "length" else "stop")
    assert (usage.prompt_tokens, usage.completion_tokens) == (via_grpc.summary.prompt_tokens, len(expected))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert len(logprobs) == len(expected)
    for ours, theirs, token_id in zip(logprobs, via_grpc.logprobs, expected):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-6)
        assert [t.logprob for t in ours.top_logprobs] == pytest.approx([t.logprob for t in theirs.top], abs=1e-6)
        assert ours.token == oracle.tokenizer.decode([token_id])
    # The first token's distribution is transformers' own.
    _, logits, _ = oracle.generate(prompt, [SQUARE], max_new_tokens=1)
    reference = torch.log_softmax(logits, dim=-1)
    assert [t.logprob for t in logprobs[0].top_logprobs] == pytest.approx(torch.topk(reference, 5).values.tolist(),
                                                                          abs=1e-4)


def test_loopback_url_and_local_file_images_match_the_grpc_path(stack):
    prompt = "Describe the scene."
    via_grpc = stack.generate(prompt, [WIDE], max_tokens=12)
    stack.images.requests.clear()
    for url in (stack.images.url("/wide.png"), f"file://{stack.media_dir}/square.png"):
        reply = stack.openai.chat.completions.create(model=MODEL, messages=_chat(prompt, url), max_tokens=12,
                                                     temperature=0, extra_body={"return_token_ids": True})
        expected = via_grpc if "wide" in url else stack.generate(prompt, [SQUARE], max_tokens=12)
        assert reply.choices[0].model_extra["token_ids"] == expected.token_ids
        assert reply.choices[0].message.content == expected.text
        assert reply.usage.prompt_tokens == expected.summary.prompt_tokens
    assert stack.images.requests == ["/wide.png"]


def test_second_turn_usage_counts_cached_tokens(stack, oracle):
    image = make_image(448, 448, seed=77)
    first = _chat("What do you see here?", encode_data_url(image))
    one = stack.openai.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens == 0  # a new image: nothing to reuse
    answer = one.choices[0].message.content
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the colours?"}]
    two = stack.openai.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0,
                                               extra_body={"return_token_ids": True})
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < two.usage.prompt_tokens and cached % 64 == 0  # whole prefix blocks of the first turn
    assert cached >= one.usage.prompt_tokens // 64 * 64 - 64
    conversation = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": "What do you see here?"}]},
                    {"role": "assistant", "content": answer}, {"role": "user", "content": "And the colours?"}]
    expected, _, prompt_len = oracle.generate_chat(conversation, max_new_tokens=8)
    assert two.choices[0].model_extra["token_ids"] == expected
    assert two.usage.prompt_tokens == prompt_len


@pytest.mark.parametrize("where,message", [
    ("http://localhost:{forbidden}/square.png", "not in this server's --allowed-media-domains"),
    ("http://127.0.0.2:{forbidden}/square.png", "not in this server's --allowed-media-domains"),
    ("{images}/redirect?to=http://127.0.0.2:{forbidden}/square.png", "not in this server's --allowed-media-domains"),
    ("file:///etc/passwd", "outside the directory"),
    ("file://{media}/../square.png", r"\.\. are refused"),
    ("ftp://127.0.0.1/square.png", "must be a data:, http"),
])
def test_refused_images_are_400_and_never_fetched(stack, where, message):
    url = where.format(forbidden=stack.forbidden.port, images=f"http://127.0.0.1:{stack.images.port}",
                       media=stack.media_dir)
    with pytest.raises(openai.BadRequestError) as raised:
        stack.openai.chat.completions.create(model=MODEL, messages=_chat("x", url), max_tokens=2)
    assert raised.value.status_code == 400
    assert re.search(message, raised.value.body["message"])
    assert stack.forbidden.requests == []


def test_errors_come_in_openai_shape(stack):
    ok = {"model": MODEL, "messages": _chat("hello"), "max_tokens": 2}
    cases = [
        ({**ok, "functions": [{"name": "f"}]}, KEY, 400, "functions: not supported"),  # the deprecated form of tools
        ({**ok, "prompt_logprobs": 21}, KEY, 400, "prompt_logprobs must be an integer in [0, 20], got 21"),
        ({**ok, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, KEY, 400,
         "invalid json schema"),
        ({**ok, "n": 17}, KEY, 400, "n must be an integer in [1, 16]"),
        ({**ok, "logit_bias": {"x": 1}}, KEY, 400, "logit_bias: key 'x' is not a token id"),
        ({**ok, "stream_options": {"include_usage": True}}, KEY, 400, "only allowed with stream"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, KEY, 400,
         "got type 'input_audio'"),
        ({**ok, "model": "gpt-4o"}, KEY, 404, "`gpt-4o` does not exist"),
        (ok, None, 401, "API key"),
        (ok, "wrong-key-000", 401, "API key"),
        (b"{not json", KEY, 400, "not valid JSON"),
    ]
    for body, key, status, message in cases:
        got, reply = stack.post(body, key)
        assert got == status, (body, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"}
        assert message in reply["error"]["message"]
    # Bad input has the gRPC front's INVALID_ARGUMENT message, word for word.
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 1.5}, {"max_tokens": 100000},
                {"frequency_penalty": 2.5}, {"presence_penalty": -3.0}, {"repetition_penalty": 0.0}, {"min_p": 1.5},
                {"max_tokens": 2, "min_tokens": 3}, {"stop_token_ids": [10**9]}, {"logit_bias": {10**8: 1.0}},
                {"logit_bias": {5: 101.0}}):
        with pytest.raises(grpc.RpcError) as raised:
            stack.generate("hello", **bad)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        got, reply = stack.post({**ok, **bad})
        assert (got, reply["error"]["message"]) == (400, raised.value.details())
    got, reply = stack.post(json.dumps(_chat("x", encode_data_url(b"\0" * 3_000_000))).encode())
    assert got == 413 and "larger than 2097152 bytes" in reply["error"]["message"]


def _count(metrics: str, name: str, **labels) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_client_that_leaves_cancels_its_request(stack):
    before = _count(stack.metrics(), "epd_requests_total", front="http", status="CANCELLED")
    body = json.dumps({"model": MODEL, "messages": _chat("Talk for a long time."), "max_tokens": 4000,
                       "ignore_eos": True, "stream": True}).encode()
    host, port = stack.http.split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        received = b""
        while received.count(b"data: ") < 3:  # the role chunk and some tokens: it is running
            received += sock.recv(65536)
        assert b" 200 OK" in received
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = stack.metrics()
        if _count(metrics, "epd_requests_total", front="http", status="CANCELLED") > before:
            break
        time.sleep(0.2)
    # Cancelled, not finished: a request left running would end as OK with finish_reason length.
    assert _count(metrics, "epd_requests_total", front="http", status="CANCELLED") == before + 1
    assert _count(metrics, "epd_num_requests_running", front="http") == 0


def test_latency_metrics_on_both_fronts(stack):
    stack.generate("One for gRPC.", max_tokens=4)
    stack.openai.chat.completions.create(model=MODEL, messages=_chat("One for HTTP."), max_tokens=4)
    metrics = stack.metrics()
    for front in ("grpc", "http"):
        for name in ("epd_time_to_first_token_seconds_count", "epd_e2e_request_latency_seconds_count",
                     "epd_inter_token_latency_seconds_count", "epd_request_time_per_output_token_seconds_count"):
            assert _count(metrics, name, front=front) >= 1, (name, front)
        assert _count(metrics, "epd_requests_total", front=front, status="OK") >= 1
    assert _count(metrics, "epd_requests_total", front="http", status="INVALID_ARGUMENT") >= 1
    assert _count(metrics, "epd_requests_total", front="http", status="UNAUTHENTICATED") >= 2  # refused by the front
    assert _count(metrics, "epd_generation_tokens_total", front="http") >= 4


def test_bench_drives_either_front(stack, tmp_path):
    reports = {}
    for api, addr in (("grpc", stack.grpc), ("openai", stack.http)):
        path = tmp_path / f"{api}.json"
        assert cli.main(["bench", "--addr", addr, "--api", api, "--num-requests", "4", "--concurrency", "2",
                         "--images-per-request", "1", "--image-sizes", "96x64", "--prompt-tokens", "16",
                         "--output-tokens", "6", "--warmup", "0", "--json", str(path)]) == 0
        reports[api] = json.loads(path.read_text())
    for api, report in reports.items():
        assert (report["completed"], report["output_tokens_total"]) == (4, 24), api
        assert report["ttft_s"]["p50"] > 0 and report["config"]["api"] == api
    prompt_tokens = {api: sorted(r["prompt_tokens"] for r in report["requests"]) for api, report in reports.items()}
    assert prompt_tokens["grpc"] == prompt_tokens["openai"]  # the same seeded workload through either front


def test_generate_messages_in_openai_format(stack, tmp_path, oracle):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "sq.png").write_bytes(SQUARE)
    forms = {
        "image": {"type": "image", "image": "pics/sq.png"},
        "path": {"type": "image", "path": "pics/sq.png"},
        "data_url": {"type": "image_url", "image_url": {"url": encode_data_url(SQUARE)}},
        "file_path": {"type": "image_url", "image_url": {"url": "pics/sq.png"}},
    }
    expected = oracle.generate("What is this?", [SQUARE], max_new_tokens=6)[0]
    for name, part in forms.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps([{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]))
        out = subprocess.run([sys.executable, "-m", "control.cli", "generate", "--addr", stack.grpc, "--messages",
                              str(path), "--max-tokens", "6", "--logprobs", "3", "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["token_ids"] == expected, name
        assert len(result["logprobs"]) == 6 and len(result["logprobs"][0]["top"]) == 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]))
    out = subprocess.run([sys.executable, "-m", "control.cli", "generate", "--addr", stack.grpc, "--messages",
                          str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot read image" in out.stderr and "Traceback" not in out.stderr


def test_a_directory_named_as_a_local_image_is_a_400_naming_it(stack):
    """An I/O error of a media fetch is the client's URL's problem: 400 with a reason, never a 500."""
    os.makedirs(os.path.join(stack.media_dir, "album"), exist_ok=True)
    for url in (f"file://{stack.media_dir}/album", f"file://{stack.media_dir}/"):
        status, reply = stack.post({"model": MODEL, "messages": _chat("What is it?", url), "max_tokens": 2})
        assert status == 400, reply
        assert "is a directory" in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"


def test_a_stream_sends_its_headers_once_accepted_not_at_the_first_token(stack):
    """With prefill stopped (SIGSTOP) no token can come, yet a streamed request gets its status
    line, headers and the assistant-role chunk at once; the tokens follow once prefill runs again."""
    import signal

    prefill = epd_status(ray_address(stack.serve))["roles"]["prefill"][0]["pid"]
    body = json.dumps({"model": MODEL, "messages": _chat("Count to ten."), "max_tokens": 4, "stream": True}).encode()
    host, port = stack.http.split(":")
    os.kill(prefill, signal.SIGSTOP)
    try:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            sock.settimeout(1.5)  # well inside the controller's 2 s probe timeout
            received = b""
            try:
                while b'"role":"assistant"' not in received:
                    data = sock.recv(65536)
                    if not data:
                        break
                    received += data
            except TimeoutError:
                pass
            head = received.split(b"\r\n", 1)[0]
            assert head == b"HTTP/1.1 200 OK", received[:300]
            assert b"text/event-stream" in received and b'"role":"assistant"' in received
            assert received.count(b"data: ") == 1  # the role chunk only: no token yet
            os.kill(prefill, signal.SIGCONT)
            sock.settimeout(60)
            while b"data: [DONE]" not in received:
                data = sock.recv(65536)
                assert data, received[-500:]
                received += data
    finally:
        os.kill(prefill, signal.SIGCONT)
    assert b'"finish_reason":"length"' in received and b'"error"' not in received
