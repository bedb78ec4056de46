"""Where and how the controller starts a replica: the class each role runs as, the options its Ray
actor gets, the config and context it is given, and which replicas Ray cannot place now.

Each role actor asks Ray for the resources its role is given in the deploy file
(``deploy/roles.toml``): custom resources or GPUs decide which nodes take which role; nothing in
the code names a node. The control plane itself (controller, registry) stays on the node that
deployed it (``here``).

A tensor-parallel replica (``prefill.tensor_parallel`` / ``decode.tensor_parallel`` = N) is one
actor (rank 0) whose N-1 follower ranks are local processes it starts: Ray would count only the
actor's resources. So its N ranks are reserved together (``reserve_ranks``): a placement group of
N bundles, each the role's resources, STRICT_PACK (one node: the followers run beside rank 0),
named after the replica and detached (it outlives a restart of the controller; Ray restarts the
actor inside it). The actor runs in bundle 0. The group goes when the replica goes
(``release_ranks``: scaled down, dead and replaced, or the deployment shut down).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from dataclasses import replace

import ray

from control.fleet import unplaced
from epd import allocator, discovery, logs, rpc
from epd.config import MODEL_ROLES, ROLES, TP_ROLES, DeployConfig, ServeConfig

log = logging.getLogger("control.controller")  # the controller's log, whichever of its modules writes

ROLE_ACTORS = {
    "encoder": "encode_svc.engine:EncoderEngine",
    "encode": "encode_svc.server:EncodeServer",
    "prefill": "prefill_svc.server:PrefillServer",
    "decode": "decode_svc.server:DecodeServer",
    "router": "router_svc.server:RouterServer",
}
"""The class each role's replicas run as: every one takes ``(ServeConfig, RoleContext)``."""
REPLICA_NAME = re.compile(rf"^({'|'.join(ROLES)})-(\d+)$")


AGGREGATE_ACTOR = "pd_svc.server:AggregateServer"
"""What the prefill role's replicas run as in an aggregated deployment (``DeployConfig.aggregate``):
prefill and decode in one engine, registered as both."""


def actor_class(config: DeployConfig, role: str) -> str:
    return AGGREGATE_ACTOR if config.aggregate and role == "prefill" else ROLE_ACTORS[role]


def create(config: DeployConfig, role: str, name: str, registry, serve: ServeConfig) -> ray.actor.ActorHandle:
    """Start replica ``name`` of ``role`` as a detached Ray actor running with ``serve``."""
    module, _, cls_name = actor_class(config, role).partition(":")
    cls = getattr(importlib.import_module(module), cls_name)
    # Detached: a replica outlives the controller (serving goes on while it is away). Ray
    # restarts a dead process; callers retry elsewhere, so Ray must not retry tasks on it.
    # SPREAD: Ray's default policy packs zero-CPU actors onto the first node that has their
    # custom resources, so every replica of every role sat on one worker and losing that
    # machine lost them all; SPREAD deals them out over the nodes that offer the resources.
    actor_options = cls.actor_options(config.serve) if hasattr(cls, "actor_options") else {}
    options = {**actor_options, **config.role_resources(role).ray_options(), "name": name,
               "lifetime": "detached", "max_restarts": config.max_restarts, "max_task_retries": 0,
               "scheduling_strategy": reserve_ranks(config, role, name) or "SPREAD"}
    if role in MODEL_ROLES and (preload := allocator.role_env()):
        # the job's runtime environment (log settings) plus the allocator's (jemalloc, huge pages), read at its start
        job = logs.runtime_env(os.environ.get(logs.FORMAT_ENV, "text"), os.environ.get(logs.LEVEL_ENV, "INFO"))
        options["runtime_env"] = {**job, "env_vars": {**job["env_vars"], **preload}}
    context = discovery.RoleContext(name=name, host=bind_host(config, role), registry=registry,
                                    poll_s=config.poll_s, heartbeat_s=config.heartbeat_s,
                                    refill_grace_s=config.refill_grace_s)
    return ray.remote(cls).options(**options).remote(serve, context)


def tensor_parallel(config: DeployConfig, role: str) -> int:
    """The processes one replica of ``role`` spans (1 for roles that cannot span several)."""
    return getattr(config.serve, role).tensor_parallel if role in TP_ROLES else 1


def ranks_group_name(name: str) -> str:
    return f"{name}-ranks"


def reserve_ranks(config: DeployConfig, role: str, name: str):
    """The scheduling strategy that puts replica ``name`` in bundle 0 of a placement group of its
    N ranks (N bundles of the role's resources, STRICT_PACK), made now if it is not there yet;
    None for a replica of one process, or one whose role asks Ray for nothing (``num_cpus`` 0, the
    one-machine default: there is nothing to reserve, and Ray refuses an empty bundle)."""
    world, bundle = tensor_parallel(config, role), shape(config, role)
    if world == 1 or not bundle:
        return None
    from ray.util.placement_group import get_placement_group, placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    try:
        group = get_placement_group(ranks_group_name(name))
    except ValueError:  # the usual case: a new replica
        group = placement_group([dict(bundle) for _ in range(world)], strategy="STRICT_PACK",
                                name=ranks_group_name(name), lifetime="detached")
    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)


