"""The forward trace (``EPD_FORWARD_TRACE``): one JSON line per forward when set, nothing when not,
and ``bench.forward_trace``'s reading of it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import torch

from bench import forward_trace as reader
from epd import core_share, forward_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_forward_writes_one_line_with_what_it_carried(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(forward_trace.ENV, str(path))
    forward_trace.note(rows=8, prefill_tokens=300, prompts=1)
    with core_share.forward_turn():
        torch.ones(64, 64) @ torch.ones(64, 64)
    with core_share.forward_turn():  # nothing noted for this one: no fields left over from the last
        pass
    first, second = _lines(path)
    assert first["rows"] == 8 and first["prefill_tokens"] == 300 and first["prompts"] == 1
    assert "rows" not in second
    for line in (first, second):
        assert line["start"] <= line["end"] and line["cpu_s"] >= 0
        assert line["threads"] == [torch.get_num_threads()] * 2
        assert line["role"] and line["pid"] > 0


def test_nothing_is_written_when_the_variable_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv(forward_trace.ENV, raising=False)
    forward_trace.note(rows=8)  # not kept either: a later trace must not start with it
    with core_share.forward_turn():
        pass
    path = tmp_path / "later.jsonl"
    monkeypatch.setenv(forward_trace.ENV, str(path))
    with core_share.forward_turn():
        pass
    assert "rows" not in _lines(path)[0]


def test_a_path_that_cannot_be_opened_is_said_once_and_forwards_go_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(forward_trace.ENV, str(tmp_path))  # a directory
    with caplog.at_level(logging.WARNING, logger="epd.forward_trace"):
        for _ in range(3):
            with core_share.forward_turn():
                pass
    assert sum("cannot be opened" in r.getMessage() for r in caplog.records) == 1


def _record(role, start, end, **fields):
    return {"role": role, "pid": 1, "start": start, "end": end, "cpu_s": (end - start) * 2, "threads": [2, 2],
            **fields}


def test_the_reader_folds_decode_runs_and_sums_each_role(tmp_path, capsys):
    records = [_record("encoder-0", 100.0, 101.0, images=1, patches=784),
               _record("prefill-2", 101.0, 103.0, rows=0, prefill_tokens=300, prompts=1),
               *[_record("prefill-2", 103.0 + 0.1 * i, 103.1 + 0.1 * i, rows=8, prefill_tokens=0, prompts=0)
                 for i in range(10)],
               _record("prefill-2", 104.0, 104.1, rows=7, prefill_tokens=0, prompts=0)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(records)) + '{"torn": \n')
    rows = reader.timeline(reader.load(str(path)))
    assert [(r["role"], r["count"], r["rows"]) for r in rows] == [
        ("encoder-0", 1, 0), ("prefill-2", 1, 0), ("prefill-2", 10, 8), ("prefill-2", 1, 7)]
    assert abs(rows[2]["end"] - 104.0) < 1e-9
    roles = reader.per_role(reader.load(str(path)))
    assert roles["prefill-2"]["forwards"] == 12 and abs(roles["prefill-2"]["busy_s"] - 3.1) < 1e-9
    assert abs(roles["encoder-0"]["busy_share"] - 1 / 4.1) < 1e-9
    assert abs(roles["prefill-2"]["cpu_per_busy_s"] - 2.0) < 1e-9
    reader.main([str(path), "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert "10 x 100 ms" in out and "vision 1 image(s), 784 patches" in out
    assert json.loads((tmp_path / "out.json").read_text())["roles"]["encoder-0"]["forwards"] == 1


def test_the_reader_stops_quietly_when_its_reader_goes_away(tmp_path):
    """``python -m bench.forward_trace FILE | head``: no BrokenPipeError traceback, the shell's
    status for SIGPIPE."""
    records = [_record(("encoder-0", "prefill-2")[i % 2], 100.0 + i, 100.5 + i, images=1, patches=784)
               for i in range(4000)]  # ~400 KB of timeline: far past the pipe's buffer
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    reading = subprocess.Popen([sys.executable, "-m", "bench.forward_trace", str(path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=ROOT)
    assert b"encoder-0" in reading.stdout.readline()
    reading.stdout.close()  # as `head -1` does
    stderr = reading.stderr.read().decode()
    assert reading.wait(timeout=60) == 141, stderr
    assert stderr == ""
