"""Raw tensor bytes with an explicit dtype and shape: the only way tensors cross a process here.

Never pickle: a tensor travels as its contiguous little-endian bytes plus a name for its dtype
and its shape, and is rebuilt with ``torch.frombuffer`` on the other side.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys
import threading
from collections.abc import Sequence

import torch

from epd.config import ConfigError, parse_cpus

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {dtype}; supported: {', '.join(DTYPES)}") from None


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {name!r}; supported: {', '.join(DTYPES)}") from None


def to_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes, row-major (``[*shape]`` of ``dtype``)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def byte_size(dtype: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of ``dtype`` (a name) and ``shape`` takes in ``to_bytes`` form."""
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel * torch.empty((), dtype=parse_dtype(dtype)).element_size()


def from_bytes(data: bytes | bytearray | memoryview, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """Rebuild a tensor from ``to_bytes`` output; the length must match ``dtype`` and ``shape``."""
    torch_dtype = parse_dtype(dtype)
    expected = byte_size(dtype, shape)
    if len(data) != expected:
        raise ValueError(f"tensor of {dtype}{list(shape)} needs {expected} bytes, got {len(data)}")
    if expected == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    # bytearray keeps the result writable and owned (frombuffer on bytes would warn and alias).
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(tuple(shape))


def configure_threads(num_threads: int = 0, cpus: str = "") -> int:
    """Pin this process to ``cpus`` (a Linux CPU list; empty: leave it where it may run), then set
    its torch threads: ``num_threads``, or with 0 every core it may run on, for its forwards.

    Ray starts actors with OMP_NUM_THREADS=1, which would leave a role that has the machine's
    cores to itself on one of them. Co-located roles share cores instead; the launcher sets a
    short GOMP_SPINCOUNT for them so idle OpenMP threads soon sleep rather than spin on a core
    another role needs, and a core share (``epd.core_share``: each forward's team is the cores
    divided by the roles computing then), or each role gets cores of its own (``cpus``).

    Only the forwards compute on the whole team (``forward_team``); every other thread of the
    process runs its parallel ops alone. The calling thread keeps the team
    until ``release_thread_team``: it loads the weights.
    """
    import os

    from epd import sched

    sched.set_policy("other")  # a forward role: the default policy (it may preempt the control plane)
    if cpus:
        allowed = os.sched_getaffinity(0)
        wanted = parse_cpus(cpus) & allowed
        if not wanted:
            raise ConfigError(f"cpus {cpus!r}: none of them is among this process's cores "
                              f"{sorted(allowed)}")
        # Every thread the process has by now (torch's, Ray's): sched_setaffinity(0) would pin only
        # the calling one, and threads inherit the mask only when created after it.
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), wanted)
            except (ProcessLookupError, PermissionError):
                pass  # a thread that ended meanwhile
    count = num_threads or len(os.sched_getaffinity(0))
    global _FORWARD_THREADS
    _FORWARD_THREADS = count
    if _serial_by_default():
        thread_team(count)
    else:
        torch.set_num_threads(count)
    if not num_threads and not cpus:  # every core, shared with the co-located roles: split them by who computes
        from epd import core_share

        core_share.enable(count)
    return count


# Why one OpenMP team per process: libgomp gives each thread that starts a parallel region a pool
# of its own threads, and once a process's pools hold more threads than it has cores, every pool
# spins only 100 times at a barrier before it sleeps (libgomp's "throttled" spin), whatever
# GOMP_SPINCOUNT says. A served replica held three pools (the thread that loaded the weights, the
# decode loop's, one more), so its decode step's second thread slept, and was woken, at almost
# every one of the step's parallel regions. One decode step (8 rows, 300 tokens, 2 threads) beside
# a thread holding a second pool: 101-103 ms whatever the spin, against 96-97 ms without it at the
# launcher's GOMP_SPINCOUNT=3000 and 85 ms at 30000; served, the inter-token latency fell 6-7%
# (docs/BENCHMARKS.md, "One OpenMP pool a process").
_FORWARD_THREADS = 0  # configure_threads' count: a forward's team (0: not configured, torch's own default)
_TEAM = threading.local()  # .size: this thread's team as thread_team set it


