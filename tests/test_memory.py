"""The memory model on a real stack (docs/ARCHITECTURE.md, "The memory model"): decode's paged K/V
pool with a byte budget, admission and preemption by memory, a request that can never fit refused
before prefill, overload answered with RESOURCE_EXHAUSTED and never an OOM, every answer exact.

The checkpoint is ``tiny-32k`` (tiny layers, a 32,768-token window): 1 KiB of K/V per token, so
pools of a few MiB are easy to overfill with real requests in seconds.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from bench.workload import PromptMaker
from epd import client
from tests.conftest import epd_status, ray_address, serving

KV_PER_TOKEN = 1024  # tiny-32k: one full-attention layer, 2 KV heads of dim 64, K and V, float32
OVERLOAD_S = float(os.environ.get("EPD_OVERLOAD_S", "40"))  # `make test-slow` style runs may raise it


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory) -> str:
    from epd.checkpoint import create_checkpoint

    return str(create_checkpoint("tiny-32k", tmp_path_factory.mktemp("ckpt") / "tiny-32k", seed=0, progress=False))


@pytest.fixture(scope="module")
def long_oracle(long_model_dir):
    from bench.oracle import Oracle

    return Oracle(long_model_dir)


@pytest.fixture(scope="module")
def prompts(long_model_dir) -> PromptMaker:
    return PromptMaker.from_model_dir(long_model_dir)


def _decode_pid(server) -> int:
    (replica,) = epd_status(ray_address(server))["roles"]["decode"]
    return replica["pid"]


def _memory(pid: int, field: str) -> int:
    """A line of /proc/PID/status in bytes: VmRSS (resident now) or VmHWM (its high-water mark)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def _peak_rss(pid: int) -> int:
    return _memory(pid, "VmHWM")


def _rss(pid: int) -> int:
    return _memory(pid, "VmRSS")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metric(port: int, name: str) -> float:
    """The sum of a metric's samples on a role's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _greedy(prompt: str, max_tokens: int, **sampling):
    return client.user_request(prompt, [], max_tokens=max_tokens, ignore_eos=True, **sampling)


POOL_TOKENS = 30720  # 30 MiB: below the model's 32,768-token window, so a request can fit one and not the other


@pytest.fixture(scope="module")
def long_stack(long_model_dir, tmp_path_factory):
    port = _free_port()
    with serving(long_model_dir, "--kv-cache-bytes", str(POOL_TOKENS * KV_PER_TOKEN), "--max-batch-size", "32",
                 "--request-timeout-s", "600", "--decode-metrics-port", str(port),
                 log_path=str(tmp_path_factory.mktemp("logs") / "serve.log")) as server:
        server.decode_metrics = port
        yield server


def test_a_request_near_the_window_among_31_short_ones_in_a_smaller_pool(long_stack, long_oracle, prompts):
    """31 short requests decode long answers; one 30,000-token prompt arrives among them. Their K/V
    needs more than the pool holds, so decode admits by memory and preempts (the preempted resume
    by replay): every request completes, token-identical to transformers, and the decode process
    never grows past its idle size plus the pool plus a fixed overhead."""
    addr, pid = long_stack.address, _decode_pid(long_stack)
    rng = random.Random(7)
    short = [prompts.make(rng, 100) for _ in range(31)]
    long_prompt = prompts.make(rng, 30000)
    short_tokens, long_tokens = 1000, 24  # the short ones alone come to more than the pool
    # Warm up (threads, allocator arenas, kernels picked at first use), then take the idle size.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: client.generate(addr, _greedy(p, 64), timeout_s=600),
                      [prompts.make(rng, 2000) for _ in range(8)]))
    idle_rss = _rss(pid)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        shorts = [pool.submit(client.generate, addr, _greedy(p, short_tokens), timeout_s=600) for p in short]
        time.sleep(2.0)  # the short ones are decoding when the long one comes
        long_future = pool.submit(client.generate, addr, _greedy(long_prompt, long_tokens), timeout_s=600)
        results = [f.result() for f in shorts]
        long_result = long_future.result()
    prompt_tokens = sum(r.summary.prompt_tokens for r in results) + long_result.summary.prompt_tokens
    assert long_result.summary.prompt_tokens > 30000
    assert prompt_tokens + 31 * short_tokens + long_tokens > POOL_TOKENS  # their sum does not fit
    assert _metric(long_stack.decode_metrics, "epd_decode_preemptions_total") >= 1, "the pool was never short"
    assert _metric(long_stack.decode_metrics, "epd_decode_swapped_bytes") == 0  # every swapped state came back
    # Checked against transformers: the long one and eight short ones, the youngest admitted
    # (preempted first) among them (all 32 would take minutes of transformers' time).
    for prompt, result in [(long_prompt, long_result), *zip(short[-6:], results[-6:]), *zip(short[:2], results[:2])]:
        assert len(result.token_ids) == result.summary.completion_tokens
        want = long_oracle.generate_through_eos(long_oracle.inputs(prompt, []), len(result.token_ids))
        assert result.token_ids == want
    assert all(len(r.token_ids) == short_tokens for r in results)
    # Peak memory: idle (weights, runtime, warm) + the pool + the waiting handoffs (at most half
    # the pool, held as received bytes and then as tensors: 2x) + the swap space (half the pool)
    # + a fixed 256 MiB (the executor threads' allocator arenas, gRPC buffers). The unpaged batch
    # this replaced sized all 32 slots to the longest request: ~1 GB more for this one.
    pool_bytes = POOL_TOKENS * KV_PER_TOKEN
    bound = idle_rss + pool_bytes + 2 * (pool_bytes // 2) + pool_bytes // 2 + 256 * 2**20
    assert _peak_rss(pid) <= bound, f"decode peaked at {_peak_rss(pid) / 2**20:.0f} MiB, bound {bound / 2**20:.0f}"


def test_a_request_that_can_never_fit_is_refused_before_prefill(long_stack, prompts):
    prompt = prompts.make(random.Random(3), 30500)  # + 400 tokens: inside the window, more than the pool
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(long_stack.address, _greedy(prompt, 400), timeout_s=120)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"K/V pool holds {POOL_TOKENS}" in caught.value.details(), caught.value.details()
    assert "decode.kv_cache_bytes" in caught.value.details()
    assert time.monotonic() - start < 10  # no 32k-token prefill ran
    ok = client.generate(long_stack.address, _greedy("still serving?", 4), timeout_s=60)
    assert len(ok.token_ids) == 4


# ---------------------------------------------------------------- overload


SMALL_POOL_TOKENS = 4096


@pytest.fixture(scope="module")
def small_stack(long_model_dir, tmp_path_factory):
    with serving(long_model_dir, "--kv-cache-bytes", str(SMALL_POOL_TOKENS * KV_PER_TOKEN), "--max-batch-size", "16",
                 "--max-queued-requests", "12", "--request-timeout-s", "300",
                 log_path=str(tmp_path_factory.mktemp("logs") / "serve.log")) as server:
        yield server


# The prober runs in a process of its own: probed from the test's process, every latency would also
# hold the GIL waits of the 8 streaming clients beside it (about half of each p99 on this machine).
_PROBER = """
import json, sys, threading, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
addresses, period = sys.argv[1].split(","), float(sys.argv[2])
latencies = {a: [] for a in addresses}
stop = threading.Event()
def probe(address):
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected before timing starts
        ready.release()
        while not stop.wait(period):
            start = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            latencies[address].append(time.perf_counter() - start)
