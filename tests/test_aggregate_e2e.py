"""An aggregated deployment through the whole stack (`epd serve` on a machine without GPUs, whose
default it is: Ray local, embedded redis-server, gRPC on loopback): one prefill+decode replica,
one engine whose steps carry decode rows and prefill chunks together. The E/P/D parity shapes
(text, images, a second turn whose image-bearing prefix comes from the cache) token-identical to
transformers while they share steps, and a `kill -9` of the replica under load fails no request."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from bench.synthetic import make_image
from epd import client, discovery
from epd.v1 import epd_pb2_grpc
from tests.conftest import DEFAULT_MODE, epd_status, free_port, ray_address, serving
from tests.test_cache_e2e import chat, user
from tests.test_faults import _metric

pytestmark = pytest.mark.slow

SQUARE = make_image(448, 448, seed=1)
WIDE = make_image(640, 200, seed=2)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    port = free_port()
    # --replica-wait-s: requests wait out the replica's restart, which took 49 s on a machine at load 8
    # no --aggregate: the mode `epd serve` picks where no GPU is offered (--num-gpus 0)
    with serving(tiny_model_dir, DEFAULT_MODE, "--num-gpus", "0", "--encoders", "1", "--prefill-chunk-tokens", "32",
                 "--replica-wait-s", "150",
                 "--step-tokens", "48", "--prefill-metrics-port", str(port), "--log-level", "INFO",
                 log_path=str(tmp_path_factory.mktemp("logs") / "aggregate.log")) as server:
        server.metrics = f"http://127.0.0.1:{port}/metrics"
        yield server


def test_parity_shapes_through_one_engine_token_identical(stack, oracle):
    assert "prefill and decode: one engine per replica (aggregated) (one machine, no GPU: both share its cores)\n" \
        in stack.lines
    status = epd_status(ray_address(stack))
    assert status["aggregate"] and status["roles"]["decode"] == []
    assert len(status["roles"]["prefill"]) == 1 and "kv" in status["roles"]["prefill"][0]
    conversations = {
        "text": [user("Tell me a long story about a lighthouse keeper and the sea.")],
        "square": [user("What is in this picture?", SQUARE)],
        "two-images": [user("Compare these.", SQUARE, WIDE)],
    }
    # the text answer is long (EOS ignored) so that it is still decoding when the image prompts' chunks run:
    # 400 tokens were decoded before the first image was encoded on an AMD EPYC (no step was mixed)
    lengths = {"text": 1200, "square": 16, "two-images": 16}
    expected = {name: oracle.generate_through_eos(oracle.chat_inputs(messages), lengths[name])
                for name, messages in conversations.items()}
    results: dict[str, list[int]] = {}

    def run(name: str) -> None:
        results[name] = chat(stack.address, conversations[name], max_tokens=lengths[name], ignore_eos=True).token_ids

    threads = [threading.Thread(target=run, args=(name,)) for name in conversations]
    for thread in threads:  # the text answer decodes while the image prompts' chunks run
        thread.start()
        time.sleep(0.3)
    for thread in threads:
        thread.join(180)
    assert results == expected
    first = chat(stack.address, conversations["square"], max_tokens=16)
    turn2 = [*conversations["square"], {"role": "assistant", "content": first.text},
             {"role": "user", "content": "And what colour is it?"}]
    second = chat(stack.address, turn2, max_tokens=12)
    assert second.token_ids == oracle.generate_chat(turn2, max_new_tokens=12)[0]
    assert second.summary.cached_tokens >= 128  # the first turn's prefix (snapshots every 64 tokens) from the cache
    assert _metric(stack.metrics, "epd_decode_mixed_steps_total") > 0  # decode rows rode prefill chunks
    assert _metric(stack.metrics, "epd_decode_running_requests") == 0


def test_clients_that_leave_free_their_work_in_prefill_and_decode(stack):
    """Long requests whose clients leave (some mid-prefill, some decoding): the one engine lets
    go of all of it: no prompt waiting, no request decoding, no K/V block or prefill budget held."""
    calls = []
    for n in range(4):
        words = "lorem ipsum dolor sit amet " * (40 if n % 2 else 300)  # short ones decode, long ones prefill
        request = client.user_request(f"{n} {words}", max_tokens=1500, ignore_eos=True)
        chan, _ = client.connect(stack.address)
        calls.append((chan, epd_pb2_grpc.RouterStub(chan).Generate(request, timeout=600)))
    time.sleep(3.0)
    for chan, call in calls:
        assert call.cancel(), f"a call ended before its client left: {call.code()} {call.details()}"
        chan.close()

    def idle() -> bool:
        return all(_metric(stack.metrics, name) == 0 for name in (
            "epd_prefill_waiting_prompts", "epd_prefill_held_bytes", "epd_decode_running_requests",
            "epd_decode_kv_blocks_used"))

    assert discovery.wait_until(idle, 30), "work still held after its clients left"


def test_a_kill_9_of_the_aggregated_replica_under_load_fails_no_request(stack, oracle):
    """The only prefill+decode replica dies under load: requests on it resume or wait for its
    restart (``--replica-wait-s``) and complete, token-identical to transformers: 0 failed."""
    replica = epd_status(ray_address(stack))["roles"]["prefill"][0]
    results, failures, lock = [], [], threading.Lock()
    stop = threading.Event()

    def load(seed: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            image = make_image(128, 128, seed=seed * 1000 + n)
            try:
                result = client.generate(stack.address, client.user_request("Back?", [image], max_tokens=24,
                                                                           ignore_eos=True), timeout_s=300)
                with lock:
                    results.append((image, result, time.monotonic()))
            except grpc.RpcError as error:
                with lock:
                    failures.append((error.code(), error.details()))

    threads = [threading.Thread(target=load, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    os.kill(replica["pid"], signal.SIGKILL)
    killed = time.monotonic()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        with lock:
            if len([r for r in results if r[2] > killed + 0.5]) >= 8:
                break
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(timeout=300)
    assert failures == [], failures[:3]
    assert len([r for r in results if r[2] > killed + 0.5]) >= 8, "no recovery: nothing completed after the kill"
    for image, result, _ in results[-4:]:
        inputs = oracle.inputs("Back?", [image])
        assert result.token_ids == oracle.generate_through_eos(inputs, 24)
