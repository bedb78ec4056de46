"""What `epd status` reads from the controller: every replica's state, address, node and the work
it holds now, the fleet's life events (history, apart from the state), autoscaling. Asked of every
replica at once; one that does not answer within ``status_wait_s`` is shown without its figures."""

from __future__ import annotations

import time

import ray

from epd.config import ROLES, DeployConfig

EVENT_KINDS = ("died", "restarted", "replaced", "unhealthy", "recovered")
"""The life events counted per role (the history line of `epd status`, the controller's metrics)."""


def report(config: DeployConfig, fleet, replicas: list, registered: dict, desired: dict, unplaced: list,
           in_flight: dict[str, int], kv: dict[str, dict], metrics_address: str, failed: str,
           not_replacing: dict, decisions: list) -> dict:
    """Replicas per role (name, address, node, health), their life events, autoscaling."""
    roles: dict[str, list] = {role: [] for role in ROLES}
    node_ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    waiting = {name for entry in unplaced if entry["count"] == len(entry["replicas"]) for name in entry["replicas"]}
    for replica in replicas:
        e = registered.get(replica.name)
        roles[replica.role].append({
            "name": replica.name, "address": e.address if e else "", "node_id": e.node_id if e else "",
            "node_ip": node_ips.get(e.node_id, "") if e else "", "pid": e.pid if e else 0,
            "http_address": e.http_address if e else "",
            "draining": bool(e and e.draining), "healthy": replica.healthy,
            "in_flight": in_flight.get(replica.name),
            **({"kv": kv[replica.name]} if replica.name in kv else {}),
            "state": "unplaced" if replica.name in waiting else replica_state(replica)})
    counts = {role: {kind: fleet.count(role, kind) for kind in EVENT_KINDS} for role in ROLES}
    return {"namespace": config.namespace, "time": time.time(), "roles": roles, "desired": dict(desired),
            "aggregate": config.aggregate,
            "metrics": metrics_address, "events": fleet.recent(100), "counts": counts,
            "failed": failed, "not_replacing": dict(not_replacing),
            "unplaced": list(unplaced),
            "autoscale": {"enabled": config.autoscale.enabled,
                          "min_replicas": config.autoscale.min_replicas,
                          "max_replicas": config.autoscale.max_replicas},
            "decisions": list(decisions[-50:])}


def replica_state(replica) -> str:
    if not replica.registered:
        return "starting"
    return "serving" if replica.healthy else replica.last_probe


def work_in_flight(handles: dict, wait_s: float) -> dict[str, int]:
    """The requests each replica works on now (an encoder's: images queued for it or running),
    asked of every replica at once; one that does not answer within ``wait_s`` is left out."""
    services = [h for n, h in handles.items() if n.startswith("encode-")]
    asked: dict[str, list] = {}
    for name, handle in handles.items():
        asked[name] = ([s.outstanding.remote(name) for s in services] if name.startswith("encoder-")
                       else [handle.requests.remote()])
    refs = [ref for parts in asked.values() for ref in parts]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    answered = set(ready)
    found: dict[str, int] = {}
    for name, parts in asked.items():
        if not all(ref in answered for ref in parts):
            continue
        try:
            found[name] = sum(ray.get(parts, timeout=0))
        except Exception:  # noqa: BLE001 - restarting or gone: status says nothing of its work
            pass
    return found


def kv_usage(handles: dict, wait_s: float, aggregate: bool = False) -> dict[str, dict]:
    """Each decode replica's K/V pool now (``DecodeServer.kv_usage``; with ``aggregate``, each
    prefill replica's, which decodes too), asked of all at once; one that does not answer within
    ``wait_s`` is left out."""
    kinds = ("decode-", "prefill-") if aggregate else ("decode-",)
    refs = {name: handle.kv_usage.remote() for name, handle in handles.items() if name.startswith(kinds)}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
    found = {}
    for name, ref in refs.items():
        if ref in ready:
            try:
                found[name] = ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - restarting or gone: status says nothing of its memory
                pass
    return found
