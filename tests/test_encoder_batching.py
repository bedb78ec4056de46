"""Encoder replica batching: queued images share one ViT forward, within a patch budget, FIFO."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import pytest
import torch

from encode_svc.worker import STOP, EncoderWorker, next_batch
from epd import imaging
from epd.redis_server import EmbeddedRedis
from epd.store import EmbeddingStore
from epd.synthetic import make_image


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
    w = EncoderWorker(tiny_model_dir, redis_url, ttl_s=60, max_decoded_pixels=64 * 1024 * 1024, num_threads=1,
                      max_batch_patches=4096)
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


def test_bad_image_in_a_burst_fails_alone(worker):
    results = [None, None]

    def call(index, data):
        results[index] = worker.encode(f"test:bad:{index}", data, 0)

    threads = [threading.Thread(target=call, args=(0, b"not an image")),
               threading.Thread(target=call, args=(1, IMAGES[2]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "image" in results[0].error and results[0].num_tokens == 0
    assert results[1].error == "" and results[1].num_tokens > 0
