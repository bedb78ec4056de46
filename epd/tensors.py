"""Raw tensor bytes with an explicit dtype and shape: the only way tensors cross a process here.

Never pickle: a tensor travels as its contiguous little-endian bytes plus a name for its dtype
and its shape, and is rebuilt with ``torch.frombuffer`` on the other side.
"""

from __future__ import annotations

import sys
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
    its torch threads: ``num_threads``, or with 0 every core it may run on.

    Ray starts actors with OMP_NUM_THREADS=1, which would leave a role that has the machine's
    cores to itself on one of them. Co-located roles share cores instead; the launcher sets a
    short GOMP_SPINCOUNT for them so idle OpenMP threads soon sleep rather than spin on a core
    another role needs, and a core share (``epd.core_share``: each forward's team is the cores
    divided by the roles computing then), or each role gets cores of its own (``cpus``).
    """
    import os

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
    torch.set_num_threads(count)
    if not num_threads and not cpus:  # every core, shared with the co-located roles: split them by who computes
        from epd import core_share

        core_share.enable(count)
    return count


def default_device() -> str:
    """CUDA when this process may use a GPU, else CPU: the same code serves both. In a Ray worker
    that means a GPU Ray gave it (Ray sets its CUDA_VISIBLE_DEVICES, so ``cuda`` is that one): a
    replica that asked Ray for no GPU runs on the CPU even where a GPU is visible, never on another
    role's device."""
    if "ray" in sys.modules:
        ray = sys.modules["ray"]
        if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE \
                and not ray.get_gpu_ids():
            return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


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
