"""Machines for `ray up` on one Linux box: each is its own network, PID, mount and UTS namespace.

A ``Lan`` holds a workstation (``client``, where `ray up` runs; it also holds the LAN's bridge)
and hosts (``head``, ``worker``...), each running OpenSSH's ``sshd`` as the first process of its
PID namespace. What a host sees of the shared filesystem is made to look like a fresh machine:

- ``/root`` is the host's own home (from /etc/skel, plus ``.ssh/authorized_keys``), so what
  `ray up` writes there (``~/ray_bootstrap_config.yaml``, ``~/.bashrc`` lines, ``~/.ray``) stays
  on that host;
- ``/tmp``, ``/dev/shm`` and ``/run`` are private tmpfs (Ray keeps its sessions in ``/tmp/ray``);
- ``/opt`` is an empty directory of the host's own, with a prepared Python environment mounted
  read-only at ``/opt/epd/venv`` (the hosts cannot reach a package registry; read-only so that a
  setup step that would reinstall fails instead of changing the environment);
- ``ray stop`` (which `ray up` and `ray down` run) sees only the host's own processes.

Killing a host's ``unshare`` process kills its first process, and with it every process of the
host (the kernel empties a PID namespace whose first process exits): nothing survives ``destroy``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

VENV = Path(sys.executable).parent.parent  # the environment running the tests: prepared, complete
# What every machine must still see of the real filesystem: that environment, the interpreter it
# was made from, and the checkout its epd is installed from.
SHARED = [VENV, Path(os.path.realpath(VENV / "bin" / "python")), Path(__file__).resolve().parent.parent]
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sh(*args: str, check: bool = True, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=timeout, **kwargs)


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL if the test process dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def missing_tools() -> list[str]:
    tools = {"sshd": "/usr/sbin/sshd", "ssh": "ssh", "ssh-keygen": "ssh-keygen", "rsync": "rsync",
             "unshare": "unshare", "nsenter": "nsenter", "ip": "ip"}
    return [name for name, path in tools.items() if not shutil.which(path)]


def install_tools() -> str:
    """Installs OpenSSH's server and rsync from the distribution's packages when missing; returns
    why they cannot be had ('' when everything is there). (Where an init system runs services,
    the package also starts the machine's own sshd: the package's doing, not used here.)"""
    if not missing_tools():
        return ""
    if not shutil.which("apt-get"):
        return f"missing {missing_tools()} and no apt-get to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    out = sh("apt-get", "install", "-y", "-q", "openssh-server", "openssh-client", "rsync", check=False,
             timeout=600, env=env)
    if out.returncode != 0:  # stale package lists: refresh once
        sh("apt-get", "update", "-q", check=False, timeout=600, env=env)
        out = sh("apt-get", "install", "-y", "-q", "openssh-server", "openssh-client", "rsync", check=False,
                 timeout=600, env=env)
    if missing_tools():
        return f"cannot install {missing_tools()}: {out.stdout[-1500:]}{out.stderr[-1500:]}"
    return ""


class Machine:
    """One machine: a network namespace (``ns``, address ``ip``) and, once started, a PID, mount
    and UTS namespace whose first process is sshd (a host) or a sleep (the workstation)."""

    def __init__(self, lan: "Lan", name: str, ip: str) -> None:
        self.lan, self.name, self.ip = lan, name, ip
        self.ns = f"{lan.prefix}{name[0]}"
        self.root = lan.workdir / name  # its home, /opt, logs
        self.home = self.root / "home"
        self.unshare: subprocess.Popen | None = None
        self.init_pid = 0  # its PID 1, as the test's PID namespace numbers it
        self.pidns = ""

    # -- inside it ---------------------------------------------------------------------------
    def env(self, **extra: str) -> dict:
        """A login's environment on this machine (what a user's shell has), plus ``extra``."""
        return {"HOME": "/root", "USER": "root", "LOGNAME": "root", "LANG": "C.UTF-8", "PATH": BASE_PATH,
                "TERM": "dumb", **extra}

    def command(self, *args: str, cwd: str | Path = "/root") -> list[str]:
        """``args`` run inside the machine, in directory ``cwd`` (as the machine sees it)."""
        # (nsenter's own --wd opens the directory before entering the mount namespace)
        return ["nsenter", "-t", str(self.init_pid), "-m", "-n", "-p", "-u", "--",
                "sh", "-c", 'cd "$0" && exec "$@"', str(cwd), *args]

    def run(self, *args: str, env: dict | None = None, cwd: str | Path = "/root", timeout: float = 600,
            check: bool = False) -> subprocess.CompletedProcess:
        return sh(*self.command(*args, cwd=cwd), env=env or self.env(), timeout=timeout, check=check)

    def processes(self) -> list[psutil.Process]:
        """Every live process of this machine (its PID namespace), zombies left out."""
        found = []
        for proc in psutil.process_iter(["status"]):
            try:
                if proc.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                if os.readlink(f"/proc/{proc.pid}/ns/pid") == self.pidns:
                    found.append(proc)
            except (OSError, psutil.Error):
                continue
        return found

    def ray_processes(self) -> list[str]:
        """This machine's Ray processes, told apart the way `ray stop` does (Ray's own list of
        process names and command-line keywords), as "pid: command line"."""
        from ray.autoscaler._private.constants import RAY_PROCESSES

        rows = []
        for proc in self.processes():
            try:
                name, cmd = proc.name(), " ".join(proc.cmdline())
            except psutil.Error:
                continue
            if any((keyword in name[:15]) if by_name else (keyword in cmd) for keyword, by_name in RAY_PROCESSES):
                rows.append(f"{proc.pid}: {(cmd or name)[:200]}")
        return rows

    def read(self, pattern: str) -> str:
        """Files inside the machine (e.g. its private /tmp), concatenated, for failure messages."""
        out = self.run("sh", "-c", f"for f in {pattern}; do echo \"== $f\"; tail -c 6000 \"$f\"; done", timeout=60)
        return out.stdout + out.stderr

    # -- lifecycle ---------------------------------------------------------------------------
    def _prepare(self, authorized_key: str | None) -> None:
        shutil.copytree("/etc/skel", self.home, symlinks=True)
        os.chmod(self.home, 0o700)
        ssh_dir = self.home / ".ssh"
        ssh_dir.mkdir(mode=0o700)
        if authorized_key:
            (ssh_dir / "authorized_keys").write_text(authorized_key)
            os.chmod(ssh_dir / "authorized_keys", 0o600)
        (self.root / "opt").mkdir()

    def _script(self, sshd: bool) -> str:
        """What the machine's first process runs: its mounts, then sshd (or a sleep)."""
        steps = ["set -e"]
        # /root and /opt become the machine's own; what the test's environment needs from under
        # them (pyenv's interpreter in /root, say) stays visible through a bind mount.
        private = {Path("/root"): self.home, Path("/opt"): self.root / "opt"}
        for target, mine in private.items():
            for top in sorted({target / p.relative_to(target).parts[0] for p in SHARED if target in p.parents}):
                (mine / top.name).mkdir(parents=True, exist_ok=True)
                steps.append(f"mount --rbind {top} {mine / top.name}")
        steps += [f"mount --rbind {mine} {target}" for target, mine in private.items()]
        if sshd:
            steps += [
                "mkdir -p /opt/epd/venv",
                f"mount --bind {VENV} /opt/epd/venv",
                "mount -o remount,bind,ro /opt/epd/venv",
            ]
        steps += [
            "mount -t tmpfs -o mode=1777,size=4g tmpfs /tmp",
            "mount -t tmpfs -o mode=1777 tmpfs /dev/shm",
            "mount -t tmpfs -o mode=755 tmpfs /run",
            "mkdir -p /run/sshd",
            f"hostname {self.name}",
        ]
        if sshd:
            steps.append("exec /usr/sbin/sshd -D -e -f /root/.sshd/sshd_config")
        else:
            steps.append("exec sleep infinity")
        return "; ".join(steps)

    def _sshd_config(self) -> None:
        conf = self.home / ".sshd"
        conf.mkdir(mode=0o700)
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.name} host key", "-f", str(conf / "host_key"))
        (conf / "sshd_config").write_text("\n".join([
            f"ListenAddress {self.ip}",
            "Port 22",
            "HostKey /root/.sshd/host_key",
            "PidFile /root/.sshd/sshd.pid",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "AuthorizedKeysFile .ssh/authorized_keys",
            "MaxStartups 64",
            "MaxSessions 64",
            "Subsystem sftp internal-sftp",
            "",
        ]))

    def start(self, authorized_key: str | None, sshd: bool) -> None:
        self._prepare(authorized_key)
        if sshd:
            self._sshd_config()
        log = open(self.root / ("sshd.log" if sshd else "init.log"), "w")
        self.unshare = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, "unshare", "--pid", "--mount", "--uts", "--fork", "--kill-child",
             "--mount-proc", "sh", "-c", self._script(sshd)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.unshare.poll() is None, (self.root / ("sshd.log" if sshd else "init.log")).read_text()
            children = psutil.Process(self.unshare.pid).children()
            if children:
                self.init_pid = children[0].pid
                self.pidns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
                name = psutil.Process(self.init_pid).name()
                if name == ("sshd" if sshd else "sleep"):
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"{self.name} did not start: {(self.root / 'sshd.log').read_text()}")
        if sshd:
            deadline = time.monotonic() + 30
            while self.run("bash", "-c", f"exec 3<>/dev/tcp/{self.ip}/22", timeout=10).returncode != 0:
                assert time.monotonic() < deadline, (self.root / "sshd.log").read_text()
                time.sleep(0.2)

    def stop(self) -> list[str]:
        """Kills everything of this machine; returns what would not die."""
        if self.unshare is None:
            return []
        procs = self.processes()
        if self.unshare.poll() is None:
            self.unshare.send_signal(signal.SIGKILL)  # --kill-child: its PID 1 gets SIGKILL, then all the rest
            self.unshare.wait(timeout=30)
        _, alive = psutil.wait_procs(procs, timeout=30)
        return [f"{self.name} {p.pid}" for p in alive]


