"""Both caches through the whole stack (`epd serve` on a real Ray, gRPC on loopback, a real
redis-server owned by the test so it can look inside): correctness against transformers, what the
Summary reports, single flight, the eviction race, and memory caps under 1,000 distinct images."""

from __future__ import annotations

import json
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import redis

from bench.synthetic import make_image
from control.redis_server import EmbeddedRedis
from epd import client, handoff, rpc
from epd.modelinfo import ModelInfo
from epd.store import EmbeddingStore
from epd.v1 import epd_pb2, epd_pb2_grpc
from prefill_svc.caches import snapshot_points
from tests.conftest import ServeProcess, epd_status, ray_address

BLOCK = 16
EVERY = 4
REDIS_MB = 16
LRU_MB = 1
PREFIX_MB = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    def __init__(self, serve: ServeProcess, redis_url: str, router_metrics: int, prefill_metrics: int) -> None:
        self.serve, self.addr, self.redis_url = serve, serve.address, redis_url
        self.router_metrics, self.prefill_metrics = router_metrics, prefill_metrics
        roles = epd_status(ray_address(serve))["roles"]
        self.role_addrs = {role: replicas[0]["address"] for role, replicas in roles.items() if replicas}

    def metrics(self, port: int) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return {m[0]: float(m[1]) for m in re.findall(r"^(\S+) (\S+)$", text, re.M)}


TOKEN = "test-internal-token-0123456789"  # so the test may call the internal Encoder service itself


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    store = EmbeddedRedis(max_memory_mb=REDIS_MB)
    ports = _free_port(), _free_port()
    token_file = tmp_path_factory.mktemp("secrets") / "internal-token"
    token_file.write_text(TOKEN)
    serve = None
    try:
        serve = ServeProcess(
            tiny_model_dir, "--encoders", "2", "--redis", store.url, "--store-ttl-s", "600",
            "--internal-token-file", str(token_file),
            "--embedding-cache-mb", str(LRU_MB), "--prefix-cache-mb", str(PREFIX_MB),
            "--prefix-block-size", str(BLOCK), "--snapshot-every-blocks", str(EVERY), "--prefill-chunk-tokens", "64",
            "--router-metrics-port", str(ports[0]), "--prefill-metrics-port", str(ports[1]), "--log-level", "INFO",
            log_path=str(tmp_path_factory.mktemp("logs") / "serve-cache.log"),
        )
        yield Stack(serve, store.url, *ports)
    finally:
        left = serve.stop() if serve is not None else []
        store.stop()
    assert left == [], "epd serve left processes behind"


def user(text, *images):
    return {"role": "user", "content": [*({"type": "image", "image": d} for d in images), {"type": "text", "text": text}]}


