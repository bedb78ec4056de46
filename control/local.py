"""Start every role on a fresh local Ray instance: ``epd serve``.

A local Ray first, then the embedded Redis in a Ray actor (``RedisKeeper``: Ray restarts it, it
restarts redis-server) unless a URL is given, then the same ``Controller`` that ``epd deploy``
puts on a cluster (``control.controller``), bound to loopback. Every role is a Ray actor, so each
runs in its own worker process with only its own weights. ``stop`` drains the routers (requests
in flight finish within ``drain_timeout_s``), stops the controller and with it every role, shuts
Ray down, and leaves no process behind.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace

from epd import core_share, logs, sched
from epd.config import DeployConfig, redact_url
from epd.store import EmbeddingStore

log = logging.getLogger(__name__)

REDIS_KEEPER_NAME = "redis"


class StartError(RuntimeError):
    """The stack cannot start for a reason the operator can fix (an unreachable Redis); one line."""


class LocalStack:
    def __init__(self, config: DeployConfig) -> None:
        if not config.serve.security.internal_token:  # internal services only answer the deployment's own calls
            security = replace(config.serve.security, internal_token=secrets.token_urlsafe(32))
            config = replace(config, serve=replace(config.serve, security=security))
        self.deploy = config
        self.config = config.serve
        self.redis_keeper = None
        self.redis_url = self.config.store.redis_url or ""
        self.controller = None
        self.addresses: dict[str, str] = {}
        self.ray_address = ""
        self._ray_started = False
        self._redis_dir = ""
        self._core_share_dir = ""

    def start(self) -> str:
        """Bring everything up; returns the router's address once every role is SERVING."""
        # A local Ray binds the machine's interface address unless this is 0 when ray is first
        # imported: keep it on loopback.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Roles share this machine's cores: an idle OpenMP thread must soon sleep rather than spin
        # on a core another role computes on (libgomp's default spin made co-located prefill ~10x
        # slower). A short spin keeps most of the single-request speed: measured on the 0.8b
        # prefill, 3000 spins cost ~10% alone against ~30% for no spin (OMP_WAIT_POLICY=PASSIVE)
        # and match it under contention. Role processes inherit it from the raylet this starts.
        os.environ.setdefault("GOMP_SPINCOUNT", "3000")
        # Ray renices its workers to 15, under the raylet, GCS, dashboard and this driver (nice 0):
        # on shared cores any of them that wakes takes a core from a model role's OpenMP team at
        # once, and the whole team waits at the next barrier for the preempted thread. The roles
        # are the workload here: at nice 0 the served decode step was ~8% shorter (two A/B pairs,
        # docs/BENCHMARKS.md). The raylet this starts reads it for the workers it forks.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # No idle Ray workers held in reserve: every role is an actor in a process of its own (epd
        # submits no tasks), so the workers Ray pre-starts only ever idle, and each idle worker
        # wakes 100 times a second (its core worker's signal check), which on shared cores takes
        # a core from a forward's thread team mid-step ("what an idle stack costs", BENCHMARKS).
        os.environ.setdefault("RAY_enable_worker_prestart", "0")
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
        # ... and split the cores by how many of them compute at each forward (epd.core_share).
        if core_share.ENV not in os.environ:
            self._core_share_dir = tempfile.mkdtemp(prefix="epd-cores-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                    else None)
            os.environ[core_share.ENV] = self._core_share_dir
        quiet_ray_output()
        from control.controller import SERVING_LINE, create_controller

        try:
            self._start_ray()
            self._start_store()
            store = replace(self.config.store, redis_url=self.redis_url)
            deploy = replace(self.deploy, serve=replace(self.config, store=store))
            deploy = self._with_gpus(deploy)
            forwarded = OutputWatch(SERVING_LINE)
            try:
                self.controller = create_controller(deploy, detached=False)  # returns once every role serves
                # What the caller prints next ("epd ready at ...") comes after the roles' "joined"
                # lines: the controller logs SERVING_LINE after them, and Ray forwards its lines in order.
                if logging.getLevelName(os.environ.get(logs.LEVEL_ENV, "INFO")) <= logging.INFO:
                    forwarded.wait(READY_LOG_WAIT_S)
            finally:
                forwarded.close()
            self.addresses["router"] = self.router_addresses()[0]
            return self.addresses["router"]
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _with_gpus(deploy):
        import ray

        from epd.config import share_gpus

        shared = share_gpus(deploy, ray.cluster_resources().get("GPU", 0))
        if shared is not deploy:
            log.info("model replicas ask Ray for %s GPU each", shared.role_resources("decode").num_gpus)
        return shared

    def router_addresses(self) -> list[str]:
        import ray

        return ray.get(self.controller.router_addresses.remote())

    def http_addresses(self) -> list[str]:
        """The routers' OpenAI-compatible HTTP fronts (empty without ``--http-port``)."""
        import ray

        return ray.get(self.controller.http_addresses.remote())

    def redis_pid(self) -> int:
        """The embedded redis-server's process id (0 with an external Redis)."""
        import ray

        return ray.get(self.redis_keeper.pid.remote()) if self.redis_keeper is not None else 0

    def _start_store(self) -> None:
        if not self.redis_url:
            import ray

            from control.redis_server import RedisKeeper

            self._redis_dir = tempfile.mkdtemp(prefix="epd-redis-")
            self.redis_keeper = ray.remote(RedisKeeper).options(
                name=REDIS_KEEPER_NAME, max_restarts=-1, max_task_retries=-1, num_cpus=0,
            ).remote(self._redis_dir, self.config.store.max_memory_mb)
            self.redis_url = ray.get(self.redis_keeper.url.remote(), timeout=60)
        store = EmbeddingStore(self.redis_url)
        try:
            store.ping()
        except Exception as error:
            raise StartError(f"cannot reach Redis at {redact_url(self.redis_url)}: {error}") from None
        finally:
            store.close()

    def _start_ray(self) -> None:
        import ray

        # ray.init installs a native handler for SIGTERM that ends the process once it has printed a
        # stack; the caller's own handling (epd serve drains first) must stay in force.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        gpus = {} if self.deploy.local_gpus < 0 else {"num_gpus": self.deploy.local_gpus}
        try:
            sched.control_policy()
        except ValueError as error:
            raise StartError(str(error)) from None
        with sched.control_plane():  # Ray's daemons and every actor: the control plane's policy (epd/sched.py)
            ray.init(include_dashboard=False, logging_level=logging.WARNING, namespace=self.deploy.namespace,
                     **gpus, configure_logging=False,
                     runtime_env=logs.runtime_env(os.environ.get(logs.FORMAT_ENV, "text"),
                                                  os.environ.get(logs.LEVEL_ENV, "INFO")))
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if os.environ.get(logs.FORMAT_ENV) == "json":
            json_worker_output()
        self._ray_started = True
        self.ray_address = ray.get_runtime_context().gcs_address

    def stop(self) -> dict:
        """Drain, then stop everything; returns what the drain did (requests finished and cut)."""
        drained: dict = {}
        try:
            if self._ray_started:
                drained = self._stop_ray()
        finally:  # the files this launcher made go whatever stopping Ray did
            if self._redis_dir:
                shutil.rmtree(self._redis_dir, ignore_errors=True)
                self._redis_dir = ""
            if self._core_share_dir:
                shutil.rmtree(self._core_share_dir, ignore_errors=True)
                if os.environ.get(core_share.ENV) == self._core_share_dir:
                    del os.environ[core_share.ENV]
                self._core_share_dir = ""
        return drained

    def _stop_ray(self) -> dict:
        import ray

        from control.controller import stop_controller

        drained: dict = {}
        if self.controller is not None:
            started = time.monotonic()
            try:
                drained = ray.get(self.controller.drain_routers.remote(self.deploy.drain_timeout_s),
                                  timeout=self.deploy.drain_timeout_s + 90)
            except Exception as error:  # noqa: BLE001 - stop regardless
                log.warning("drain failed: %s", error)
            drained["drain_s"] = round(time.monotonic() - started, 2)
            _mute_worker_output_at_exit()
            stop_controller(self.controller)
            self.controller = None
        if self.redis_keeper is not None:
            try:
                ray.get(self.redis_keeper.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - Ray's shutdown takes it with it
                pass
            self.redis_keeper = None
        ray.shutdown()
        self._ray_started = False
        return drained


def quiet_ray_output() -> None:
    """Before Ray starts: what it prints on our terminal (or into the file our output goes to) says
    only what an operator needs. Each is Ray's own switch; a value the user set wins."""
    json_lines = os.environ.get(logs.FORMAT_ENV) == "json"
    # Ray colours the "(Actor pid=N)" prefix of forwarded lines; not when the output is a file or a
    # pipe, nor in JSON (an escape code would be part of the line).
    if json_lines or not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if json_lines:
        # JSON lines must stay JSON: no prefix at all (each line names its role itself), and no
        # "[repeated 3x across cluster]" summaries in place of lines Ray's dedup holds back.
        os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Token auth on, as Ray's default for a new local cluster, without its banner saying so.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    # A stack trace of the driver on SIGTERM, which is how `epd serve` is asked to stop.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")


def json_worker_output() -> None:
    """With ``--log-format json``, every line Ray forwards to this driver is a JSON object: the
    roles' own lines are already (``epd.logs.JsonFormatter``) and pass as they are; anything else a
    worker process prints (a library's print, a crash's traceback) and Ray's own notices (a worker
    that died, from the raylet) become ``epd.logs.json_line`` objects naming the process. Ray's
    dedup is bypassed too: every line comes through, none is folded into a "repeated" summary."""
    try:
        from ray._private import worker
    except ImportError:  # another Ray layout: its own printing stays
        return

    def emit(data, ignore_prefix: bool = False) -> None:
        pid = data.get("pid")
        if pid == "autoscaler":
            return
        sink = sys.stderr
        role = data.get("actor_name") or data.get("task_name") or ("raylet" if pid == "raylet" else f"pid={pid}")
        level = "WARNING" if pid == "raylet" else "INFO"
        out = []
        for line in data.get("lines", []):
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.startswith("{"):
                try:
                    json.loads(text)
                    out.append(text)
                    continue
                except ValueError:
                    pass
            out.append(logs.json_line(text, level, role=role, logger="ray" if pid == "raylet" else "output"))
        if out:
            print("\n".join(out), file=sink, flush=True)

    worker.print_to_stdstream = emit  # the raylet's notices (listen_error_messages) print through it
    dispatcher = worker.global_worker_stdstream_dispatcher
    if any(name == "ray_print_logs" for name, _ in dispatcher.handlers):
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", emit)  # same name: muting at exit still finds it


READY_LOG_WAIT_S = 10.0
"""The longest `epd serve` waits for Ray to forward the controller's ready line (within a second,
usually) before it says it is ready."""


class OutputWatch:
    """Sets ``wait``'s event once a line Ray forwards to this driver contains ``text``; Ray's own
    handler has printed that line by then (handlers run in the order they were added)."""

    NAME = "epd_watch_output"

    def __init__(self, text: str) -> None:
        self._seen = threading.Event()
        self._text = text
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:  # another Ray layout: nothing to wait for
            self._seen.set()
            self._dispatcher = None
            return
        self._dispatcher = dispatcher
        dispatcher.add_handler(self.NAME, self._look)

    def _look(self, data) -> None:
        if not self._seen.is_set() and any(self._text in line for line in data.get("lines", [])):
            self._seen.set()

    def wait(self, timeout_s: float) -> bool:
        return self._seen.wait(timeout_s)

    def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.remove_handler(self.NAME)


def _mute_worker_output_at_exit() -> None:
    """Stopping kills the role processes on purpose; Ray's forwarded "worker died" notices about
    them would say otherwise. What the roles said while draining is let through first."""
    time.sleep(1.0)  # Ray's log monitor forwards what the drain logged within about a second
    try:
        from ray._private import worker

        worker.global_worker_stdstream_dispatcher.remove_handler("ray_print_logs")
    except Exception:  # noqa: BLE001 - another Ray version: the notices stay, nothing else changes
        pass


class StoppedElsewhere(Exception):
    """Another command (`epd down`) stopped the deployment `epd serve` runs."""


def wait_forever(stack: LocalStack | None = None, every_s: float = 2.0) -> None:
    """Until interrupted, or (with ``stack``) until its deployment stops itself (raises
    ``DeploymentFailed`` saying why) or its controller is gone for good (``StoppedElsewhere``)."""
    while True:
        time.sleep(every_s if stack is not None else 3600)
        if stack is None or stack.controller is None:
            continue
        import ray

        from control.fleet import DeploymentFailed

        try:
            failed = ray.get(stack.controller.failure.remote(), timeout=60)
        except ray.exceptions.ActorDiedError:
            stack.controller = None  # gone for good: `epd down` stopped every role; stop the rest
            raise StoppedElsewhere("the deployment was stopped (`epd down`)") from None
        except Exception:  # noqa: BLE001 - restarting or busy: look again next time
            continue
        if failed:
            raise DeploymentFailed(failed)
