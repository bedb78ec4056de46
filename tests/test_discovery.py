"""Bookkeeping of discovery, balancing and replica life, without Ray (but for one watch on a real
Ray registry actor): the registry's versions, waiting watches, heartbeats, health marks and drain
acknowledgements; least-busy picking with circuit breakers; the controller's reading of probes
(``control.fleet``); the autoscaling policy's decisions."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
import subprocess
import sys
import time

import pytest

from control.autoscale import AutoscalePolicy
from control.fleet import Fleet, Probe, unplaced
from epd import discovery, errors
from epd.breaker import Breaker
from epd.config import AutoscaleConfig
from epd.discovery import WATCHER_STALE_S, Balancer, Endpoint, Registry


def test_the_control_plane_imports_no_torch():
    """The controller, the registry and every `epd` command import ``epd.discovery`` (and through it
    the router's prefix keys). torch's import takes 3 s idle and 10-20 s on a loaded machine: inside
    `epd status`'s 10 s connect deadline it made the command give up while the autoscaler started
    encoders (tests/test_cluster_scaling.py)."""
    check = ("import sys\nimport control.controller, control.cli, epd.discovery, epd.routing, epd.prefix\n"
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", (out.stdout, out.stderr)


def test_a_registry_entry_is_plain_data_that_unpickles_without_torch():
    """Every process that reads the registry (the registry itself, every watcher, `epd status`)
    unpickles its entries. A Ray actor handle in one made Ray import the actor's class (torch and
    transformers) in the registry, which held every replica's first registration for ~5 s at each
    start; encoder replicas are found by their actor name instead."""
    plain = {"str", "int", "float", "bool", "Load", "tuple[str, ...]"}
    assert {f.name: f.type for f in dataclasses.fields(Endpoint) if f.type not in plain} == {}
    entry = Endpoint(name="encoder-0", role="encoder", node_id="n", incarnation="i", pid=1,
                     load=discovery.Load(queued_tokens=2))
    check = ("import pickle, sys\nentry = pickle.loads(bytes.fromhex(sys.argv[1]))\n"
             "print(entry.name, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", check, pickle.dumps(entry).hex()], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "encoder-0 []", (out.stdout, out.stderr)


def _ep(name, role="decode", incarnation="i1", **kwargs):
    return Endpoint(name=name, role=role, address=f"h:{name}", incarnation=incarnation, **kwargs)


def test_a_poll_acknowledges_and_brings_endpoints_only_when_something_changed():
    registry = Registry()
    registry.register(_ep("decode-1"))
    registry.register(_ep("p-1", role="prefill"))
    first = registry.poll("router-1/decode", "decode", "", -1, {})  # a new watcher: the whole view
    assert [e.name for e in first.endpoints] == ["decode-1"]  # its role's endpoints only
    assert registry.poll("router-1/decode", "decode", first.epoch, first.version, {"decode-1": 2}) is None
    version = registry.drain("decode-1")
    assert not registry.acked("decode", version)
    changed = registry.poll("router-1/decode", "decode", first.epoch, first.version, {})
    assert changed.version == version and changed.endpoints[0].draining
    # the poll carried the old version's acknowledgement; the next one carries the new
    assert not registry.acked("decode", version)
    assert registry.poll("router-1/decode", "decode", changed.epoch, version, {"decode-1": 1}) is None
    assert registry.acked("decode", version) and not registry.acked("decode", version, "decode-1")
    assert registry.poll("router-1/decode", "decode", changed.epoch, version, {}) is None
    assert registry.acked("decode", version, "decode-1")
    # a watcher that knew an older registry (Ray restarted it) gets the full view again
    assert registry.poll("router-1/decode", "decode", "an-old-epoch", 7, {}).epoch == registry.epoch


def test_a_watch_waits_at_the_registry_until_something_changes():
    """A watcher's call returns at once when its role's endpoints changed since what it saw, else
    waits there for their next change (and returns it), or returns nothing when the wait ends
    without one."""
    registry = Registry()
    registry.register(_ep("decode-1"))
    first = registry.poll("router-1/decode", "decode", "", -1, {})

    async def scenario():
        # a change already there: no wait
        registry.register(_ep("decode-2"))
        started = time.monotonic()
        view = await registry.watch("router-1/decode", "decode", first.epoch, first.version, {}, 30.0)
        assert time.monotonic() - started < 1 and [e.name for e in view.endpoints] == ["decode-1", "decode-2"]
        # nothing changed: the call waits, and the change made meanwhile comes back with it
        waiting = asyncio.ensure_future(registry.watch("router-1/decode", "decode", view.epoch, view.version,
                                                       {"decode-1": 1}, 30.0))
        await asyncio.sleep(0.2)
        assert not waiting.done() and registry._watchers["router-1/decode"].outstanding == {"decode-1": 1}
        version = registry.drain("decode-2")
        changed = await asyncio.wait_for(waiting, 5)
        assert changed.version == version and [e.draining for e in changed.endpoints] == [False, True]
        # nothing changes within the wait: nothing comes back, after the wait
        started = time.monotonic()
        assert await registry.watch("router-1/decode", "decode", changed.epoch, version, {}, 0.3) is None
        assert time.monotonic() - started >= 0.3
        # ... and it counts as heard from at the end of its wait, not at its start
        assert time.monotonic() - registry._watchers["router-1/decode"].seen_at < 0.1
        # another role's changes (a prefill replica joining, its load reports) wake nobody watching
        # decode, and that watcher, which has decode's latest, counts as having applied them
        waiting = asyncio.ensure_future(registry.watch("router-1/decode", "decode", changed.epoch, version, {}, 0.5))
        await asyncio.sleep(0.1)
        registry.register(_ep("p-1", role="prefill"))
        other = registry.register(_ep("p-1", role="prefill", load=discovery.Load(queued_tokens=7)))
        assert await waiting is None and not registry.acked("decode", other)
        assert registry.poll("router-1/decode", "decode", changed.epoch, version, {}) is None
        assert registry.acked("decode", other)
        # ... but an aggregated replica (prefill that decodes too) changes both roles
        aggregated = registry.register(_ep("p-2", role="prefill", also_roles=("decode",)))
        assert [e.name for e in registry.poll("router-1/decode", "decode", changed.epoch, version, {}).endpoints] == \
            ["decode-1", "decode-2", "p-2"]
        version = aggregated
        # a watcher forgotten while it waits (its consumer closed) is not recorded again
        waiting = asyncio.ensure_future(registry.watch("router-1/decode", "decode", changed.epoch, version, {}, 30.0))
        await asyncio.sleep(0.1)
        registry.forget_watcher("router-1/decode")
        registry.register(_ep("decode-3"))
        assert await asyncio.wait_for(waiting, 5) is None and "router-1/decode" not in registry._watchers

    asyncio.run(scenario())


_WATCH_ON_RAY = """
import json, sys, threading, time
from control.cli import _ray_env
_ray_env("127.0.0.1:0")
import ray
from epd import discovery
ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", namespace="watch")
registry = ray.remote(discovery.Registry).remote()
ray.get(registry.register.remote(discovery.Endpoint(name="decode-1", role="decode", address="h:1", incarnation="a")))
seen, changed = [], threading.Event()
def on_change(endpoints):
    seen.append(sorted(e.name for e in endpoints))
    if len(seen) > 1:
        changed.set()
