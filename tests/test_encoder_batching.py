"""Encoder replica batching: queued images share one ViT forward, within a patch budget, FIFO."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import pytest
import torch

from bench.synthetic import make_image
from control.redis_server import EmbeddedRedis
from encode_svc.engine import STOP, EncoderEngine, next_batch
from epd import imaging
from epd.config import EncodeConfig, ServeConfig, StoreConfig
from epd.discovery import RoleContext
from epd.store import EmbeddingStore


@dataclass
class Item:
    name: str
    num_patches: int


def _queue(*items) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    for item in items:
        q.put(item)
    return q


def test_next_batch_takes_waiting_images_in_order_within_the_budget():
    waiting = _queue(Item("b", 300), Item("c", 300), Item("d", 500), Item("e", 10))
    batch, carry = next_batch(Item("a", 300), waiting, max_patches=1000)
    assert [i.name for i in batch] == ["a", "b", "c"]
    assert carry.name == "d"  # did not fit: it leads the next forward, ahead of "e"
    batch, carry = next_batch(carry, waiting, max_patches=1000)
    assert [i.name for i in batch] == ["d", "e"] and carry is None


def test_an_image_over_the_budget_runs_alone_and_nothing_starves():
    waiting = _queue(Item("small", 10), STOP)
    batch, carry = next_batch(Item("huge", 5000), waiting, max_patches=1000)
    assert [i.name for i in batch] == ["huge"]
    assert carry.name == "small"
    batch, carry = next_batch(carry, waiting, max_patches=1000)
    assert [i.name for i in batch] == ["small"] and carry is STOP


@pytest.fixture(scope="module")
def redis_url():
    server = EmbeddedRedis(64)
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def worker(tiny_model_dir, redis_url):
    serve = ServeConfig(model_dir=tiny_model_dir, store=StoreConfig(redis_url=redis_url, ttl_s=60),
                        encode=EncodeConfig(num_threads=1, max_batch_patches=4096))
    w = EncoderEngine(serve, RoleContext(name="encoder-test"))
    yield w
    w.stop()


IMAGES = [make_image(w, h, seed=40 + i) for i, (w, h) in
          enumerate([(448, 448), (200, 640), (96, 96), (640, 360), (300, 300), (128, 512), (448, 448), (64, 200)])]


def test_one_forward_over_several_images_equals_each_alone(worker):
    pixels = [imaging.load_pixels(data, worker.settings) for data in IMAGES]
    together = worker._run_vision([p for p, _ in pixels], [g for _, g in pixels])
    for (pixel_values, grid), batched in zip(pixels, together):
        alone = worker._run_vision([pixel_values], [grid])[0]
        assert batched.shape == alone.shape == (grid[0] * grid[1] * grid[2] // 4, 64)
        torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


def test_concurrent_encodes_are_batched_and_each_stored_correctly(worker, redis_url):
    before_images, before_batches = worker.num_encoded, worker.num_batches
    results = [None] * len(IMAGES)
    start = threading.Barrier(len(IMAGES))

    def call(index):
        start.wait()
        results[index] = worker.encode(f"test:batch:{index}", IMAGES[index], 0)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(IMAGES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.error == "" for r in results)
    assert worker.num_encoded - before_images == len(IMAGES)
    assert worker.num_batches - before_batches < len(IMAGES), "no two images shared a forward"
    store = EmbeddingStore(redis_url)
    try:
        stored = store.get_many([f"test:batch:{i}" for i in range(len(IMAGES))])
    finally:
        store.close()
    for data, result, embedding in zip(IMAGES, results, stored):
        pixel_values, grid = imaging.load_pixels(data, worker.settings)
        assert tuple(embedding.grid_thw) == grid == tuple(result.grid_thw)
        alone = worker._run_vision([pixel_values], [grid])[0]
        torch.testing.assert_close(embedding.tensor, alone, rtol=1e-5, atol=1e-5)
        assert 0 < result.store_write_s <= result.encode_s


def test_an_image_that_fails_to_decode_never_reaches_a_batch(worker):
    """A truncated image passes the header check but fails to decode: it comes back as that
    image's error (bad input, not a failed batch) and takes no part in any forward, while the good
    images sent with it encode."""
    data = make_image(300, 300, seed=41)
    truncated = data[: len(data) // 2]
    before_images = worker.num_encoded
    results = [None] * 4
    start = threading.Barrier(4)

    def call(index, image):
        start.wait()
        results[index] = worker.encode(f"test:bad:{index}", image, 0)

    images = [IMAGES[2], truncated, IMAGES[3], IMAGES[5]]
    threads = [threading.Thread(target=call, args=(i, image)) for i, image in enumerate(images)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "corrupt or truncated" in results[1].error and results[1].num_tokens == 0
    assert [r.error for i, r in enumerate(results) if i != 1] == ["", "", ""]
    assert all(r.num_tokens > 0 for i, r in enumerate(results) if i != 1)
    assert worker.num_encoded - before_images == 3  # only the good images went through the ViT
