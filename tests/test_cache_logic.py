"""Cache and scheduling bookkeeping, without a model: byte-bounded LRU, prefix keys, snapshot
points, the prefill chunk scheduler, the router's encode single flight, and their config bounds."""

from __future__ import annotations

import asyncio

import pytest

from epd.config import ConfigError, PrefillConfig, RouterConfig
from epd.positions import ImageSpan
from prefill_svc.caches import ByteLRU, KeyedImage, prefix_block_hashes, snapshot_points
from prefill_svc.scheduler import PrefillScheduler, PromptProgress
from router_svc.flights import SingleFlight


def test_lru_evicts_least_recently_used_and_never_exceeds_its_cap():
    lru: ByteLRU[str] = ByteLRU(100)
    assert lru.put("a", "A", 40) and lru.put("b", "B", 40)
    assert lru.get("a") == "A"  # a is now the most recent
    assert lru.put("c", "C", 40)  # evicts b
    assert "b" not in lru and "a" in lru and "c" in lru
    assert not lru.put("huge", "H", 101)  # can never fit: not stored, nothing evicted
    assert lru.put("a", "A2", 60)  # replacing a frees its old size first; c (40) still fits
    stats = lru.stats()
    assert (stats.num_entries, stats.num_bytes, stats.evictions) == (2, 100, 1)
    assert (stats.hits, stats.misses) == (1, 0)
    assert lru.get("b") is None and lru.stats().misses == 1


def _tokens(n, pad_at=(), pad=9):
    return [pad if i in pad_at else i % 7 for i in range(n)]


def test_prefix_hashes_differ_from_the_first_block_an_image_overlaps():
    span = ImageSpan(start=20, merged_height=2, merged_width=4)  # tokens 20..27, in block 1 of 16
    tokens = _tokens(48, pad_at=range(20, 28))
    a = prefix_block_hashes(tokens, [KeyedImage(span, "key-a")], 16, "model")
    b = prefix_block_hashes(tokens, [KeyedImage(span, "key-b")], 16, "model")
    assert len(a) == 3
    assert a[0] == b[0]  # before the image: shared
    assert a[1] != b[1] and a[2] != b[2]  # chained: every block from the image on differs
    assert prefix_block_hashes(tokens, [KeyedImage(span, "key-a")], 16, "model") == a
    assert prefix_block_hashes(tokens, [KeyedImage(span, "key-a")], 16, "other-model")[0] != a[0]
    other_tokens = list(tokens)
    other_tokens[40] += 1
    c = prefix_block_hashes(other_tokens, [KeyedImage(span, "key-a")], 16, "model")
    assert c[:2] == a[:2] and c[2] != a[2]


def test_snapshot_points():
    assert snapshot_points(100, 16, 2) == [32, 64, 96]
    assert snapshot_points(100, 16, 0) == [96]
    assert snapshot_points(100, 16, 0, last_turn_start=95) == [80, 96]
    assert snapshot_points(10, 16, 2, last_turn_start=5) == []


def test_scheduler_runs_the_shortest_remaining_prompt_next_and_stops_at_snapshot_points():
    scheduler = PrefillScheduler(chunk_tokens=64)
    long = PromptProgress(prompt_len=300, stops=[100])
    scheduler.add(long)
    assert scheduler.next_chunk() == (long, 64)
    scheduler.advance(long, 64)
    short = PromptProgress(prompt_len=40, cursor=0)
    scheduler.add(short)
    assert scheduler.next_chunk() == (short, 40)  # arrived later, but has less left
    scheduler.advance(short, 40)
    assert short.done and len(scheduler) == 1
    assert scheduler.next_chunk() == (long, 100)  # the chunk ends at the snapshot point
    scheduler.advance(long, 100)
    ends = []
    while len(scheduler):
        progress, end = scheduler.next_chunk()
        scheduler.advance(progress, end)
        ends.append(end)
    assert ends == [164, 228, 292, 300]
    with pytest.raises(ValueError):
        scheduler.add(PromptProgress(prompt_len=5, cursor=5))


def test_several_prompts_share_a_forward_up_to_the_token_budget():
    scheduler = PrefillScheduler(chunk_tokens=64, batch_tokens=100)
    a, b, c = (PromptProgress(prompt_len=n) for n in (30, 50, 300))
    for progress in (c, a, b):
        scheduler.add(progress, now=0.0)
    # Shortest first: all of a (30), all of b (50), then c's chunk cut to the 20 tokens left.
    assert scheduler.next_batch(now=0.0) == [(a, 30), (b, 50), (c, 20)]
    for progress, end in scheduler.next_batch(now=0.0):
        scheduler.advance(progress, end)
    assert a.done and b.done and scheduler.next_batch(now=0.2) == [(c, 84)]  # one prompt: a chunk of 64


