"""Fused CPU kernels written in C++ (``epd/csrc``), compiled on this machine at first use.

Two libraries: ``epd/csrc/gdn_decode.cpp`` (below) and ``epd/csrc/decode_ops.cpp``
(``decode_ops()``: decode's few-row linear layers, residual add + RMSNorm, a gated MLP's
``silu(gate) * up``, and full-attention step, used through ``epd.kernels``).

``gdn_decode_step`` is one decode token of a Gated DeltaNet layer for a whole batch (conv step,
q/k L2 norm, decay and beta, the recurrent state update and read-out, the gated RMSNorm) in one
call that reads and writes each slot's float32 state once: ``epd/csrc/gdn_decode.cpp`` says
what it computes and how it rounds. ``epd.lm`` uses it for decode steps on a CPU and keeps its
torch path (``epd.kernels``) for everything else.

Why C++ and not torch: the torch path is ~30 ops per layer and reads the 1 MiB-per-slot state
three times (the batched ``[B*H, 2, 128] @ [B*H, 128, 128]`` read runs at a fraction of memory
bandwidth on these CPUs); vLLM's CPU build does the same step with a fused kernel of its own.
Nothing on the machine provides one as a library (vLLM's CPU ops come only inside its own
environment, which pins other torch and transformers versions).

The build: ``torch.utils.cpp_extension.load`` (g++ and ninja, both on the project's machines),
``-O3 -march=native`` so the compiler vectorises the loops for this CPU; the result is cached
under ``$XDG_CACHE_HOME/epd/torch_extensions`` (``~/.cache`` by default), one directory per torch
version, CPU (``-march=native`` code must not be loaded on another CPU) and version of the
sources, so later processes load it in well under a second. ``EPD_FUSED_KERNELS=0`` turns the kernels off (the torch path
runs); if the compiler is missing or the build fails, one warning is logged and the torch path
runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "EPD_FUSED_KERNELS"
SOURCE = Path(__file__).with_name("csrc") / "gdn_decode.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": what ops() decided (the op or None); "loaded": the op once loaded


def enabled() -> bool:
    """Whether the fused kernels may be used at all (``EPD_FUSED_KERNELS`` is not ``0``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where builds are kept: ``$XDG_CACHE_HOME/epd/torch_extensions`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "epd" / "torch_extensions"


def _cpu_key() -> str:
    """A short key of the CPU's model and instruction-set flags: code built with -march=native is
    only loaded on a CPU like the one it was built for."""
    text = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                text += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def torch_tag() -> str:
    """This torch's version as a name part (a build is tied to the torch it was compiled against)."""
    return torch.__version__.replace("+", "_").replace(".", "_")


def native_name(prefix: str) -> str:
    """A ``-march=native`` build's name: per torch version, CPU (``_cpu_key``) and version of the
    C++ sources (``_source_key``: two epd trees on one machine share the cache directory, and
    a build under one name would otherwise be replaced by each tree's in turn)."""
    return f"{prefix}_{torch_tag()}_{_cpu_key()}_{_source_key()}"


def _source_key() -> str:
    """A short hash of every C++ source and header in ``epd/csrc``."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE.parent.glob("*.[ch]*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:8]


def library_name() -> str:
    """The fused GDN step's build name."""
    return native_name("epd_gdn")


def compile_library(name: str, source: Path, cflags: list[str], directory: Path | None = None,
                    verbose: bool = False) -> None:
    """Compile ``source`` (an operator library registering ``torch.ops`` itself, no Python module)
    into ``directory`` (default ``cache_dir() / name``) and load it into this process; the cached
    build is loaded as it is when the source has not changed. Raises when the tools are missing or
    the build fails. Every C++ operator of epd (``epd/csrc``) is built through here."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    for tool in (compiler, "ninja"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool!r} not found (a C++ compiler and ninja build the kernels)")
    directory = Path(directory) if directory is not None else cache_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        # -fopenmp: at::parallel_for is a header template that splits its range over threads only
        # when compiled with OpenMP (without it every kernel ran on one thread); the library's
        # libgomp.so.1 is the one torch already loaded (same soname)
        cpp_extension.load(name=name, sources=[str(source)], build_directory=str(directory),
                           extra_cflags=[*cflags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=verbose)


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One builder at a time in ``directory``, by an ``flock`` the kernel drops when its holder dies.

    torch's own guard is a ``lock`` file it creates and deletes (``FileBaton``): a process killed
    while building (a role stopped or ``kill -9``'d at its first start) leaves it behind, and every
    later process then waits on it forever (every role's start hung so here). Under this flock no
    live epd process is building, so a ``lock`` file found is such a leftover and is removed."""
    with open(directory / ".epd-build.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building %s", directory.name)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(directory: Path | None = None, name: str | None = None, verbose: bool = False):
    """Compile (or load the cached build of) the kernels into ``directory`` (default: under
    ``cache_dir()``, one per ``library_name()``) and return the op. Raises if the build fails.
    A process loads the library once (its op registration cannot be repeated): later calls
    return the op loaded first."""
    if "loaded" in _state:
        return _state["loaded"]
    compile_library(name or library_name(), SOURCE, ["-O3", "-march=native"], directory, verbose)
    _state["loaded"] = torch.ops.epd_gdn.decode_step
    return _state["loaded"]


def ops():
    """The fused decode-step op, built at first call; None when turned off or when the build
    failed (logged once per process, and the callers run their torch path)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            op = None
            if enabled():
                try:
                    op = build()
                except Exception as error:  # a missing compiler, a failed build: the torch path runs
                    lines = str(error).strip().splitlines() or [""]
                    reason = next((line for line in lines if "error:" in line), lines[-1])
                    log.warning("fused CPU kernels unavailable, using the torch path (%s: %s)",
                                type(error).__name__, reason.strip())
            _state["ops"] = op
    return _state["ops"]


def reset() -> None:
    """Forget the outcome of the last ``ops()`` and ``decode_ops()`` (tests: the next call decides
    again; a library already loaded stays loaded)."""
    with _lock:
        _state.pop("ops", None)
        _state.pop("decode", None)


DECODE_SOURCE = Path(__file__).with_name("csrc") / "decode_ops.cpp"


def decode_ops() -> bool:
    """Whether ``torch.ops.epd_decode`` (``epd/csrc/decode_ops.cpp``: decode's few-row linear
    layers and the fused residual add + RMSNorm) can be used: built or loaded at the first call,
    then checked against ``F.linear`` on a small product. False when turned off
    (``EPD_FUSED_KERNELS=0``) or when the build or the check failed (one warning per process;
    the callers keep oneDNN and the torch norms). Needs AVX-512 BF16 (``-march=native``)."""
    if not enabled():
        return False
    if "decode" not in _state:
        with _lock:
            if "decode" not in _state:
                _state["decode"] = _load_decode_ops()
    return bool(_state["decode"])


def decode_tiles() -> bool:
    """Whether the few-row kernel multiplies bfloat16 products of 5 rows or more on AMX tiles in
    this process (a CPU with AMX, a build with the path, ``EPD_DECODE_AMX`` not ``0``)."""
    return decode_ops() and bool(torch.ops.epd_decode.tiles())


def decode_screens() -> bool:
    """Whether greedy rows' LM head can be screened on int8 in this process
    (``epd/csrc/greedy_screen.h``: a CPU with AMX-INT8 or AVX-512 VNNI)."""
    return decode_screen_kind() is not None


def decode_screen_kind() -> str | None:
    """How greedy rows' LM head is screened in this process: ``"tiles"`` (AMX-INT8,
    ``EPD_DECODE_AMX`` not ``0``), ``"vector"`` (AVX-512 VNNI), or None."""
    if not decode_ops():
        return None
    return {1: "tiles", 2: "vector"}.get(int(torch.ops.epd_decode.screens()))


def _load_decode_ops() -> bool:
    try:
        if "decode_loaded" not in _state:
            compile_library(native_name("epd_decode"), DECODE_SOURCE, ["-O3", "-march=native"])
            _state["decode_loaded"] = True
        gen = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16):
            weight, x = torch.randn(37, 64, generator=gen).to(dtype), torch.randn(5, 64, generator=gen).to(dtype)
            out = torch.ops.epd_decode.linear(x, torch.ops.epd_decode.pack(weight), 37, None)
            if not torch.allclose(out.float(), (x.float() @ weight.float().t()), rtol=2e-2, atol=2e-2):
                raise RuntimeError(f"its self-check disagrees with F.linear in {dtype}")
        return True
    except Exception as error:  # a missing compiler or instruction set, a failed build: oneDNN stays
        lines = str(error).strip().splitlines() or [""]
        reason = next((line for line in lines if "error:" in line), lines[-1])
        log.warning("decode CPU kernels unavailable, using oneDNN and the torch norms (%s: %s)",
                    type(error).__name__, reason.strip())
        return False



def gdn_constants(conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, a_log: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer's weights in the form the op reads them, all float32: the conv taps ``[K,
    conv_dim]`` (from ``conv_weight [conv_dim, K]``), the bias or None, ``-exp(A_log)`` and
    ``dt_bias`` (what the torch path computes from them on every step)."""
    return (conv_weight.t().float().contiguous(), None if conv_bias is None else conv_bias.float().contiguous(),
            -a_log.float().exp(), dt_bias.float().contiguous())


def gdn_decode_step(mixed: torch.Tensor, window: torch.Tensor, constants: tuple[torch.Tensor, ...],
                    a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float,
                    state: torch.Tensor, k_heads: int, k_dim: int, v_dim: int, op=None) -> torch.Tensor:
    """One decode token of Gated DeltaNet for ``B`` slots: ``mixed [B, conv_dim]`` (in_proj_qkv's
    output; it, ``a``, ``b`` and ``z`` may be column slices of one merged product: rows strided,
    each contiguous), the time-major conv ``window [B, K, conv_dim]`` and the float32 ``state [B, v_heads,
    k_dim, v_dim]`` (both updated in place, contiguous), the layer's ``gdn_constants``, in_proj_a's
    and in_proj_b's outputs ``a``/``b`` ``[B, v_heads]``, the gate ``z [B, v_heads * v_dim]``, the
    gated norm's weight and epsilon. Returns the gated-normed core ``[B, v_heads * v_dim]`` in the
    model dtype (out_proj's input). ``op``: the fused op (default ``ops()``, which must not be None)."""
    op = op or ops()
    taps, bias, neg_a_exp, dt_bias = constants
    return op(_rows(mixed), window, taps, bias, _rows(a), _rows(b), neg_a_exp, dt_bias, _rows(z),
              norm_weight.contiguous(), float(norm_eps), state, k_heads, k_dim, v_dim)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[B, n]`` rows, each contiguous (a merged projection's column slice stays a view)."""
    t = t.reshape(t.shape[0], -1)
    return t if t.stride(-1) == 1 else t.contiguous()
