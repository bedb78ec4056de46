"""Prefix- and load-aware routing, without a stack: the router's prefix keys are the cache's, a
replica's summary says what its cache would serve, the balance rule holds under load, decode
workers are chosen by free K/V and queue, and load reports reach the registry."""

from __future__ import annotations

import random

import pytest
import torch

from epd import prefix, routing
from epd.discovery import Balancer, Endpoint, Load, Registry
from epd.lm import HybridState
from epd.v1 import epd_pb2
from prefill_svc.caches import PrefixCache

IMAGE = 9  # the image placeholder token id in these prompts
BLOCK = 4


def _state(num_tokens: int) -> HybridState:
    state = HybridState.empty(2)
    state.num_tokens = num_tokens
    state.conv[0] = torch.zeros(1, 8, 4)
    state.recurrent[0] = torch.zeros(1, 2, 4, 4)
    state.keys[1] = torch.zeros(1, 2, num_tokens, 8)
    state.values[1] = torch.zeros(1, 2, num_tokens, 8)
    return state


def _hashes(token_ids, store_keys, grids, num_generated=0, block_size=BLOCK):
    refs = [epd_pb2.ImageRef(store_key=key, merged_height=h, merged_width=w) for key, (h, w) in zip(store_keys, grids)]
    return prefix.request_block_hashes(token_ids, num_generated, refs, IMAGE, None, block_size, "model")[1]


def test_what_the_summary_promises_is_what_the_cache_serves():
    # A prompt with one 2x2 image (4 placeholders) at index 3: turn 1, then turn 2 extends it.
    turn1 = [1, 2, 3, IMAGE, IMAGE, IMAGE, IMAGE, 5, 6, 7, 8, 10]
    turn2 = turn1 + [11, 12, 13, 14, 15, 16]
    cache = PrefixCache(capacity_bytes=1 << 20, block_size=BLOCK, every_blocks=1)
    hashes1 = _hashes(turn1, ["img-a"], [(2, 2)])
    for blocks in (2, 3):
        assert cache.insert(hashes1[:blocks], _state(blocks * BLOCK))
    held = prefix.decode_summary(cache.summary())
    for token_ids, keys in ((turn2, ["img-a"]), (turn2, ["img-b"]), (turn1, ["img-a"])):
        hashes = _hashes(token_ids, keys, [(2, 2)])
        expected = prefix.cached_tokens(hashes, len(token_ids), BLOCK, held)
        assert expected == cache.lookup(hashes, len(token_ids))[0]
    assert prefix.cached_tokens(_hashes(turn2, ["img-a"], [(2, 2)]), len(turn2), BLOCK, held) == 12
    assert prefix.cached_tokens(_hashes(turn2, ["img-b"], [(2, 2)]), len(turn2), BLOCK, held) == 0  # other image
    assert prefix.cached_tokens(_hashes(turn1, ["img-a"], [(2, 2)]), len(turn1), BLOCK, held) == 8  # one left to run
    # A resume replays answer tokens as text, image id or not: the keys are prefill's.
    resumed = turn1 + [IMAGE, 3]
    assert _hashes(resumed, ["img-a"], [(2, 2)], num_generated=2)[:3] == hashes1[:3]