@pytest.mark.parametrize("max_wait_s", [2.0, float("inf")])
def test_a_prompt_waiting_too_long_goes_first(max_wait_s):
    """Short prompts keep arriving, each filling a whole forward: shortest-first alone would
    never run the long one; with aging it runs once it has waited max_wait_s."""
    scheduler = PrefillScheduler(chunk_tokens=30, batch_tokens=30, max_wait_s=max_wait_s)
    long = PromptProgress(prompt_len=10_000)
    scheduler.add(long, now=0.0)
    long_ran_at = []
    for n in range(20):
        now = 0.5 * n
        scheduler.add(PromptProgress(prompt_len=30), now=now)
        for progress, end in scheduler.next_batch(now=now):
            if progress is long:
                long_ran_at.append(now)
            scheduler.advance(progress, end)
    if max_wait_s == float("inf"):
        assert long_ran_at == []  # starved
    else:
        # the first forward after it had waited 2 s, and every forward from then on (the oldest);
        # a short prompt then waits until it has aged too (tested below with room for both)
        assert long_ran_at == [0.5 * n for n in range(4, 20)]


def test_an_aged_prompt_shares_each_forward_with_the_newer_short_ones():
    scheduler = PrefillScheduler(chunk_tokens=30, batch_tokens=60, max_wait_s=2.0)
    long = PromptProgress(prompt_len=10_000)
    scheduler.add(long, now=0.0)
    for n in range(20):
        now = 0.5 * n
        short = PromptProgress(prompt_len=30)
        scheduler.add(short, now=now)
        ran = scheduler.next_batch(now=now)
        assert (short, 30) in ran and (n < 4 or ran[0][0] is long)
        for progress, end in ran:
            scheduler.advance(progress, end)


def test_a_burst_of_long_prompts_finishes_in_arrival_order_when_forwards_outlast_the_aging():
    """Four 1,000-token prompts at once, forwards of two 512-token chunks 3 s apart (longer than
    max_wait_s, as an aggregated step of 2,048 tokens on two cores is): the first two finish in the
    second forward, not the third (aged by when each last ran, the two that had not run went first)."""
    scheduler = PrefillScheduler(chunk_tokens=512, batch_tokens=1024, max_wait_s=2.0)
    prompts = [PromptProgress(prompt_len=1000) for _ in range(4)]
    for progress in prompts:
        scheduler.add(progress, now=0.0)
    finished_in = {}
    for forward in range(1, 5):
        for progress, end in scheduler.next_batch(now=3.0 * (forward - 1)):
            scheduler.advance(progress, end)
            if progress.done:
                finished_in[prompts.index(progress)] = forward
    assert finished_in == {0: 2, 1: 2, 2: 4, 3: 4}


def test_single_flight_runs_one_call_per_key_and_shares_the_outcome():
    async def scenario():
        flights: SingleFlight[str] = SingleFlight()
        led, joined = flights.claim(["a", "b", "a"])
        assert led == ["a", "b"] and joined == {}
        led2, joined2 = flights.claim(["b", "c"])
        assert led2 == ["c"] and set(joined2) == {"b"}
        waiter = asyncio.ensure_future(joined2["b"])
        flights.resolve("b", result="B")
        assert await asyncio.wait_for(waiter, 5) == "B"
        _, joined3 = flights.claim(["a"])
        flights.resolve("a", error=RuntimeError("replica died"))
        with pytest.raises(RuntimeError, match="replica died"):
            await joined3["a"]  # a waiter sees the leader's failure (and then tries itself)
        flights.resolve("c", result="C")
        assert flights.claim(["a"])[0] == ["a"]  # a finished key can be led again
        assert flights.num_joined == 2

    asyncio.run(scenario())


@pytest.mark.parametrize("field,value", [
    ("chunk_tokens", 0), ("embedding_cache_mb", -1), ("prefix_cache_mb", -1), ("prefix_block_size", 0),
    ("snapshot_every_blocks", -1), ("metrics_port", 70000),
])
def test_prefill_config_bounds_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"prefill.{field}"):
        PrefillConfig(**{field: value})


