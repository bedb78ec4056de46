"""What a deployment's controller keeps across its own restarts: the fleet's life events and their
counts (the history `epd status` shows), when the deployment started, how often the controller
started, and the port of its metrics endpoint (a Prometheus target taken from `epd status` stays
valid). Kept in Ray's GCS key-value store, which outlives every actor of the cluster (the
controller's process, the registry's) and goes with the cluster; `epd down` deletes it.

Ray's key-value store is what Ray's own libraries (Serve, Tune) keep such state in; its functions
are underscored in ``ray.experimental.internal_kv`` but have been stable across Ray 2.x."""

from __future__ import annotations

import json
import logging

log = logging.getLogger("control.controller")  # the controller's log, whichever of its modules writes

KV_NAMESPACE = "epd"


def _key(namespace: str) -> bytes:
    return f"controller-state:{namespace}".encode()


def load(namespace: str) -> dict | None:
    """The deployment's saved state, or None (a fresh deployment, or Ray cannot say)."""
    from ray.experimental import internal_kv

    try:
        value = internal_kv._internal_kv_get(_key(namespace), namespace=KV_NAMESPACE)
        return json.loads(value) if value else None
    except Exception as error:  # noqa: BLE001 - a report only: the controller starts a history afresh
        log.warning("cannot read the deployment's saved history (%s); starting a new one", error)
        return None


def save(namespace: str, state: dict) -> None:
    from ray.experimental import internal_kv

    try:
        internal_kv._internal_kv_put(_key(namespace), json.dumps(state, separators=(",", ":")), overwrite=True,
                                     namespace=KV_NAMESPACE)
    except Exception as error:  # noqa: BLE001 - try again at the next change
        log.warning("cannot save the deployment's history (%s)", error)


def forget(namespace: str) -> None:
    from ray.experimental import internal_kv

    try:
        internal_kv._internal_kv_del(_key(namespace), namespace=KV_NAMESPACE)
    except Exception:  # noqa: BLE001 - the cluster is going away, or it was never saved
        pass