def to_proto(messages):
    return [epd_pb2.ChatMessage(role=m["role"], content=[
        epd_pb2.ContentPart(image=p["image"]) if p["type"] == "image" else epd_pb2.ContentPart(text=p["text"])
        for p in ([{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"])])
        for m in messages]


def chat(addr, messages, **sampling):
    return client.generate(addr, client.chat_request(to_proto(messages), **sampling), timeout_s=120)


def test_same_text_other_image_shares_no_cache_entry_in_either_order(stack, oracle):
    for seeds in ((101, 102), (104, 103)):
        images = [make_image(448, 448, seed=s) for s in seeds]
        first_image = oracle.inputs("Which one?", images[:1])["input_ids"][0].tolist().index(oracle.image_token_id)
        for image in images:
            result = chat(stack.addr, [user("Which one?", image)], max_tokens=12, logprobs=1)
            assert result.token_ids == oracle.generate("Which one?", [image], max_new_tokens=12)[0]
            assert (result.summary.images_encoded, result.summary.images_cached) == (1, 0)
            assert result.summary.cached_tokens <= first_image // BLOCK * BLOCK
        again = chat(stack.addr, [user("Which one?", images[0])], max_tokens=12)
        assert again.token_ids == oracle.generate("Which one?", images[:1], max_new_tokens=12)[0]
        assert again.summary.cached_tokens > first_image + 196  # its own entries do serve it
        assert (again.summary.images_encoded, again.summary.images_cached) == (0, 1)


def test_handoffs_on_one_host_go_through_shared_memory_and_leave_no_file(stack, oracle):
    """Prefill and decode share this host: each prompt's state reaches decode through a file of
    /dev/shm, not a gRPC stream, the answer is still transformers', and no file outlives its
    handoff (decode removes it as it maps it, prefill after the handoff either way)."""
    before = stack.metrics(stack.prefill_metrics)
    image = make_image(160, 160, seed=120)
    result = chat(stack.addr, [user("Through memory?", image)], max_tokens=8)
    assert result.token_ids == oracle.generate("Through memory?", [image], max_new_tokens=8)[0]
    after = stack.metrics(stack.prefill_metrics)
    name = "epd_prefill_handoffs_total{path=\"%s\"}"
    assert after[name % "shared_memory"] == before[name % "shared_memory"] + 1
    assert after[name % "stream"] == before[name % "stream"] == 0
    assert not list(pathlib.Path("/dev/shm").glob(f"{handoff.SHARED_PREFIX}*"))


def test_second_turn_reuses_the_first_and_matches_transformers(stack, oracle, tmp_path):
    image = make_image(448, 448, seed=111)
    turn1 = [user("What is in this picture?", image)]
    first = chat(stack.addr, turn1, max_tokens=12)
    assert first.token_ids == oracle.generate_chat(turn1, max_new_tokens=12)[0]
    assert first.text.strip(), "the first answer must have text for the history"

    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "photo.png").write_bytes(image)
    conversation = [
        {"role": "user", "content": [{"type": "image", "image": "pics/photo.png"},
                                     {"type": "text", "text": "What is in this picture?"}]},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And what colour is it?"},
    ]
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(conversation))
    out = subprocess.run([sys.executable, "-m", "control.cli", "generate", "--addr", stack.addr, "--messages", str(path),
                          "--max-tokens", "12", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    second = json.loads(out.stdout.strip().splitlines()[-1])

    turn2 = [turn1[0], {"role": "assistant", "content": first.text}, {"role": "user", "content": "And what colour is it?"}]
    ids1 = oracle.chat_inputs(turn1)["input_ids"][0].tolist()
    ids2 = oracle.chat_inputs(turn2)["input_ids"][0].tolist()
    shared = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    turn_start = len(ids1) - 1 - ids1[::-1].index(oracle.tokenizer.convert_tokens_to_ids("<|im_start|>"))
    expected = max(p for p in snapshot_points(len(ids1), BLOCK, EVERY, turn_start) if p <= shared)
    assert expected >= turn_start // BLOCK * BLOCK  # covers the first turn up to its generation prompt
    assert second["cached_tokens"] == expected
    assert (second["images"], second["images_cached"], second["images_encoded"]) == (1, 1, 0)
    assert second["token_ids"] == oracle.generate_chat(turn2, max_new_tokens=12)[0]


def test_messages_file_errors_name_the_problem(stack, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"role": "user", "content": [{"type": "image", "image": "missing.png"}]}]))
    out = subprocess.run([sys.executable, "-m", "control.cli", "generate", "--addr", stack.addr, "--messages", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "message 0 part 0: cannot read image" in out.stderr and "missing.png" in out.stderr


def test_another_max_pixels_is_another_encoder_cache_key(stack):
    image = make_image(900, 700, seed=121)
    keys = redis.Redis.from_url(stack.redis_url)
    before = set(keys.keys("epd:emb:*"))
    a = chat(stack.addr, [user("Cap one.", image)], max_tokens=1)
    request = client.chat_request(to_proto([user("Cap two.", image)]), max_pixels=65536, max_tokens=1)
    b = client.generate(stack.addr, request, timeout_s=120)
    assert (a.summary.images_encoded, b.summary.images_encoded) == (1, 1)
    assert a.summary.image_tokens != b.summary.image_tokens
    assert len(set(keys.keys("epd:emb:*")) - before) == 2


def test_concurrent_requests_for_one_image_encode_it_once(stack, oracle):
    image = make_image(1024, 1024, seed=131)
    joins_before = stack.metrics(stack.router_metrics)["epd_encode_single_flight_joins_total"]
    barrier = threading.Barrier(4)
    results = [None] * 4

    def worker(n):
        barrier.wait()
        results[n] = chat(stack.addr, [user(f"Question {n}?", image)], max_tokens=4)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.summary.images_encoded for r in results) == 1
    assert sum(r.summary.images_cached for r in results) == 3
    assert results[2].token_ids == oracle.generate("Question 2?", [image], max_new_tokens=4)[0]
    # The requests did overlap: some waited on another's encode instead of sending their own.
    assert stack.metrics(stack.router_metrics)["epd_encode_single_flight_joins_total"] > joins_before


def test_a_value_prefill_cannot_use_costs_a_retry_not_a_failure(stack, oracle, tiny_model_dir):
    """The router finds the key present, prefill then cannot use what is there (the same path as
    an eviction between the two: here a value written for another key, which is also what a
    forged or stale value looks like): prefill reports it missing, the router encodes the image
    again (overwriting the key) and retries; the answer is right and the store is repaired."""
    from router_svc.prompt import PromptBuilder

    image = make_image(384, 320, seed=141)
    info = ModelInfo.load(tiny_model_dir)
    builder = PromptBuilder.load(tiny_model_dir, info, 64 * 1024 * 1024)
    key = builder.build(to_proto([user("Evicted?", image)]), None, False).images[0].store_key
    other = make_image(384, 320, seed=142)
    other_key = builder.build(to_proto([user("Evicted?", other)]), None, False).images[0].store_key
    # A value under our key that belongs to another image: present for the router, unusable for prefill.
    with rpc.channel(stack.role_addrs["encode"]) as chan:
        epd_pb2_grpc.EncoderStub(chan).Encode(
            epd_pb2.EncodeRequest(items=[epd_pb2.EncodeItem(store_key=other_key, data=other)]), timeout=60,
            metadata=((rpc.INTERNAL_TOKEN_KEY, TOKEN),))
    raw = redis.Redis.from_url(stack.redis_url)
    raw.set(key, raw.get(other_key))
    result = chat(stack.addr, [user("Evicted?", image)], max_tokens=8)
    assert (result.summary.images_encoded, result.summary.images_cached) == (1, 0)  # the retry re-encoded it
    assert result.token_ids == oracle.generate("Evicted?", [image], max_new_tokens=8)[0]
    store = EmbeddingStore(stack.redis_url)
    (repaired,) = store.get_many([key])
    store.close()
    assert repaired is not None and repaired.tensor.shape[0] == result.summary.image_tokens


def test_memory_stays_within_caps_while_1000_images_pass(stack):
    images_per_request, num_requests = 10, 100
    start = time.monotonic()
    failures = []

    def worker(first):
        for r in range(first, num_requests, 2):
            images = [make_image(320, 320, seed=10_000 + r * images_per_request + i) for i in range(images_per_request)]
            try:
                result = chat(stack.addr, [user(f"Batch {r}.", *images)], max_tokens=1)
                assert result.summary.images_encoded == images_per_request
            except Exception as error:  # noqa: BLE001 - collected, asserted below
                failures.append(repr(error))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    prefill = stack.metrics(stack.prefill_metrics)
    router = stack.metrics(stack.router_metrics)
    assert prefill["epd_embedding_cache_capacity_bytes"] == LRU_MB << 20
    assert 0 < prefill["epd_embedding_cache_bytes"] <= LRU_MB << 20
    assert prefill["epd_embedding_cache_evictions_total"] > 0
    assert prefill["epd_prefix_cache_capacity_bytes"] == PREFIX_MB << 20
    assert 0 < prefill["epd_prefix_cache_bytes"] <= PREFIX_MB << 20
    assert prefill["epd_prefix_cache_evictions_total"] > 0
    info = redis.Redis.from_url(stack.redis_url).info()
    assert info["maxmemory"] == REDIS_MB << 20 == router["epd_redis_max_memory_bytes"]
    assert info["used_memory"] <= info["maxmemory"]
    assert router["epd_redis_used_memory_bytes"] <= router["epd_redis_max_memory_bytes"]
    assert info["evicted_keys"] > 0 and router["epd_redis_evicted_keys_total"] > 0
    print(f"1000 images in {time.monotonic() - start:.1f}s")