@functools.cache
def _openmp() -> tuple:
    """The libgomp this process's torch uses, and torch's MKL per-thread setter: (None, None)
    where torch's threads are not libgomp's (found by the path mapped into this process, so a
    libgomp of another build is never loaded beside it)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line and ".so" in line}
    except OSError:
        return None, None
    gomp_path = next((p for p in paths if "/libgomp" in p), None)
    if gomp_path is None or "OpenMP" not in torch.__config__.parallel_info():
        return None, None
    torch_cpu = next((p for p in paths if p.endswith("/libtorch_cpu.so")), None)
    mkl = getattr(ctypes.CDLL(torch_cpu), "MKL_Set_Num_Threads_Local", None) if torch_cpu else None  # C: by value
    return ctypes.CDLL(gomp_path), mkl


def _serial_by_default() -> bool:
    """Every thread starts with a team of one (torch reads its process-wide count at a thread's
    first parallel op), and ``thread_team`` gives a thread its own: only where torch runs on
    libgomp (False elsewhere, nothing changed)."""
    if _openmp()[0] is None:
        return False
    torch.set_num_threads(1)
    _TEAM.size = 1
    return True


def thread_team(count: int) -> None:
    """The calling thread's parallel ops run on ``count`` threads; other threads keep theirs.
    Where teams cannot be set per thread (not libgomp), torch's process-wide count.

    The thread's OpenMP setting is read back each time rather than trusted from the last call:
    ATen's first parallel op on a thread sets the thread to torch's process-wide count (1 here,
    ``_serial_by_default``), once per thread in each library built against ATen, so epd's own C++
    operators (compiled apart from libtorch, each with its own copy of that first-use flag) put a
    forward's thread back to one thread at their first parallel op on it. With the size only
    remembered, a role whose team never changed size then ran every later forward on one thread
    (a lone replica's; on one machine until the core share first changed its size: the first
    image of a run encoded on one core of two, docs/BENCHMARKS.md, "Issue 18 on the AMD EPYC, a
    third time")."""
    gomp, mkl = _openmp()
    if getattr(_TEAM, "size", None) == count and (gomp is None or gomp.omp_get_max_threads() == count):
        return
    if gomp is None:
        torch.set_num_threads(count)
    else:
        torch.get_num_threads()  # torch's own first-use setup of this thread, which would overwrite the team
        gomp.omp_set_num_threads(count)
        if mkl is not None:
            mkl(count)
    _TEAM.size = count


def forward_team(count: int = 0) -> None:
    """Before a forward on this thread: its team, ``count`` threads or configure_threads' count.
    Nothing where the process never configured its threads (a tool, a test in-process)."""
    count = count or _FORWARD_THREADS
    if count:
        thread_team(count)


def release_thread_team() -> None:
    """The calling thread computes no more forwards (it loaded the weights): its parallel ops run
    alone from now on, and its OpenMP pool's threads exit (OpenMP 5's omp_pause_resource_all)."""
    gomp, _ = _openmp()
    if gomp is None or not _FORWARD_THREADS:
        return
    thread_team(1)
    gomp.omp_pause_resource_all(1)  # omp_pause_soft: libgomp frees the calling thread's pool


def default_device() -> str:
    """CUDA when this process may use a GPU, else CPU: the same code serves both. In a Ray worker
    that means a GPU Ray gave it (Ray sets its CUDA_VISIBLE_DEVICES, so ``cuda`` is that one): a
    replica that asked Ray for no GPU runs on the CPU even where a GPU is visible, never on another
    role's device."""
    if _in_ray_worker() and not sys.modules["ray"].get_gpu_ids():
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _in_ray_worker() -> bool:
    """This process is one Ray started to host an actor or a task (not a driver, not a test)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def freeze_startup_heap(served: bool | None = None) -> int:
    """Once a role's process has built what it serves with (the model's modules, the libraries'
    objects): frees what is garbage already, then moves every object left out of the garbage
    collector's reach (``gc.freeze``); returns how many that froze. Why: a full collection walks
    every tracked object while holding the GIL, so it stops every thread of the process, the
    forwards and the streams: ~155 ms over the ~390k objects of a qwen3.5-0.8b replica (one came
    in the first W2 run of a fresh stack: 171 ms), ~0 once they are frozen (docs/BENCHMARKS.md,
    "Issue 18, 2026-12-06 (06:10-08:10 UTC)"). Only where Ray runs the process as a role
    (``served`` None: a Ray worker): a test or a tool that builds a role in its own process keeps
    its objects collectable, since a frozen object in a reference cycle is never freed."""
    if not (_in_ray_worker() if served is None else served):
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def device_info() -> dict:
    """Which device this process computes on and which GPUs Ray gave it (``epd status``, tests)."""
    import os

    info = {"device": default_device(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpu_ids": []}
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        info["gpu_ids"] = [str(gpu) for gpu in sys.modules["ray"].get_gpu_ids()]
    return info


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
