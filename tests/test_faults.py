"""Faults with one replica of each role, graceful shutdown, and streams beyond any thread pool,
against real `epd serve` processes (tiny model): real `kill -9`, real SIGTERM."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import threading
import time
import urllib.request

import grpc
import psutil
import pytest

from bench.synthetic import make_image
from epd import allocator, client, discovery, handoff, rpc
from epd.v1 import epd_pb2_grpc
from tests.conftest import ServeProcess, epd, epd_status, free_port, ray_address, serving

IMAGE = make_image(128, 128, seed=900)


@pytest.fixture(scope="module")
def single(tiny_model_dir, tmp_path_factory):
    """One replica of every role; decode batches up to 64 requests."""
    ports = {role: free_port() for role in ("router", "prefill", "decode")}
    with serving(tiny_model_dir, "--max-batch-size", "64", "--decode-metrics-port", str(ports["decode"]),
                 "--router-metrics-port", str(ports["router"]), "--prefill-metrics-port", str(ports["prefill"]),
                 "--log-level", "INFO", log_path=str(tmp_path_factory.mktemp("logs") / "single.log")) as server:
        server.metrics = {role: f"http://127.0.0.1:{port}/metrics" for role, port in ports.items()}
        server.decode_metrics = server.metrics["decode"]
        yield server


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_more_streams_than_any_thread_pool_decode_in_one_batch(single):
    """48 long streams at once (a 32-thread server ran them in waves): every stream is past its
    first decode batch before any of them finishes, and decode ran them as one batch."""
    first_decoded: list[float] = []
    finished: list[float] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def stream(n: int) -> None:
        request = client.user_request(f"Stream number {n}, keep going.", max_tokens=400, ignore_eos=True)
        chunks = 0
        try:
            for event in client.stream(single.address, request, timeout_s=600):
                if event.WhichOneof("event") == "chunk":
                    chunks += 1
                    if chunks == 2:  # the first chunk is prefill's token; the second comes from decode
                        with lock:
                            first_decoded.append(time.monotonic())
            with lock:
                finished.append(time.monotonic())
        except BaseException as error:  # noqa: BLE001 - asserted below
            failures.append(error)

    threads = [threading.Thread(target=stream, args=(n,)) for n in range(48)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert failures == [] and len(finished) == 48
    assert max(first_decoded) < min(finished), "some streams only started after others finished (waves)"
    assert _metric(single.decode_metrics, "epd_decode_largest_batch") >= 40


def test_model_roles_run_with_jemalloc_and_the_others_with_glibc(single):
    """epd.allocator: the encoder, prefill and decode replicas' processes start with jemalloc
    preloaded (their forwards run on threads of their own), the router's without."""
    if allocator.library() is None or os.environ.get(allocator.ENV) == "0" or os.environ.get("LD_PRELOAD"):
        pytest.skip("no jemalloc to preload here, or turned off, or another allocator preloaded")
    roles = epd_status(ray_address(single))["roles"]
    loaded = {role: allocator.in_use(roles[role][0]["pid"]) for role in ("encoder", "prefill", "decode", "router")}
    assert loaded == {"encoder": True, "prefill": True, "decode": True, "router": False}


