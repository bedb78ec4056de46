"""The embedding store against a real embedded redis-server."""

import json
import os
import struct
import time

import pytest
import redis
import torch

from control.redis_server import EmbeddedRedis
from epd.store import (
    MAGIC,
    VERSION,
    Embedding,
    EmbeddingStore,
    StoreUnavailable,
    decode_value,
    encode_value,
    store_key,
)


@pytest.fixture(scope="module")
def server():
    srv = EmbeddedRedis(max_memory_mb=64)
    yield srv
    srv.stop()


@pytest.fixture
def store(server):
    s = EmbeddingStore(server.url, ttl_s=120)
    yield s
    s._redis.flushdb()
    s.close()


def _embedding(dtype, tokens=6, hidden=8, grid=(1, 4, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return Embedding(tensor=torch.randn(tokens, hidden, generator=g).to(dtype), grid_thw=grid)


def test_store_key_format():
    assert store_key("abc123", "deadbeef") == "epd:emb:v1:abc123:deadbeef"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_put_get_round_trip_is_exact(store, dtype):
    emb = _embedding(dtype, tokens=25, hidden=16, grid=(1, 10, 10), seed=1)
    key = store_key("fp", f"img-{dtype}")
    size = store.put(key, emb)
    assert size == len(encode_value(key, emb)) and size > 25 * 16 * emb.tensor.element_size()
    (got,) = store.get_many([key])
    assert got is not None
    assert got.tensor.dtype == dtype
    assert got.tensor.shape == (25, 16)
    assert torch.equal(got.tensor, emb.tensor)
    assert got.grid_thw == (1, 10, 10)
    # bit-exact, not just numerically equal
    assert got.tensor.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).equal(
        emb.tensor.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    )


def test_get_many_missing_key_gives_none_in_place(store):
    a, b = _embedding(torch.float32, seed=2), _embedding(torch.bfloat16, seed=3, grid=(1, 2, 12))
    store.put("k:a", a)
    store.put("k:b", b)
    got = store.get_many(["k:b", "k:missing", "k:a"])
    assert len(got) == 3
    assert torch.equal(got[0].tensor, b.tensor) and got[0].grid_thw == (1, 2, 12)
    assert got[1] is None
    assert torch.equal(got[2].tensor, a.tensor) and got[2].grid_thw == (1, 4, 6)
    assert store.get_many([]) == []


def test_exists_many_in_order(store):
    store.put("e:1", _embedding(torch.float32))
    store.put("e:3", _embedding(torch.float32))
    assert store.exists_many(["e:0", "e:1", "e:2", "e:3", "e:1"]) == [False, True, False, True, True]
    assert store.exists_many([]) == []


def test_delete(store):
    store.put("d:1", _embedding(torch.float32))
    assert store.delete(["d:1", "d:2"]) == 1
    assert store.exists_many(["d:1"]) == [False]
    assert store.delete([]) == 0


def test_ttl_is_set(server):
    s = EmbeddingStore(server.url, ttl_s=77)
    try:
        s.put("t:1", _embedding(torch.float32))
        ttl = redis.Redis.from_url(server.url).ttl("t:1")
        assert 0 < ttl <= 77
    finally:
        s._redis.delete("t:1")
        s.close()


def test_ping(store):
    assert store.ping()


def test_decode_value_rejects_wrong_magic():
    value = bytearray(encode_value("k", _embedding(torch.float32)))
    value[:4] = b"NOPE"
    with pytest.raises(ValueError, match="magic"):
        decode_value("k", bytes(value))


def test_decode_value_rejects_wrong_version():
    value = bytearray(encode_value("k", _embedding(torch.float32)))
    struct.pack_into("<H", value, 4, VERSION + 1)
    with pytest.raises(ValueError, match="version"):
        decode_value("k", bytes(value))


@pytest.mark.parametrize("length", [0, 3, 9])
def test_decode_value_rejects_too_short(length):
    value = encode_value("k", _embedding(torch.float32))[:length]
    with pytest.raises(ValueError, match="shorter than its header"):
        decode_value("k", value)


def test_decode_value_rejects_truncated_tensor_bytes():
    value = encode_value("k", _embedding(torch.float32))
    assert value[:4] == MAGIC
    with pytest.raises(ValueError):
        decode_value("k", value[:-4])


def test_a_value_written_for_another_key_is_refused_and_reads_as_a_miss(store):
    """A value under the wrong key (another model's fingerprint, a forged or misplaced value) or a
    corrupt one is never served: decoding refuses it and the store reads it as a miss."""
    emb = _embedding(torch.float32)
    other_model = store_key("fp-other", "img")
    with pytest.raises(ValueError, match="written for another key"):
        decode_value(store_key("fp", "img"), encode_value(other_model, emb))
    mine = store_key("fp", "img")
    store._redis.set(mine, encode_value(other_model, emb))
    store._redis.set("k:corrupt", b"EPDE" + b"\x00" * 40)
    store.put("k:good", emb)
    got = store.get_many([mine, "k:corrupt", "k:good"])
    assert got[0] is None and got[1] is None and torch.equal(got[2].tensor, emb.tensor)


def _forged(key: str, meta, tail: bytes = b"\x00" * 16) -> bytes:
    """A value with a valid magic and version and whatever header JSON a forger writes."""
    body = json.dumps(meta).encode() if not isinstance(meta, bytes) else meta
    return struct.pack("<4sHI", MAGIC, VERSION, len(body)) + body + tail


FORGED_HEADERS = [
    pytest.param(["k", "float32"], id="not-an-object"),
    pytest.param({"key": "k", "dtype": ["float32"], "shape": [2, 2], "grid_thw": [1, 2, 2]}, id="dtype-a-list"),
    pytest.param({"key": "k", "dtype": "int64", "shape": [2, 1], "grid_thw": [1, 2, 2]}, id="dtype-unsupported"),
    pytest.param({"key": "k", "dtype": "float32", "shape": [None, 4], "grid_thw": [1, 2, 2]}, id="shape-null"),
    pytest.param({"key": "k", "dtype": "float32", "shape": [-2, -2], "grid_thw": [1, 2, 2]}, id="shape-negative"),
    pytest.param({"key": "k", "dtype": "float32", "shape": [2.0, 2], "grid_thw": [1, 2, 2]}, id="shape-float"),
    pytest.param({"key": "k", "dtype": "float32", "shape": [1 << 62, 1 << 62], "grid_thw": [1, 2, 2]},
                 id="shape-huge"),
    pytest.param({"key": "k", "dtype": "float32", "shape": [2, 2], "grid_thw": ["a", 2, 2]}, id="grid-text"),
    pytest.param({"key": "k", "dtype": "float32", "shape": [2, 2], "grid_thw": [1, 2]}, id="grid-short"),
    pytest.param({"key": ["k"], "dtype": "float32", "shape": [2, 2], "grid_thw": [1, 2, 2]}, id="key-a-list"),
    pytest.param(b"[" * 100000 + b"]" * 100000, id="deeply-nested"),
    pytest.param(b"\xff\xfe not json", id="not-utf8"),
]


@pytest.mark.parametrize("meta", FORGED_HEADERS)
def test_a_forged_header_is_a_value_error_and_reads_as_a_miss(store, meta):
    """Whatever a stored value's header claims, decoding refuses it with a ValueError before any
    tensor is built from it, so the store reads it as a miss (the image is encoded again)."""
    value = _forged("k", meta)
    with pytest.raises(ValueError):
        decode_value("k", value)
    store._redis.set("k", value)
    assert store.get_many(["k"]) == [None]


def test_a_header_length_past_the_value_is_refused():
    value = bytearray(encode_value("k", _embedding(torch.float32)))
    struct.pack_into("<I", value, 6, len(value))
    with pytest.raises(ValueError, match="ends inside its"):
        decode_value("k", bytes(value))


def test_an_unreachable_store_fails_fast_and_is_used_again_when_it_returns(tmp_path):
    srv = EmbeddedRedis(max_memory_mb=16, directory=str(tmp_path))
    s = EmbeddingStore(srv.url, ttl_s=60)
    try:
        s.put("k:1", _embedding(torch.float32))
        srv.stop()
        with pytest.raises(StoreUnavailable):
            s.exists_many(["k:1"])
        assert not s.reachable
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            s.get_many(["k:1"])  # the breaker is open: no connection attempt at all
        assert time.monotonic() - started < 0.05
        srv.start()  # the same socket, empty (the store is only a cache)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                assert s.exists_many(["k:1"]) == [False]
                break
            except StoreUnavailable:
                time.sleep(0.1)  # the breaker lets one try through per back-off
        assert s.reachable
        s.put("k:2", _embedding(torch.float32))
        assert s.exists_many(["k:2"]) == [True]
    finally:
        s.close()
        srv.stop()


def test_embedded_server_evicts_under_memory_cap():
    small = EmbeddedRedis(max_memory_mb=16)
    try:
        s = EmbeddingStore(small.url, ttl_s=600)
        one_mb = 1 << 18  # float32 elements
        keys = [f"ev:{i}" for i in range(40)]
        old = keys[:5]
        for i, key in enumerate(keys):
            if i == len(old):
                time.sleep(2.5)  # redis' LRU clock ticks once a second (on its cron): make the first keys clearly older
            s.put(key, Embedding(torch.full((256, one_mb // 256), float(i)), (1, 2, 2)))  # never raises (OOM)
        present = s.exists_many(keys)
        assert not any(present[: len(old)]), present  # the oldest are gone
        assert present[-1]  # the newest survived
        assert sum(present) < 17  # ~40 MB does not fit in 16 MB
        info = redis.Redis.from_url(small.url).info()
        assert info["evicted_keys"] >= 40 - 16
        assert info["used_memory"] <= 16 * 1024 * 1024
        (last,) = s.get_many([keys[-1]])
        assert torch.equal(last.tensor, torch.full((256, one_mb // 256), 39.0))
        s.close()
    finally:
        small.stop()


def test_stop_leaves_no_process():
    srv = EmbeddedRedis(max_memory_mb=8)
    pid = srv.pid
    os.kill(pid, 0)  # alive
    assert redis.Redis.from_url(srv.url).ping()
    srv.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not os.path.exists(srv.socket)
    srv.stop()  # idempotent
