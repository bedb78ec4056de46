"""What an operator sees: a fresh `epd serve` on the tiny model with its output going to a file
(not a terminal) prints its ready line and a short, uncoloured log, one line per event naming the
role (and the request, where there is one), no library fallback warning more than once per role,
no traceback, no Ray banner, no stack trace on SIGTERM and no worker-died notices when it stops.
The log format itself (text and JSON) is checked in-process on real log records."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
import socket
from collections import Counter

from bench.synthetic import make_image
from epd import client, logs
from tests.conftest import ServeProcess

ROLE_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR) "
                       r"(\S+)(?: \[([^\]]+)\])? [\w.]+: ")


def test_a_fresh_serve_piped_to_a_file_prints_a_short_plain_log(tiny_model_dir, tmp_path):
    server = ServeProcess(tiny_model_dir, "--encoders", "1", "--http-port", "0", log_path=str(tmp_path / "serve.log"))
    try:
        # "epd ready" is the last line of the start: every role's "joined" line came before it (a
        # script may wait for it and then read the log), and the controller's ready line after them.
        so_far = (tmp_path / "serve.log").read_text()
        joined = re.findall(r"control\.controller: (\w+) \1-\d+ joined", so_far)
        assert sorted(joined) == ["decode", "encode", "encoder", "prefill", "router"], so_far
        assert so_far.index("deployment ready: every role serving") > so_far.rindex(" joined"), so_far
        http = next(line.split("http://", 1)[1].strip().removesuffix("/v1") for line in server.lines
                    if line.startswith("epd http at "))
        # A gRPC request and an HTTP request whose client leaves early (the router logs that, with its id).
        result = client.generate(server.address, client.user_request("hi", [make_image(64, 64, seed=1)], max_tokens=3))
        assert result.summary.completion_tokens >= 1
        body = json.dumps({"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 2000, "ignore_eos": True,
                           "stream": True}).encode()
        host, port = http.split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode()
                         + b"\r\n\r\n" + body)
            received = b""
            while received.count(b"data: ") < 3:
                received += sock.recv(65536)
    finally:
        alive = server.stop(signal.SIGTERM)
    assert alive == []
    stdout = "".join(server.lines) + server.proc.stdout.read()
    log = (tmp_path / "serve.log").read_text()
    assert re.search(r"^epd ready at 127\.0\.0\.1:\d+$", stdout, re.M)
    assert stdout.rstrip().endswith("epd stopped")
    assert "\x1b[" not in log + stdout, "ANSI escapes in output that is not a terminal"
    for noise in ("Traceback", "Token authentication", "SIGTERM received", "worker died", "Worker died",
                  "falling back to its reference PyTorch implementation"):
        assert noise not in log, f"{noise!r} in the log:\n{log}"
    lines = [line for line in log.splitlines() if line.strip()]
    assert len(lines) <= 40, log
    events = [ROLE_LINE.match(line) for line in lines if not line.startswith("epd ")]
    assert all(events), "lines that are not one event with its role:\n" + "\n".join(
        line for line, m in zip([x for x in lines if not x.startswith("epd ")], events) if not m)
    kernels = Counter(m.group(2) for m, line in zip(events, [x for x in lines if not x.startswith("epd ")])
                      if "reference PyTorch kernels" in line)
    assert max(kernels.values(), default=0) <= 1, kernels  # once per role at most (epd.kernels may need none)
    cancelled = [m for m, line in zip(events, [x for x in lines if not x.startswith("epd ")])
                 if "client disconnected" in line]
    assert len(cancelled) == 1 and cancelled[0].group(2).startswith("router-")
    assert cancelled[0].group(3).startswith("chatcmpl-")  # the request's id, as its HTTP response carried it


def _records(fmt: str) -> list[str]:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        logs.configure("INFO", fmt, role="router-7", stream=stream)
        token = logs.REQUEST_ID.set("req-42")
        logging.getLogger("router_svc.core").warning("decode at %s lost the request", "127.0.0.1:1")
        logs.REQUEST_ID.reset(token)
        kernels = logging.getLogger("transformers.integrations.hub_kernels")
        for kernel in ("causal_conv1d_fn", "chunk_gated_delta_rule"):
            kernels.warning(f"`{kernel}` is falling back to its reference PyTorch implementation because ...")
        logging.getLogger("epd.x").info("plain")
    finally:
        root.handlers[:], root.level = saved
    return stream.getvalue().splitlines()


def test_text_and_json_lines_name_role_and_request():
    logs._OncePerProcess.said = False
    text = _records("text")
    assert len(text) == 3
    assert ROLE_LINE.match(text[0]).groups() == ("WARNING", "router-7", "req-42")
    assert text[0].endswith("router_svc.core: decode at 127.0.0.1:1 lost the request")
    assert "reference PyTorch kernels" in text[1] and "falling back" not in "".join(text)
    logs._OncePerProcess.said = False
    entries = [json.loads(line) for line in _records("json")]
    assert [e["message"] for e in entries][0] == "decode at 127.0.0.1:1 lost the request"
    assert {k: entries[0][k] for k in ("level", "role", "request_id", "logger")} == {
        "level": "WARNING", "role": "router-7", "request_id": "req-42", "logger": "router_svc.core"}
    assert entries[2]["request_id"] == "" and len(entries) == 3


class _JsonServe(ServeProcess):
    """`epd serve --log-format json`: its own lines (``epd ready at ...``) are JSON objects too."""

    def _wait_ready(self, timeout_s: float) -> str:
        import time

        deadline = time.monotonic() + timeout_s
        self.lines = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            self.lines.append(line)
            if not line and self.proc.poll() is not None:
                break
            message = json.loads(line)["message"] if line.strip() else ""
            if message.startswith("epd ready at "):
                return message.removeprefix("epd ready at ").strip()
        self.stop()
        raise RuntimeError(f"epd serve did not become ready:\n{open(self.log.name).read()[-4000:]}")


def test_json_logs_parse_line_by_line_and_one_id_follows_a_request_across_roles(tiny_model_dir, tmp_path):
    """`--log-format json`: every line epd serve prints (its own, every role's, Ray's notice of a
    worker killed under a request) is one JSON object. A request's id is on the router's access
    line and on prefill's and decode's lines about it, the attempt after its decode worker was
    killed (a resumed request) included; an HTTP request's chatcmpl id likewise; a client's bad
    request is one INFO access line, no traceback."""
    import os
    import time
    import urllib.request

    from tests.conftest import epd_status

    server = _JsonServe(tiny_model_dir, "--log-format", "json", "--log-level", "DEBUG", "--decode", "2",
                        "--http-port", "0", log_path=str(tmp_path / "serve.log"))
    try:
        entries = [json.loads(line) for line in server.lines if line.strip()]
        ray = next(e["message"].split()[2] for e in entries if e["message"].startswith("ray at "))
        http = next(e["message"].split("http://", 1)[1].removesuffix("/v1") for e in entries
                    if e["message"].startswith("epd http at "))
        # gRPC, with the client's id; its decode worker is killed mid-stream, so it resumes elsewhere.
        request = client.user_request("Tell a long story.", [make_image(64, 64, seed=3)], max_tokens=3000,
                                      ignore_eos=True)
        request.request_id = "trace-me-42"
        summary, killed = None, None
        for event in client.stream(server.address, request, timeout_s=300):
            if event.WhichOneof("event") == "summary":
                summary = event.summary
            elif killed is None:
                busy = [r for r in epd_status(ray)["roles"]["decode"] if r.get("in_flight")]
                if busy:
                    killed = busy[0]["pid"]
                    os.kill(killed, signal.SIGKILL)
                else:  # it finished before the look: nothing to kill (the assertion below says so)
                    killed = 0
        assert killed, "the request was not on a decode worker when looked at"
        assert summary is not None and summary.request_id == "trace-me-42" and summary.resumes >= 1, summary
        assert summary.completion_tokens == 3000
        # HTTP, and a bad request from a client.
        def post(body: dict) -> dict:
            req = urllib.request.Request(f"http://{http}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as reply:
                    return json.loads(reply.read())
            except urllib.error.HTTPError as error:
                return json.loads(error.read())

        answer = post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert answer["id"].startswith("chatcmpl-")
        assert post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3})["error"]["code"] \
            == "invalid_argument"
        time.sleep(1.5)  # Ray forwards the roles' lines within about a second
    finally:
        alive = server.stop(signal.SIGTERM)
    assert alive == []
    stdout = "".join(server.lines) + server.proc.stdout.read()
    text = (tmp_path / "serve.log").read_text()
    lines = [line for line in (stdout + text).splitlines() if line.strip()]
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(entry, dict) and {"ts", "level", "role", "message"} <= set(entry), line
        entries.append(entry)
    assert "\x1b[" not in stdout + text and "Traceback" not in stdout + text
    assert any(e["message"] == "epd stopped" for e in entries)

    def about(request_id: str, role: str) -> list[dict]:
        return [e for e in entries if e.get("request_id") == request_id and e["role"].startswith(role)]

    access = [e for e in about("trace-me-42", "router-") if e["logger"] == "epd.access"]
    assert len(access) == 1 and access[0]["level"] == "INFO", access
    assert {k: access[0][k] for k in ("front", "status", "finish_reason", "output_tokens", "images")} == {
        "front": "grpc", "status": "OK", "finish_reason": "length", "output_tokens": 3000, "images": 1}
    assert access[0]["prompt_tokens"] > 0 and 0 < access[0]["ttft_s"] <= access[0]["e2e_s"]
    assert "cached_tokens" in access[0]
    prefills = [e for e in about("trace-me-42", "prefill-") if e.get("method") == "Prefill"]
    assert len(prefills) >= 2, prefills  # the first attempt and the resumed one
    decodes = {e["role"] for e in about("trace-me-42", "decode-") if e.get("method") == "Handoff"}
    assert len(decodes) == 2, decodes  # both decode workers it ran on name it
    assert about("trace-me-42", "encode-"), "the Encoder service's lines name it too"
    assert any(e["role"] == "router-4" or e["role"].startswith("router-") for e in about("trace-me-42", "router-")
               if "lost request" in e["message"])  # the resume, under the same id
    http_id = answer["id"]
    assert [e["status"] for e in about(http_id, "router-") if e["logger"] == "epd.access"] == ["OK"]
    assert about(http_id, "prefill-") and about(http_id, "decode-")
    refused = [e for e in entries if e["logger"] == "epd.access" and e["status"] == "INVALID_ARGUMENT"]
    assert len(refused) == 1 and refused[0]["level"] == "INFO" and "max_tokens" in refused[0]["error"]
    assert not [e for e in entries if e["level"] in ("WARNING", "ERROR") and "max_tokens" in e["message"]]
