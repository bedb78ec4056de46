"""The embedding store against a real embedded redis-server."""

import os
import struct
import time

import pytest
import redis
import torch

from control.redis_server import EmbeddedRedis
from epd.store import MAGIC, VERSION, Embedding, EmbeddingStore, decode_value, encode_value, store_key


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
    assert size == len(encode_value(emb)) and size > 25 * 16 * emb.tensor.element_size()
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
    value = bytearray(encode_value(_embedding(torch.float32)))
    value[:4] = b"NOPE"
    with pytest.raises(ValueError, match="magic"):
        decode_value(bytes(value))


def test_decode_value_rejects_wrong_version():
    value = bytearray(encode_value(_embedding(torch.float32)))
    struct.pack_into("<H", value, 4, VERSION + 1)
    with pytest.raises(ValueError, match="version"):
        decode_value(bytes(value))


@pytest.mark.parametrize("length", [0, 3, 9])
def test_decode_value_rejects_too_short(length):
    value = encode_value(_embedding(torch.float32))[:length]
    with pytest.raises(ValueError, match="shorter than its header"):
        decode_value(value)


def test_decode_value_rejects_truncated_tensor_bytes():
    value = encode_value(_embedding(torch.float32))
    assert value[:4] == MAGIC
    with pytest.raises(ValueError):
        decode_value(value[:-4])


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
            s.put(key, Embedding(torch.full((one_mb,), float(i)), (1, 2, 2)))  # never raises (OOM)
        present = s.exists_many(keys)
        assert not any(present[: len(old)]), present  # the oldest are gone
        assert present[-1]  # the newest survived
        assert sum(present) < 17  # ~40 MB does not fit in 16 MB
        info = redis.Redis.from_url(small.url).info()
        assert info["evicted_keys"] >= 40 - 16
        assert info["used_memory"] <= 16 * 1024 * 1024
        (last,) = s.get_many([keys[-1]])
        assert torch.equal(last.tensor, torch.full((one_mb,), 39.0))
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