def test_router_metrics_port_bound():
    with pytest.raises(ConfigError, match="router.metrics_port"):
        RouterConfig(metrics_port=-1)


# ---------------------------------------------------------------- prefix snapshots share their blocks


def _state(num_tokens: int, seed: int = 0):
    """A two-layer hybrid state (layer 0 linear, layer 1 full attention) with random values."""
    import torch

    from epd.lm import HybridState

    g = torch.Generator().manual_seed(seed)
    state = HybridState.empty(2)
    state.num_tokens = num_tokens
    state.conv[0] = torch.randn(1, 8, 4, generator=g)
    state.recurrent[0] = torch.randn(1, 2, 4, 4, generator=g)
    state.keys[1] = torch.randn(1, 2, num_tokens, 8, generator=g)
    state.values[1] = torch.randn(1, 2, num_tokens, 8, generator=g)
    return state


BLOCK = 4
KV_BLOCK_BYTES = 2 * 2 * BLOCK * 8 * 4  # K and V, 2 heads, 4 tokens, dim 8, float32
LINEAR_BYTES = (8 * 4 + 2 * 4 * 4) * 4


def test_snapshots_of_one_conversation_share_their_blocks():
    from prefill_svc.caches import PrefixCache

    cache = PrefixCache(capacity_bytes=1 << 20, block_size=BLOCK, every_blocks=0)
    hashes = [bytes([i]) * 32 for i in range(6)]
    long_state = _state(24, seed=1)
    short_state = _state(8, seed=1)  # its K/V is long_state's first two blocks
    short_state.keys[1] = long_state.keys[1][:, :, :8].clone()
    short_state.values[1] = long_state.values[1][:, :, :8].clone()
    assert cache.insert(hashes[:2], short_state)
    assert cache.insert(hashes, long_state)
    assert cache.num_blocks() == 6  # not 2 + 6
    assert cache.stats().num_bytes == 6 * KV_BLOCK_BYTES + 2 * LINEAR_BYTES
    cached, state = cache.lookup(hashes, prompt_len=25)
    assert cached == 24
    assert state.keys[1].equal(long_state.keys[1]) and state.recurrent[0].equal(long_state.recurrent[0])
    state.keys[1].zero_()  # a request's copy: changing it changes nothing held
    state.recurrent[0].zero_()
    _, again = cache.lookup(hashes, prompt_len=25)
    assert again.keys[1].equal(long_state.keys[1]) and again.recurrent[0].equal(long_state.recurrent[0])
    cached, state = cache.lookup(hashes[:3] + [b"x" * 32], prompt_len=17)  # diverges in block 3: the short one
    assert cached == 8 and state.keys[1].equal(long_state.keys[1][:, :, :8])


def test_evicting_a_snapshot_frees_only_blocks_no_other_snapshot_uses():
    from prefill_svc.caches import PrefixCache

    hashes = [bytes([i]) * 32 for i in range(4)]
    # Room for the 4 blocks of the long one and two linear states, not a third.
    cache = PrefixCache(capacity_bytes=4 * KV_BLOCK_BYTES + 2 * LINEAR_BYTES, block_size=BLOCK, every_blocks=0)
    assert cache.insert(hashes[:2], _state(8))
    assert cache.insert(hashes, _state(16))
    other = [bytes([100 + i]) * 32 for i in range(1)]
    assert cache.stats().num_bytes == cache.capacity_bytes  # the long one added only its 2 new blocks
    # The next one needs a block and a linear state: evicting the short snapshot frees its linear
    # state only (the long one still uses its blocks), so the long one goes too.
    assert cache.insert(other, _state(4, seed=2))
    assert cache.stats().evictions == 2 and cache.num_blocks() == 1
    assert cache.stats().num_bytes == KV_BLOCK_BYTES + LINEAR_BYTES
    assert cache.lookup(hashes, prompt_len=17)[0] == 0
    assert cache.lookup(other + [b"y" * 32], prompt_len=5)[0] == 4


def test_a_snapshot_bigger_than_the_cache_is_not_copied_at_all():
    from prefill_svc.caches import PrefixCache

    cache = PrefixCache(capacity_bytes=KV_BLOCK_BYTES, block_size=BLOCK, every_blocks=0)
    hashes = [bytes([i]) * 32 for i in range(3)]
    assert not cache.insert(hashes, _state(12))
    assert cache.stats().num_bytes == 0 and cache.num_blocks() == 0
    with pytest.raises(ValueError, match="not 2 whole blocks"):
        cache.insert(hashes[:2], _state(7))
