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