def test_clients_that_leave_free_their_work_at_every_stage(single):
    """Six clients leave long requests (prompts of ~6k tokens, 2,000 tokens to generate) once
    decode streams the first: within 3 s prefill and decode are idle again, and the counters say
    at which stage each request was when its client left."""
    address = ray_address(single)
    roles = epd_status(address)["roles"]
    workers = [psutil.Process(roles[role][0]["pid"]) for role in ("prefill", "decode")]
    before = _counts(single.metrics["router"], "epd_requests_cancelled_total")
    calls = []
    for n in range(6):
        request = client.user_request(f"{n} " + "lorem ipsum dolor sit amet " * 350, max_tokens=2000,
                                      ignore_eos=True)
        chan, metadata = client.connect(single.address)
        calls.append((chan, epd_pb2_grpc.RouterStub(chan).Generate(request, timeout=600)))
    # Leave once the router carries all six (a loaded machine can take a while to start the last
    # one: a call cancelled before its handler runs is never the router's) and decode streams one
    # of them (the rest are in prefill, queued for it, or also decoding then).
    deadline = time.monotonic() + 60
    while _metric(single.metrics["router"], "epd_router_running_requests") < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    while _metric(single.metrics["decode"], "epd_decode_running_requests") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    ended = {}
    for n, (chan, call) in enumerate(calls):
        if not call.cancel():  # the client goes away; False: the call had already ended by itself
            ended[n] = (call.code(), call.details())
        chan.close()
    assert ended == {}, f"calls that ended before their clients left: {ended}"
    # Idle again within 3 s: both workers under 25% of a core over a half second. A worker that
    # went on with the requests stays busy in every window (decode without its cancel: ~6 s here,
    # the rest of a 2,000-token answer); one late burst (CI once saw decode at 89% over the second
    # after the departures, not seen again in a dozen tries) is not a leak.
    for worker in workers:
        worker.cpu_percent()
    windows = []
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        time.sleep(0.5)
        windows.append({w.pid: w.cpu_percent() for w in workers})
        if all(load < 25 for load in windows[-1].values()) and len(windows) > 1:
            break
    running = _metric(single.metrics["decode"], "epd_decode_running_requests")
    assert all(load < 25 for load in windows[-1].values()), \
        f"still working 3 s after its clients left (prefill, decode pids: CPU % each 0.5 s): {windows}; " \
        f"decode running {running}"
    after = _counts(single.metrics["router"], "epd_requests_cancelled_total")
    stages = {stage: after.get(stage, 0) - before.get(stage, 0) for stage in after}
    assert sum(stages.values()) == 6, stages
    # Which side saw a departure first is a race (prefill may finish a prompt as its caller
    # leaves), so the proof that nothing is held is the end state, not a match of counters.
    assert _metric(single.metrics["prefill"], "epd_prefill_held_bytes") == 0  # every prompt's budget given back
    assert _metric(single.metrics["router"], "epd_router_running_requests") == 0
    assert _metric(single.metrics["decode"], "epd_decode_running_requests") == 0
    assert _metric(single.metrics["decode"], "epd_decode_kv_blocks_used") == 0  # every slot's blocks freed
    held = {r["name"]: r["in_flight"] for replicas in epd_status(address)["roles"].values() for r in replicas}
    assert set(held.values()) == {0}, f"epd status says work is still held: {held}"