def test_a_summary_is_compact_and_bounded():
    keys = [bytes([i % 256, i // 256]) * 16 for i in range(prefix.MAX_SUMMARY_KEYS + 10)]
    blob = prefix.encode_summary(keys)
    assert len(blob) == prefix.MAX_SUMMARY_KEYS * prefix.SUMMARY_KEY_BYTES
    assert prefix.summary_key(keys[0]) in prefix.decode_summary(blob)
    with pytest.raises(ValueError, match="whole 8-byte keys"):
        prefix.decode_summary(b"123")


def _balancer(num_replicas: int, held: dict[str, list[bytes]] | None = None) -> Balancer:
    balancer = Balancer("prefill")
    held = held or {}
    balancer.update([Endpoint(name=f"prefill-{i}", role="prefill", address=f"h:{i}", incarnation="x",
                              load=Load(prefix_summary=prefix.encode_summary(held.get(f"prefill-{i}", [])),
                                        prefix_block_size=BLOCK))
                     for i in range(num_replicas)])
    return balancer


def _route(policy, hashes, num_tokens):
    return routing.PrefillRoute(policy, num_tokens, lambda block_size: hashes)


def test_epd_goes_where_the_prefix_is_while_that_replica_is_not_loaded():
    hashes = [bytes([b]) * 32 for b in range(100)]  # a 400-token prompt, 399 of it held by prefill-2
    balancer = _balancer(4, {"prefill-2": hashes[:99]})
    route = _route(routing.ExpectedTTFT(), hashes, 400)
    name, _ = balancer.pick(route=route)
    assert name == "prefill-2" and route.chosen.cached_tokens == 396 and route.chosen.work_tokens == 4
    least = _route(routing.LeastLoad(), hashes, 400)
    assert balancer.pick(route=least)[0] != "prefill-2"  # blind to the cache: the least busy


def test_a_prepared_route_hashes_each_block_size_once_before_the_pick():
    """``prepare`` (run by the router in a worker thread for a long prompt) computes the keys of
    every block size the replicas report; the pick then hashes nothing more."""
    hashes = [bytes([b]) * 32 for b in range(100)]
    asked = []

    def hashes_for(block_size):
        asked.append(block_size)
        return hashes

    balancer = _balancer(4, {"prefill-1": hashes[:50]})
    route = routing.PrefillRoute(routing.ExpectedTTFT(), 400, hashes_for)
    assert balancer.block_sizes() == {BLOCK}
    route.prepare(balancer.block_sizes() | {0})  # 0: a replica that reports no cache
    assert asked == [BLOCK]
    name, _ = balancer.pick(route=route)
    assert name == "prefill-1" and route.chosen.cached_tokens == 50 * BLOCK and asked == [BLOCK]


def test_affinity_never_piles_work_onto_one_replica():
    """Every request wants the same hot prefix, held by one replica, and none completes: epd's
    queued work on any replica stays within 1.5x the mean plus the slack; affinity alone piles."""
    rng = random.Random(0)
    hot = [bytes([b]) * 32 for b in range(64)]  # 256 tokens every request starts with
    for policy, piles in ((routing.ExpectedTTFT(), False), (routing.AffinityOnly(), True)):
        balancer = _balancer(4, {"prefill-0": hot})
        picks = {f"prefill-{i}": 0 for i in range(4)}
        for _ in range(200):
            tail = [rng.randbytes(32) for _ in range(rng.randint(4, 64))]
            hashes = hot + tail
            route = _route(policy, hashes, len(hashes) * BLOCK)
            queued = [r.queued_tokens for r in balancer.replicas()]
            mean = sum(queued) / len(queued)
            name, _ = balancer.pick(route=route)
            picks[name] += 1
            if not piles:
                assert route.chosen.replica.queued_tokens <= (
                    max(routing.BALANCE_FACTOR * mean + routing.BALANCE_SLACK_TOKENS, min(queued)))
        queued = {r.name: r.queued_tokens for r in balancer.replicas()}
        mean = sum(queued.values()) / len(queued)
        if piles:
            assert queued["prefill-0"] == sum(queued.values())  # all of it on one replica
        else:
            assert max(queued.values()) <= routing.BALANCE_FACTOR * mean + 2 * routing.BALANCE_SLACK_TOKENS
            assert picks["prefill-0"] == max(picks.values())  # it still took the most requests: it holds them


def test_a_routed_call_counts_its_work_until_it_ends():
    balancer = _balancer(2)
    route = _route(routing.ExpectedTTFT(), [b"a" * 32] * 10, 40)
    name, _ = balancer.pick(route=route)
    assert {r.name: r.sent_tokens for r in balancer.replicas()}[name] == 40
    balancer.release(name, True, route.chosen.work_tokens)
    assert all(r.sent_tokens == 0 for r in balancer.replicas())


def test_round_robin_takes_each_in_turn():
    balancer = _balancer(3)
    policy = routing.RoundRobin()
    names = []
    for _ in range(6):
        name, _ = balancer.pick(route=_route(policy, [], 8))
        names.append(name)
    assert names == ["prefill-0", "prefill-1", "prefill-2"] * 2


def test_decode_workers_are_chosen_by_free_kv_and_queue():
    balancer = Balancer("decode")
    loads = {"decode-0": Load(free_kv_tokens=100, num_waiting=0),  # too small for the handoff
             "decode-1": Load(free_kv_tokens=5000, num_waiting=3),
             "decode-2": Load(free_kv_tokens=4000, num_waiting=1)}
    balancer.update([Endpoint(name=n, role="decode", address=n, incarnation="x", load=load)
                     for n, load in loads.items()])
    assert balancer.pick(route=routing.DecodeRoute(1000))[0] == "decode-2"
    assert balancer.pick(route=routing.DecodeRoute(10_000))[0] == "decode-0"  # none fits: fewest waiting


def test_a_load_report_updates_the_registry_and_keeps_health_and_drain():
    registry = Registry()
    endpoint = Endpoint(name="prefill-1", role="prefill", address="h:1", incarnation="x")
    version = registry.register(endpoint)
    registry.drain("prefill-1")
    assert registry.register(endpoint) == registry.snapshot().version  # a plain heartbeat changes nothing
    reported = registry.register(Endpoint(name="prefill-1", role="prefill", address="h:1", incarnation="x",
                                          load=Load(queued_tokens=7)))
    assert reported > version
    (listed,) = registry.snapshot(role="prefill").endpoints
    assert listed.load.queued_tokens == 7 and listed.draining
    assert registry.snapshot(role="decode").endpoints == []


def test_the_holders_index_finds_what_each_replica_summary_says():
    rng = random.Random(1)
    blocks = [rng.randbytes(32) for _ in range(40)]
    held = {f"prefill-{i}": blocks[:rng.randint(0, 40)] for i in range(12)}
    balancer = _balancer(12, held)
    balancer.update([Endpoint(name=n, role="prefill", address=n, incarnation="x",  # one changes what it holds
                              load=Load(prefix_summary=prefix.encode_summary(held[n][:3] if n == "prefill-5" else held[n]),
                                        prefix_block_size=BLOCK)) for n in held])
    route = _route(routing.AffinityOnly(), blocks, len(blocks) * BLOCK)
    replicas = balancer.replicas()
    assert route.cached_by_replica(replicas, balancer._holders) == {
        r.name: route.cached_tokens(r) for r in replicas if route.cached_tokens(r)}


def test_a_reply_says_what_its_replica_stored_before_the_next_report():
    """A conversation's next turn often comes before the replica's next report reaches the router:
    the snapshots named in the prefill reply route it to that replica at once; the replica's next
    changed report then replaces them (it says what it still holds)."""
    hashes = [bytes([b]) * 32 for b in range(20)]
    balancer = _balancer(3)
    route = _route(routing.ExpectedTTFT(), hashes, 80)
    first, _ = balancer.pick(route=route)
    balancer.note_stored("h:9", prefix.summary_key(hashes[15]))  # an address nobody has: nothing happens
    balancer.note_stored(f"h:{first[-1]}", prefix.summary_key(hashes[15]))  # the reply: 64 tokens stored
    balancer.release(first, True, route.chosen.work_tokens)
    again = _route(routing.ExpectedTTFT(), hashes, 80)
    assert balancer.pick(route=again)[0] == first and again.chosen.cached_tokens == 64
    balancer.release(first, True, again.chosen.work_tokens)
    balancer.update([Endpoint(name=f"prefill-{i}", role="prefill", address=f"h:{i}", incarnation="x",
                              load=Load(prefix_summary=prefix.encode_summary([b"other" * 8]) if f"prefill-{i}" == first
                                        else b"", prefix_block_size=BLOCK)) for i in range(3)])  # it evicted it
    later = _route(routing.ExpectedTTFT(), hashes, 80)
    balancer.pick(route=later)
    assert later.chosen.cached_tokens == 0


def test_the_simulator_replays_a_trace_and_its_replica_follows_the_rate():
    """``bench.simulate`` with a replayed trace (``bench.sim_check``'s way): a conversation's second
    turn goes to the replica holding its first (the reply names the snapshot), is served from it
    up to the generation prompt's block, and each replica's busy time is the rate times the
    tokens it computed."""
    from bench import simulate

    config = simulate.SimConfig(num_replicas=2, block_size=16, snapshot_every_blocks=2, per_token_s=1e-3, fixed_s=0.0,
                                image_grid=(2, 2))
    opening = [1, 2, 3, 4] + [simulate.IMAGE_TOKEN] * 4
    first = opening + list(range(1000, 1056))  # 64 tokens; its generation prompt starts at 52 -> block 48
    second = first[:58] + list(range(2000, 2030))
    trace = [simulate.ReplayTurn(0, 0, 0.0, first, 52), simulate.ReplayTurn(1, 0, 0.0, list(first[:8]) + list(
        range(3000, 3056)), 52), simulate.ReplayTurn(2, 0, 0.1, list(first[:8]) + list(range(4000, 4056)), 52),
        simulate.ReplayTurn(0, 1, 0.2, second, len(second) - 12)]  # before any report reached the router
    result = simulate.simulate(config, "epd", trace)
    turns = {(t.conversation, t.index): t for t in result.turns}
    assert turns[(0, 1)].replica == turns[(0, 0)].replica and turns[(0, 1)].cached == 48
    assert turns[(1, 0)].replica != turns[(0, 0)].replica  # the other one was idle
    computed = sum(len(t.token_ids) - t.cached for t in result.turns)
    assert sum(result.busy_s.values()) == pytest.approx(computed * 1e-3)