ready = threading.Semaphore(0)
threads = [threading.Thread(target=probe, args=(a,)) for a in addresses]
for thread in threads:
    thread.start()
for _ in addresses:
    ready.acquire()
print("probing", flush=True)
sys.stdin.readline()
stop.set()
for thread in threads:
    thread.join()
print(json.dumps(latencies), flush=True)
"""


class HealthProbe:
    """grpc.health.v1 Check on each address every ``period_s`` over one channel each, from a process of
    its own; ``close`` stops it and returns each address's 99th-percentile latency."""

    def __init__(self, addresses: list[str], period_s: float = 0.025) -> None:
        self.latencies: dict[str, list[float]] = {}
        self._process = subprocess.Popen([sys.executable, "-c", _PROBER, ",".join(addresses), str(period_s)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout.readline().strip() == "probing", "the prober never connected"

    def close(self) -> dict[str, float]:
        out, _ = self._process.communicate("stop\n", timeout=30)
        self.latencies = json.loads(out)
        return {a: sorted(v)[int(0.99 * (len(v) - 1))] for a, v in self.latencies.items() if v}


def test_overload_is_refused_cleanly_and_every_completed_answer_is_exact(small_stack, long_oracle, prompts):
    """Concurrent requests needing 4x the K/V pool for a while: every one either completes or is
    refused with RESOURCE_EXHAUSTED; decode preempts (counted), nothing dies, greedy answers match
    transformers and seeded sampled ones match the same request run alone afterwards."""
    addr = small_stack.address
    status = epd_status(ray_address(small_stack))
    pids = {role: [r["pid"] for r in replicas] for role, replicas in status["roles"].items()}
    rng = random.Random(11)
    texts = [prompts.make(rng, 200) for _ in range(6)]
    answer = 480
    demand = 24 * (200 + 30 + answer)
    assert demand >= 4 * SMALL_POOL_TOKENS
    outcomes: list[tuple[int, bool, client.GenerateResult | None, grpc.StatusCode | None]] = []
    lock = threading.Lock()
    end = time.monotonic() + OVERLOAD_S

    def worker(index: int) -> None:
        turn = 0
        while time.monotonic() < end:
            which, sampled = (index + turn) % len(texts), (index + turn) % 2 == 1
            turn += 1
            sampling = dict(temperature=0.8, top_p=0.9, seed=which) if sampled else dict(temperature=0.0)
            try:
                result = client.generate(addr, _greedy(texts[which], answer, **sampling), timeout_s=300)
                outcome = (which, sampled, result, None)
            except grpc.RpcError as error:
                outcome = (which, sampled, None, error.code())
                if error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    time.sleep(0.2)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=OVERLOAD_S + 400)
    failures = [code for _, _, _, code in outcomes if code is not None and code is not grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert failures == []
    done = [(which, sampled, result) for which, sampled, result, _ in outcomes if result is not None]
    assert len(done) >= 24
    assert sum(r.summary.resumes for _, _, r in done) >= 1, "the pool was never short"
    after = epd_status(ray_address(small_stack))
    assert {role: [r["pid"] for r in replicas] for role, replicas in after["roles"].items()} == pids  # nothing died
    greedy = {which: long_oracle.generate_through_eos(long_oracle.inputs(texts[which], []), answer)
              for which in {w for w, sampled, _ in done if not sampled}}
    alone: dict[int, list[int]] = {}
    for which, sampled, result in done:
        if not sampled:
            assert result.token_ids == greedy[which]
            continue
        if which not in alone:
            alone[which] = client.generate(addr, _greedy(texts[which], answer, temperature=0.8, top_p=0.9,
                                                         seed=which), timeout_s=300).token_ids
        assert result.token_ids == alone[which]


# A bare grpc.aio health server, nothing else in its process: how long a Check takes on this machine
# at this moment, whatever else runs on it (the roles' own compute, a CI neighbour).
_BARE_HEALTH_SERVER = """
import asyncio, os, sys
import grpc
from grpc_health.v1 import health, health_pb2_grpc
os.nice(int(sys.argv[1]) - os.nice(0))
async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


@contextlib.contextmanager
def _bare_health_server(nice: int):
    process = subprocess.Popen([sys.executable, "-c", _BARE_HEALTH_SERVER, str(nice)], stdout=subprocess.PIPE, text=True)
    try:
        yield f"127.0.0.1:{int(process.stdout.readline())}"
    finally:
        process.kill()
        process.wait()


def _niceness(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of stat: nice


def test_every_role_answers_its_health_probe_within_100_ms_under_load(small_stack, prompts):
    """While streams run and handoffs arrive (8 clients, long answers), grpc.health.v1 Check on the
    router, prefill and decode answers within 100 ms at the 99th percentile: no event loop copies
    tensors or waits on the decode engine's lock.

    The probes come from a process of their own, every 25 ms. A bare health server at the roles'
    niceness is probed beside them: when the machine itself is so loaded that even it answers
    slowly, a role may take up to 3x its p99 (what the roles control is their own event loops, not
    the host's other tenants)."""
    status = epd_status(ray_address(small_stack))
    replicas = [r for role in ("router", "prefill", "decode") for r in status["roles"][role]]
    rng = random.Random(5)
    texts = [prompts.make(rng, 300) for _ in range(8)]
    with _bare_health_server(_niceness(replicas[0]["pid"])) as bare:
        probe = HealthProbe([*(r["address"] for r in replicas), bare])
        end = time.monotonic() + 15

        def worker(text: str) -> None:
            while time.monotonic() < end:
                client.generate(small_stack.address, _greedy(text, 200), timeout_s=120)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(worker, texts))
        p99 = probe.close()
    assert bare in p99 and len(p99) == len(replicas) + 1, f"some address never answered: {p99}"
    quiet = p99.pop(bare)
    limit = max(0.1, 3 * quiet)
    assert max(p99.values()) < limit, (f"health probe p99 by address: {p99}, the bare server's {quiet * 1e3:.0f} ms, "
                                       f"limit {limit * 1e3:.0f} ms")


def test_model_roles_run_at_the_launchers_niceness(small_stack):
    """Ray renices its workers to 15 unless told otherwise; the launcher tells it 0 (a role at 15
    loses a core to every wakeup of Ray's own daemons and the driver, and its whole OpenMP team
    waits at the next barrier: the served decode step was ~8% longer). The roles keep the niceness
    of the process that started `epd serve`, this test's."""
    status = epd_status(ray_address(small_stack))
    pids = {role: [r["pid"] for r in status["roles"][role]] for role in ("encoder", "prefill", "decode", "router")}
    assert all(pids.values()), f"a role without replicas: {pids}"
    mine = os.nice(0)
    niceness = {role: [_niceness(pid) for pid in found] for role, found in pids.items()}
    assert all(n == mine for found in niceness.values() for n in found), (niceness, mine)