def _counts(url: str, family: str) -> dict[str, float]:
    """A labelled counter's samples: label value -> count."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {label: float(value) for label, value in
            re.findall(rf'^{re.escape(family)}{{\w+="([^"]*)"}} (\S+)$', text, re.MULTILINE)}


@pytest.mark.parametrize("role", ["decode", "prefill", "encoder"])
def test_a_lone_replica_killed_is_a_pause_and_both_come_back(single, oracle, role):
    """The only replica of a role dies under a light load: the requests sent while Ray restarts it
    wait for it (``--replica-wait-s``, within their deadline) and complete, token-identical to
    transformers: 0 failed. Health says NOT_SERVING in the gap, and a request whose deadline is
    shorter than the restart ends within it with DEADLINE_EXCEEDED or UNAVAILABLE naming the role
    (never INTERNAL, never a hang)."""
    address = ray_address(single)
    replica = epd_status(address)["roles"][role][0]
    results, failures, lock = [], [], threading.Lock()
    stop = threading.Event()

    def load(seed: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            image = make_image(128, 128, seed=seed * 1000 + n)  # fresh: the encoder must run
            try:
                result = client.generate(single.address, client.user_request("Back?", [image], max_tokens=6),
                                         timeout_s=90)
                with lock:
                    results.append((image, result, time.monotonic()))
            except grpc.RpcError as error:
                with lock:
                    failures.append((error.code(), error.details()))

    threads = [threading.Thread(target=load, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    os.kill(replica["pid"], signal.SIGKILL)
    killed = time.monotonic()
    started = time.monotonic()
    try:  # a deadline shorter than any restart
        client.generate(single.address, client.user_request("Too soon?", [make_image(96, 96, seed=7)],
                                                            max_tokens=6), timeout_s=1.5)
        short = None
    except grpc.RpcError as error:
        short = (time.monotonic() - started, error.code(), error.details())
    seen_not_serving = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        seen_not_serving |= not rpc.is_serving(single.address, timeout_s=2)
        with lock:
            after = [r for r in results if r[2] > killed + 0.5]
        if len(after) >= 6 and seen_not_serving:
            break
        time.sleep(0.1)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == [], failures[:3]
    assert len([r for r in results if r[2] > killed + 0.5]) >= 6, "no recovery: nothing completed after the kill"
    for image, result, _ in results[-4:]:
        assert result.token_ids == oracle.generate("Back?", [image], max_new_tokens=6)[0]
    if short is not None:  # the restart may well have been quicker than 1.5 s
        took, code, details = short
        assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), (code, details)
        assert took < 5, f"a request with a 1.5 s deadline took {took:.1f} s"
    assert seen_not_serving
    rpc.wait_serving(single.address, timeout_s=10)
    # The controller records the restart at its next probe round, which may come after the answer.
    def events() -> list[dict]:
        return [e for e in epd_status(address)["events"] if e["name"] == replica["name"]]

    assert discovery.wait_until(lambda: any(e["kind"] in ("restarted", "replaced") for e in events()), 30), events()
    # a prefill killed between writing a handoff's shared-memory file and its end leaves the file:
    # the prefill that replaces it removes every file of a writer that is gone as it starts
    assert not list(pathlib.Path("/dev/shm").glob(f"{handoff.SHARED_PREFIX}{replica['pid']}-*"))


def _controller_process(server: ServeProcess) -> psutil.Process:
    for process in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if any("ray::Controller" in part for part in process.cmdline()):
                return process
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no controller process under epd serve")


def test_a_controller_restart_keeps_the_history_and_the_metrics_address(single):
    """`epd status` after the controller's kill -9: the same metrics address (a Prometheus target
    taken from it stays valid), the life events and counts from before it, and the restart itself
    in the history; the replicas were adopted, not replaced."""
    address = ray_address(single)
    before = epd_status(address)
    assert before.get("controller_starts") == 1 and before["events"], before
    names = sorted(r["name"] for replicas in before["roles"].values() for r in replicas)
    _controller_process(single).kill()
    assert discovery.wait_until(lambda: epd_status(address).get("controller_starts") == 2, 60)
    after = epd_status(address)
    assert after["metrics"] == before["metrics"]
    assert after["since"] == before["since"]
    assert after["events"][:len(before["events"])] == before["events"]
    assert any(e["name"] == "controller" and e["kind"] == "restarted" for e in after["events"]), after["events"]
    for role, counts in before["counts"].items():
        assert all(after["counts"][role][kind] >= n for kind, n in counts.items()), (before["counts"], after["counts"])
    assert sorted(r["name"] for replicas in after["roles"].values() for r in replicas) == names
    text = urllib.request.urlopen(f"http://{after['metrics']}/metrics", timeout=10).read().decode()
    assert "epd_replica_events" in text
    out = epd("status", "--address", address)
    assert out.returncode == 0 and "controller restarted 1x" in out.stdout, out.stdout


def test_sigterm_lets_the_streams_in_flight_finish(tiny_model_dir, tmp_path):
    server = ServeProcess(tiny_model_dir, "--log-level", "INFO", log_path=str(tmp_path / "drain.log"))
    results: list = [None] * 5
    started = threading.Barrier(6)

    def stream(n: int) -> None:
        request = client.user_request(f"Long answer {n}.", [IMAGE], max_tokens=600, ignore_eos=True)
        tokens, first, finish = [], True, ""
        try:
            for event in client.stream(server.address, request, timeout_s=300):
                if event.WhichOneof("event") == "chunk":
                    tokens += event.chunk.token_ids
                    if first:
                        first = False
                        started.wait(timeout=120)
                else:
                    finish = event.summary.finish_reason
            results[n] = (len(tokens), finish)
        except grpc.RpcError as error:
            results[n] = error

    threads = [threading.Thread(target=stream, args=(n,)) for n in range(5)]
    try:
        for thread in threads:
            thread.start()
        started.wait(timeout=120)  # all five are streaming
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while rpc.is_serving(server.address, timeout_s=1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not rpc.is_serving(server.address, timeout_s=1), "health still SERVING after SIGTERM"
        with pytest.raises(grpc.RpcError) as refused:  # no new work while draining
            client.generate(server.address, client.user_request("Too late?", max_tokens=2), timeout_s=30)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        for thread in threads:
            thread.join(timeout=120)
        assert results == [(600, "length")] * 5
    finally:
        alive = server.stop()
    assert alive == []
    assert server.proc.returncode == 0
    server_log = open(server.log.name).read()
    assert "drained 5 request(s) in flight: 5 finished, 0 cut" in server_log