def release_ranks(name: str) -> None:
    """Remove the placement group of replica ``name``'s ranks, if it has one."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    try:
        group = get_placement_group(ranks_group_name(name))
    except ValueError:
        return
    try:
        remove_placement_group(group)
    except Exception as error:  # noqa: BLE001 - removed already; Ray forgets it with the cluster anyway
        log.warning("placement group of %s not removed: %s", name, error)


def router_serve(serve: ServeConfig, name: str, holder: str, alive: dict) -> tuple[ServeConfig, str]:
    """The config router ``name`` runs with, and who holds the configured ports now: the configured
    gRPC, HTTP and metrics ports go to one router at a time (the first, or the one that replaces
    it: ``holder`` is not in ``alive``); every other router takes free gRPC and HTTP ports and
    serves its metrics on its HTTP front's /metrics only."""
    if not serve.router.port and not serve.http.port and not serve.router.metrics_port:
        return serve, holder
    if holder not in alive:  # nobody holds them (never, or it died)
        return serve, name
    http = replace(serve.http, port=0) if serve.http.port is not None else serve.http
    return replace(serve, router=replace(serve.router, port=0, metrics_port=0), http=http), holder


def bind_host(config: DeployConfig, role: str) -> str:
    """Loopback on one machine; the node's IP on a cluster (roles on other nodes must reach
    it). The router binds ``--host`` when one was given."""
    router_host = config.serve.router.host
    if role == "router" and (config.bind == "loopback" or router_host != "127.0.0.1"):
        return router_host
    return rpc.NODE_ADDRESS if config.bind == "node" else "127.0.0.1"


def shape(config: DeployConfig, role: str) -> dict[str, float]:
    """What one process of ``role`` asks Ray for (a replica of N ranks asks it N times), as Ray's
    pending demands spell it."""
    resources = config.role_resources(role)
    return {**({"CPU": resources.num_cpus} if resources.num_cpus else {}),
            **({"GPU": resources.num_gpus} if resources.num_gpus else {}), **resources.resources}


def replica_shape(config: DeployConfig, role: str) -> dict[str, float]:
    """What one replica of ``role`` asks Ray for in all: a replica of N ranks, N times its role's
    resources, on one node (its placement group, which Ray reports as one gang demand)."""
    world = tensor_parallel(config, role)
    return {key: amount * world for key, amount in shape(config, role).items()}


def find_unplaced(config: DeployConfig, waiting: dict[str, list[str]], known: list[dict]) -> list[dict]:
    """While replicas are not serving (``waiting``: names by role), ask Ray's GCS what it cannot
    place (a lost machine was the only one offering a role's resources, or the remaining ones have
    them all in use) and say so in the log when it changed from ``known``. Ray keeps such a replica
    pending and places it when a node offers the resources; nothing else would tell the user it
    waits. Returns what is unplaced now (``known`` when Ray cannot say)."""
    found: list[dict] = []
    if any(waiting.values()):
        try:
            found = unplaced(pending_demands(), {role: replica_shape(config, role) for role in ROLES}, waiting,
                             [n["Resources"] for n in ray.nodes() if n["Alive"]])
        except Exception as error:  # noqa: BLE001 - a report only; try again next round
            log.warning("cannot read Ray's pending demands: %s", error)
            return known
    if found != known:
        for entry in found:
            log.warning("%s: %d replica(s) cannot be placed (of %s, not serving): %s", "/".join(entry["roles"]),
                        entry["count"], ", ".join(entry["replicas"]), entry["reason"])
        if not found:
            log.info("every replica is placed")
    return found


def pending_demands() -> list[tuple[dict[str, float], int]]:
    """What Ray's GCS has not placed yet, as it reports it to an autoscaler: (shape, count)."""
    from ray.autoscaler.v2.sdk import get_cluster_resource_state

    state = get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)
    return ([(dict(r.request.resources_bundle), r.count) for r in state.pending_resource_requests]
            + gang_demands([[dict(r.resources_bundle) for r in gang.requests]
                            for gang in state.pending_gang_resource_requests]))


def gang_demands(gangs: list[list[dict[str, float]]]) -> list[tuple[dict[str, float], int]]:
    """Pending placement groups (each a list of bundles) as (shape, count) demands: a group's
    bundles summed (STRICT_PACK: one node must offer them all), equal groups counted together."""
    counts: dict[tuple, int] = {}
    for bundles in gangs:
        total: dict[str, float] = {}
        for bundle in bundles:
            for key, amount in bundle.items():
                total[key] = total.get(key, 0.0) + amount
        key = tuple(sorted(total.items()))
        counts[key] = counts.get(key, 0) + 1
    return [(dict(key), count) for key, count in counts.items()]


def here():
    """The control plane (controller, registry) stays on the node that deployed it: the head,
    where docs/DEPLOY.md runs `epd deploy`. Left to Ray, these zero-resource actors land on any
    node, a worker included (seen in tests/test_node_loss.py), and losing that machine would take
    the controller and the registry along with its replicas. Hard affinity: Ray's soft node
    affinity placed them on other nodes too; the price is that they cannot move if that node is
    lost, which for the head means the cluster (Ray's GCS) is lost anyway."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def seq_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1])