class Lan:
    """``client`` (the workstation and the LAN's bridge) plus hosts on 10.232.N.0/24; with
    ``sshd=False`` the hosts run no SSH server (a test that enters them with ``Machine.run``)."""

    def __init__(self, tag: int, workdir: Path, hosts: tuple[str, ...] = ("head", "worker"),
                 sshd: bool = True) -> None:
        assert len({name[0] for name in ("client", *hosts)}) == len(hosts) + 1, "machine names need distinct initials"
        self.prefix = f"epr{tag}"
        self.sshd = sshd  # False: hosts reached only by nsenter (no OpenSSH needed)
        self.workdir = workdir
        octet = tag % 250 + 1
        self.subnet = f"10.232.{octet}"
        self.client = Machine(self, "client", f"{self.subnet}.1")
        self.hosts = {name: Machine(self, name, f"{self.subnet}.{10 + i}") for i, name in enumerate(hosts)}
        self.netns: list[str] = []
        self.key = workdir / "client" / "home" / ".ssh" / "id_ed25519"

    @property
    def machines(self) -> list[Machine]:
        return [self.client, *self.hosts.values()]

    def create(self) -> None:
        for machine in self.machines:
            sh("ip", "netns", "add", machine.ns)
            self.netns.append(machine.ns)
            sh("ip", "-n", machine.ns, "link", "set", "lo", "up")
        client = self.client.ns
        sh("ip", "-n", client, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", client, "addr", "add", f"{self.client.ip}/24", "dev", "br0")
        sh("ip", "-n", client, "link", "set", "br0", "up")
        for machine in self.hosts.values():
            here, there = f"{self.prefix}{machine.name[0]}0", f"{self.prefix}{machine.name[0]}1"
            sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
            sh("ip", "link", "set", here, "netns", machine.ns)
            sh("ip", "link", "set", there, "netns", client)
            sh("ip", "-n", client, "link", "set", there, "master", "br0")
            sh("ip", "-n", client, "link", "set", there, "up")
            sh("ip", "-n", machine.ns, "addr", "add", f"{machine.ip}/24", "dev", here)
            sh("ip", "-n", machine.ns, "link", "set", here, "up")
            # Ray finds a node's address from its route to a public IP; no packet leaves the LAN.
            sh("ip", "-n", machine.ns, "route", "add", "default", "via", self.client.ip)
        sh("ip", "-n", client, "route", "add", "default", "dev", "br0")

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.client.start(None, sshd=False)
        public = None
        if self.sshd:
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "epd ray up test", "-f", str(self.key))
            public = (self.key.parent / "id_ed25519.pub").read_text()
        for machine in self.hosts.values():
            machine.start(public, sshd=self.sshd)

    def destroy(self) -> list[str]:
        stubborn: list[str] = []
        for machine in self.machines:
            stubborn += machine.stop()
        for ns in self.netns:
            sh("ip", "netns", "del", ns, check=False)
        return stubborn

    def leftover_netns(self) -> set[str]:
        return set(self.netns) & {line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line}


@contextmanager
def up(lan: Lan) -> Iterator[Lan]:
    """``lan`` created for a test and destroyed after it, every process and namespace checked
    gone; the test is skipped where this machine does not permit ``ip netns``."""
    try:
        lan.create()
    except BaseException as error:
        stubborn = lan.destroy()
        command = [str(part) for part in getattr(error, "cmd", None) or []]
        if isinstance(error, subprocess.CalledProcessError) and command[:3] == ["ip", "netns", "add"]:
            pytest.skip(f"`ip netns` is not permitted here: {error.stderr.strip()}")
        assert stubborn == [], f"processes of the test machines would not die: {stubborn}"
        raise
    try:
        yield lan
    finally:
        stubborn = lan.destroy()
        assert stubborn == [], f"processes of the test machines would not die: {stubborn}"
        assert not lan.leftover_netns(), f"namespaces left behind: {lan.leftover_netns()}"