watch = discovery.RegistryWatch(registry, "decode", "router-1", on_change, poll_s=0.05, long_poll_s=60.0)
time.sleep(1.0)  # the watch thread is waiting at the registry by now
ray.get(registry.register.remote(discovery.Endpoint(name="decode-2", role="decode", address="h:2", incarnation="b")))
started = time.monotonic()
out = {"changed": changed.wait(20), "after_s": time.monotonic() - started, "seen": seen}
watch.close()
ray.shutdown()
print(json.dumps(out))
"""


def test_a_watch_on_a_ray_registry_hears_a_change_while_it_waits():
    """The registry runs as a Ray actor with waiting calls in it (an asyncio actor): a watcher
    waiting there gets a replica that joined at once, not at the end of its wait, and the
    registry still takes every other call meanwhile (the registration that wakes it)."""
    out = subprocess.run([sys.executable, "-c", _WATCH_ON_RAY], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["changed"] and result["after_s"] < 10, result
    assert result["seen"] == [["decode-1"], ["decode-1", "decode-2"]], result


def test_registry_drain_waits_for_every_watcher_and_its_calls_in_flight():
    registry = Registry()
    registry.register(_ep("decode-1"))
    registry.register(_ep("decode-2"))
    registry.snapshot("prefill-1/decode", "decode")  # two prefill replicas watch decode
    registry.snapshot("prefill-2/decode", "decode")
    registry.snapshot("router-1/prefill", "prefill")  # a watcher of another role does not count
    version = registry.drain("decode-2")
    assert not registry.acked("decode", version)  # nobody has applied it yet
    registry.ack("prefill-1/decode", "decode", registry.epoch, version, {})
    assert not registry.acked("decode", version)
    # prefill-2 applied it, but a handoff it had picked decode-2 for is still on its way there
    registry.ack("prefill-2/decode", "decode", registry.epoch, version, {"decode-2": 1})
    assert registry.acked("decode", version) and not registry.acked("decode", version, "decode-2")
    registry.ack("prefill-2/decode", "decode", registry.epoch, version, {})
    assert registry.acked("decode", version, "decode-2")
    endpoints = registry.snapshot().endpoints
    assert {e.name: e.draining for e in endpoints} == {"decode-1": False, "decode-2": True}


def test_a_watcher_that_died_without_acknowledging_stops_blocking_drains(monkeypatch):
    registry = Registry()
    registry.register(_ep("decode-1"))
    registry.snapshot("prefill-9/decode", "decode")  # its process dies before it ever acks
    version = registry.drain("decode-1")
    assert not registry.acked("decode", version)
    later = time.monotonic() + WATCHER_STALE_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert registry.acked("decode", version)
    registry.remove("prefill-9")
    assert registry.acked("decode", registry.drain("decode-1"))


def test_an_ack_from_before_a_registry_restart_counts_for_nothing():
    registry = Registry()
    registry.snapshot("prefill-1/decode", "decode")
    registry.register(_ep("decode-1"))
    version = registry.drain("decode-1")
    registry.ack("prefill-1/decode", "decode", "an older epoch", version, {})
    assert not registry.acked("decode", version)


def test_heartbeats_restarts_health_and_removal():
    registry = Registry()
    v1 = registry.register(_ep("decode-1"))
    assert registry.register(_ep("decode-1")) == v1  # a heartbeat that changes nothing is not a change
    registry.mark("decode-1", healthy=False)
    registry.drain("decode-1")
    registry.register(Endpoint(name="decode-1", role="decode", address="h:new", incarnation="i2"))
    (endpoint,) = registry.snapshot().endpoints
    # Ray restarted it: the new address, healthy again, but still draining (it is being removed).
    assert (endpoint.address, endpoint.healthy, endpoint.draining) == ("h:new", True, True)
    registry.remove("decode-1")
    registry.register(_ep("decode-1"))  # a late heartbeat from the removed replica
    assert registry.snapshot().endpoints == []


def test_a_verdict_on_a_process_since_restarted_leaves_its_successor_in_rotation():
    """The controller probed the old process (dead) while Ray restarted it: its verdict, landing
    after the new process registered, must not take the new one out of rotation."""
    registry = Registry()
    registry.register(Endpoint(name="decode-1", role="decode", address="h:old", incarnation="i1"))
    registry.register(Endpoint(name="decode-1", role="decode", address="h:new", incarnation="i2"))
    registry.mark("decode-1", healthy=False, incarnation="i1")
    assert registry.snapshot().endpoints[0].healthy
    registry.mark("decode-1", healthy=False, incarnation="i2")
    assert not registry.snapshot().endpoints[0].healthy


def test_a_replica_with_nothing_behind_it_stays_picked_but_not_counted_until_it_answers(monkeypatch):
    """An Encode service whose only encoder replica just died answers UNAVAILABLE from downstream:
    it keeps its place in rotation (it is not at fault) but health must not count it for a while;
    an answer from it, or the time limit, counts it again."""
    now = [100.0]
    monkeypatch.setattr(discovery.time, "monotonic", lambda: now[0])
    balancer = Balancer("encode")
    balancer.update([_ep("encode-1", "encode")])
    balancer.stranded("encode-1")
    assert balancer.num_available() == 0
    assert balancer.pick()[0] == "encode-1"
    balancer.release("encode-1", ok=True)
    assert balancer.num_available() == 1
    balancer.stranded("encode-1")
    now[0] += discovery.STRANDED_S
    assert balancer.num_available() == 1


def test_a_restarted_registry_does_not_take_known_replicas_out_of_rotation_while_it_refills():
    """After a registry restart its view lists only the replicas whose heartbeat has landed: a
    watcher keeps the others (seen under load: a router lost both Encoder services for a moment,
    a request failed) until they are back, or until the grace has passed."""
    known = [_ep("encode-1", "encode"), _ep("encode-2", "encode")]
    back = [_ep("encode-2", "encode", incarnation="i2")]
    kept = discovery.refill(known, back, warming=False, since_s=4.0)
    assert [(e.name, e.incarnation) for e in kept] == [("encode-2", "i2"), ("encode-1", "i1")]
    assert discovery.refill(known, back, warming=True, since_s=discovery.REFILL_GRACE_S) is not None
    assert discovery.refill(known, back, warming=False, since_s=discovery.REFILL_GRACE_S) is None  # gone
    assert discovery.refill(known, known + [_ep("encode-3", "encode")], warming=True, since_s=0) is None


def test_balancer_spreads_calls_and_skips_draining_and_unhealthy_replicas():
    balancer = Balancer("prefill")
    balancer.update([_ep(n, "prefill") for n in ("a", "b", "c")])
    picked = [balancer.pick()[0] for _ in range(3)]
    assert sorted(picked) == ["a", "b", "c"]  # three calls in flight land on three replicas
    balancer.update([_ep("a", "prefill"), _ep("b", "prefill", draining=True), _ep("c", "prefill", healthy=False)])
    assert {balancer.pick()[0] for _ in range(4)} == {"a"}
    assert balancer.outstanding()["b"] == 1  # its call in flight is still counted until it ends
    balancer.update([])
    with pytest.raises(errors.Unavailable, match="no healthy prefill replica"):
        balancer.pick()


def test_a_follow_up_call_to_a_reserved_replica_counts_in_flight_and_feeds_its_breaker():
    """prefill's Handoff after a Reserve goes to the reserved decode replica by address: a drain
    of it must wait for that call, and its failure must take the replica out of rotation."""
    balancer = Balancer("decode")
    balancer.update([_ep("a"), _ep("b")])
    assert balancer.hold("h:a") == "a" and balancer.outstanding()["a"] == 1
    balancer.update([_ep("a", draining=True), _ep("b")])  # drained while the handoff is on its way
    assert balancer.hold("h:a") == "a" and balancer.outstanding()["a"] == 2  # still counted
    balancer.release("a", ok=True)
    balancer.release("a", ok=False)
    assert "a" not in balancer.outstanding() and balancer.suspect("a")
    balancer.update([_ep("b")])
    assert balancer.hold("h:a") is None  # no longer listed: nothing to count


def test_a_failed_replica_leaves_rotation_then_one_trial_brings_it_back(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    balancer = Balancer("decode")
    balancer.update([_ep("a"), _ep("b")])
    name, _ = balancer.pick(exclude={"b"})
    balancer.release(name, ok=False)  # "a" died under a call
    assert [balancer.pick()[0] for _ in range(3)] == ["b", "b", "b"]  # never the failing one
    assert balancer.num_available() == 1
    with pytest.raises(errors.Unavailable, match="every decode replica failed this request"):
        balancer.pick(exclude={"b"})
    now[0] += 0.6  # past the back-off: one trial call may go to "a"
    trial, _ = balancer.pick(exclude={"b"})
    assert trial == "a" and balancer.num_available() == 1  # only that one trial
    balancer.release("a", ok=True)
    assert balancer.num_available() == 2


def test_client_errors_do_not_open_a_breaker():
    breaker = Breaker(base_s=1.0)
    breaker.begin()
    breaker.end(None, now=0.0)  # a bad request, or a failure behind the replica: neutral
    assert breaker.closed and breaker.allows(0.0)
    for failures, back_off in ((1, 1.0), (2, 2.0), (3, 4.0)):
        breaker.begin()
        breaker.end(False, now=0.0)
        assert breaker.failures == failures and breaker.retry_at == back_off
    assert not breaker.allows(3.9) and breaker.allows(4.0)


def test_a_restarted_replica_gets_a_clean_breaker():
    balancer = Balancer("decode")
    balancer.update([_ep("a")])
    balancer.pick()
    balancer.release("a", ok=False)
    assert balancer.num_available() == 0
    balancer.update([_ep("a", incarnation="i2")])
    assert balancer.num_available() == 1
    # The dead incarnation leaves the listing before the restarted one registers (a restart
    # slower than the registry's health check): the breaker it opened is dropped all the same.
    balancer.pick()
    balancer.release("a", ok=False)
    balancer.update([])
    balancer.update([_ep("a", incarnation="i3")])
    assert balancer.num_available() == 1
    # Unhealthy but still listed, then back as the same incarnation: the breaker stands.
    balancer.pick()
    balancer.release("a", ok=False)
    balancer.update([_ep("a", incarnation="i3", healthy=False)])
    balancer.update([_ep("a", incarnation="i3")])
    assert balancer.num_available() == 0


def test_a_call_whose_only_replica_died_waits_for_its_restart_until_told_to_give_up():
    """``Balancer.pick_or_wait``, which both the router's calls (``Targets.call``) and the Encoder
    service's images use: the incarnation that failed is passed over, a restarted one (new
    incarnation) is picked as soon as the registry lists it, and with none in time it raises."""
    import asyncio

    balancer = Balancer("decode")
    balancer.update([_ep("decode-1", incarnation="i1")])
    tried = {"decode-1": "i1"}  # it failed this call

    async def restarted_later():
        await asyncio.sleep(0.3)
        balancer.update([_ep("decode-1", incarnation="i2")])

    async def wait_for_it():
        started = time.monotonic()
        restart = asyncio.ensure_future(restarted_later())
        name, endpoint = await balancer.pick_or_wait(tried, time.monotonic() + 5)
        await restart
        return name, endpoint.incarnation, time.monotonic() - started

    name, incarnation, took = asyncio.run(wait_for_it())
    assert (name, incarnation) == ("decode-1", "i2") and 0.25 < took < 2, took
    balancer.release(name, True)

    tried = {"decode-1": "i2"}
    started = time.monotonic()
    with pytest.raises(errors.Unavailable):
        asyncio.run(balancer.pick_or_wait(tried, time.monotonic() + 0.4))
    assert 0.35 < time.monotonic() - started < 2
    started = time.monotonic()
    with pytest.raises(errors.Unavailable):  # told not to wait: at once
        asyncio.run(balancer.pick_or_wait(tried, time.monotonic() + 5, wait=False))
    assert time.monotonic() - started < 0.1


def test_fleet_reads_probes_into_life_events():
    fleet = Fleet()
    fleet.add("decode-1", "decode", now=0.0)
    assert fleet.observe("decode-1", Probe.UNREACHABLE, "", now=1.0) == []  # still loading
    (joined,) = fleet.observe("decode-1", Probe.SERVING, "i1", now=5.0)
    assert (joined.kind, joined.seconds) == ("joined", 5.0) and fleet.healthy_count("decode") == 1
    (down,) = fleet.observe("decode-1", Probe.UNREACHABLE, "i1", now=10.0)
    assert down.kind == "unhealthy" and fleet.healthy_count("decode") == 0
    (restarted,) = fleet.observe("decode-1", Probe.SERVING, "i2", now=14.0)  # Ray restarted it: a new process
    assert (restarted.kind, restarted.seconds) == ("restarted", 4.0) and fleet.healthy_count("decode") == 1
    fleet.observe("decode-1", Probe.UNREACHABLE, "i2", now=15.0)
    (recovered,) = fleet.observe("decode-1", Probe.SERVING, "i2", now=16.5)  # the same process answers again
    assert (recovered.kind, recovered.seconds) == ("recovered", 1.5)
    (died,) = fleet.observe("decode-1", Probe.DEAD, "i2", now=20.0)
    assert died.kind == "died" and fleet.count("decode", "died") == 1
    fleet.remove("decode-1", now=20.0)
    fleet.add("decode-2", "decode", now=20.0, replaces="decode-1", replaces_dead_at=20.0)
    (replaced,) = fleet.observe("decode-2", Probe.SERVING, "j1", now=26.5)
    assert (replaced.kind, replaced.seconds, replaced.detail) == ("replaced", 6.5, "replaces decode-1")
    (busy,) = fleet.observe("decode-2", Probe.NOT_SERVING, "j1", now=30.0)
    assert busy.kind == "unhealthy" and busy.detail == "not_serving"


def test_autoscale_up_at_once_down_after_cooldown_within_bounds():
    config = AutoscaleConfig(enabled=True, min_replicas=1, max_replicas=3, target_queue_per_replica=2, cooldown_s=10)
    policy = AutoscalePolicy(config, now=0.0)
    assert policy.decide(current=1, queued=2, now=1.0).direction == "hold"
    up = policy.decide(current=1, queued=50, now=2.0)
    assert (up.direction, up.target) == ("up", 3)  # clamped to max
    assert "50 images in flight" in up.reason
    assert policy.decide(current=3, queued=0, now=5.0).direction == "hold"  # cooling down
    assert policy.decide(current=3, queued=6, now=8.0).direction == "hold"  # busy again: restart the clock
    assert policy.decide(current=3, queued=0, now=17.0).direction == "hold"
    down = policy.decide(current=3, queued=0, now=18.5)
    assert (down.direction, down.target) == ("down", 1)  # clamped to min
    assert "cool-down 10s" in down.reason


def test_unplaced_replicas_are_put_down_to_their_roles_with_why():
    shapes = {"encoder": {"epd_encoder": 1.0}, "encode": {"epd_encoder": 0.01}, "prefill": {"epd_lm": 1.0},
              "decode": {"epd_lm": 1.0}, "router": {"epd_router": 1.0}}
    east = {"CPU": 1.0, "epd_encoder": 3.0, "epd_lm": 4.0}
    head = {"CPU": 1.0, "epd_router": 2.0}
    # The surviving worker offers encoders but has them all in use: one of two encoders waits.
    (entry,) = unplaced([({"epd_encoder": 1.0}, 1)], shapes, {"encoder": ["encoder-0", "encoder-2"]}, [head, east])
    assert (entry["roles"], entry["count"], entry["replicas"]) == (["encoder"], 1, ["encoder-0", "encoder-2"])
    assert "1 alive node(s) offering {epd_encoder: 1} have it all in use" in entry["reason"]
    # Only the lost machine offered GPUs: no alive node does.
    gpu = dict(shapes, decode={"epd_lm": 1.0, "GPU": 0.5})
    (entry,) = unplaced([({"GPU": 0.5, "epd_lm": 1.0}, 2)], gpu, {"decode": ["decode-8"]}, [head, east])
    assert (entry["roles"], entry["count"]) == (["decode"], 1)  # capped at the replicas waiting
    assert entry["reason"].startswith("no alive node offers {GPU: 0.5, epd_lm: 1}")
    # Two roles ask for the same shape: both are named; a shape no waiting role asks for is not ours.
    (entry,) = unplaced([({"epd_lm": 1.0}, 2), ({"other": 1.0}, 3)], shapes,
                        {"prefill": ["prefill-6"], "decode": ["decode-8"], "encoder": []}, [head, east])
    assert (entry["roles"], entry["count"], entry["replicas"]) == (["prefill", "decode"], 2, ["decode-8", "prefill-6"])
    assert unplaced([({"epd_lm": 1.0}, 1)], shapes, {"prefill": []}, [head, east]) == []
