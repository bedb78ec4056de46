"""Bookkeeping of discovery and load balancing, without Ray: the registry's versions and drain
acknowledgements, least-busy picking, the encoder pool's join/leave/drain, and the autoscaling
policy's decisions."""

from __future__ import annotations

import grpc
import pytest

from control.autoscale import AutoscalePolicy
from encode_svc.server import ReplicaPool
from epd import rpc
from epd.config import AutoscaleConfig
from epd.discovery import Balancer, Endpoint, Registry


def test_registry_drain_waits_for_every_watcher_of_the_role():
    registry = Registry()
    registry.register(Endpoint(name="decode-1", role="decode", address="h:1"))
    registry.register(Endpoint(name="decode-2", role="decode", address="h:2"))
    registry.snapshot("prefill-1/decode", "decode")  # two prefill replicas watch decode
    registry.snapshot("prefill-2/decode", "decode")
    registry.snapshot("router-1/prefill", "prefill")  # a watcher of another role does not count
    version = registry.drain("decode-2")
    assert not registry.acked("decode", version)  # nobody has applied it yet
    registry.ack("prefill-1/decode", "decode", version)
    assert not registry.acked("decode", version)
    registry.ack("prefill-2/decode", "decode", version)
    assert registry.acked("decode", version)
    _, endpoints = registry.snapshot()
    assert {e.name: e.draining for e in endpoints} == {"decode-1": False, "decode-2": True}


def test_a_removed_replicas_watchers_stop_blocking_drains():
    registry = Registry()
    registry.register(Endpoint(name="decode-1", role="decode", address="h:1"))
    registry.snapshot("prefill-1/decode", "decode")
    registry.remove("prefill-1")
    assert registry.acked("decode", registry.drain("decode-1"))


def test_balancer_spreads_concurrent_calls_and_skips_draining():
    balancer = Balancer("prefill")
    balancer.update([Endpoint(name=n, role="prefill", address=f"h:{n}") for n in ("a", "b", "c")])
    picked = [balancer.pick()[0] for _ in range(3)]
    assert sorted(picked) == ["a", "b", "c"]  # three calls in flight land on three replicas
    balancer.update([Endpoint(name="a", role="prefill", address="h:a"),
                     Endpoint(name="b", role="prefill", address="h:b", draining=True)])
    assert {balancer.pick()[0] for _ in range(4)} == {"a"}
    assert balancer.outstanding()["b"] == 1  # its call in flight is still counted until it ends
    balancer.update([])
    with pytest.raises(rpc.RpcFailure) as raised:
        balancer.pick()
    assert raised.value.code is grpc.StatusCode.UNAVAILABLE and "no prefill replica" in raised.value.message


class _Replica:
    """Stands in for an encoder actor handle: records which keys it was given."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.encode = self

    def remote(self, store_key, data, max_pixels):
        self.keys.append(store_key)
        return f"ref:{store_key}"


def test_pool_splits_a_requests_images_over_replicas_and_single_flights_keys():
    replicas = {"e1": _Replica(), "e2": _Replica(), "e3": _Replica()}
    pool = ReplicaPool(replicas)
    names = [pool.submit(f"k{i}", b"", 0)[1] for i in range(3)]
    assert sorted(names) == ["e1", "e2", "e3"]  # one image per replica, encoded in parallel
    ref, joined = pool.submit("k0", b"", 0)
    assert (ref, joined) == ("ref:k0", None)  # the same key joins the encode in flight
    assert pool.load() == (3, 3)


def test_pool_drains_a_replica_that_left():
    e1, e2 = _Replica(), _Replica()
    pool = ReplicaPool({"e1": e1, "e2": e2})
    _, first = pool.submit("k1", b"", 0)
    pool.update({n: h for n, h in {"e1": e1, "e2": e2}.items() if n != first})  # ``first`` drains
    assert pool.outstanding(first) == 1
    for i in range(4):
        assert pool.submit(f"new{i}", b"", 0)[1] != first
    pool.done("k1", first)
    assert pool.outstanding(first) == 0
    pool.update({})
    with pytest.raises(rpc.RpcFailure, match="no encoder replica"):
        pool.submit("k2", b"", 0)


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
