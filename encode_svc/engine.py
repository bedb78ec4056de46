"""One encoder replica: the vision tower and the image processor, publishing to the store.

A replica decodes the image bytes, resizes and patches them (the CPU-heavy preprocessing lives
here so it scales with the replicas, not in the router), runs the ViT with its 2x2 merge and
writes ``[num_tokens, hidden]`` embeddings to the store under the key the router chose. The
launcher wraps this class in ``ray.remote`` (with ``actor_options``); it knows nothing about gRPC.

Batching: the actor takes several ``encode`` calls at once (a threaded actor). Each call
preprocesses its own image in its own thread, then queues the patches for the one batching
thread, which concatenates queued images, oldest first, up to a patch budget (like vLLM's
encoder budget) and runs them through the ViT in one forward (the vision model takes
concatenated patches with a per-image grid; attention stays within each image). An image larger
than the budget runs alone, and the queue is first-in first-out, so no image waits behind
later ones for ever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from epd import (
    checkpoint,
    core_share,
    errors,
    forward_trace,
    imaging,
    kernels,
    kernels_prefill,
    limits,
    memory_plan,
    rpc,
    video,
)
from epd.config import ServeConfig
from epd.core_share import forward_turn
from epd.discovery import Membership, RoleContext
from epd.modelinfo import ModelInfo
from epd.store import Embedding, EmbeddingStore, StoreUnavailable, encode_value
from epd.tensors import configure_threads, default_device, freeze_startup_heap, parse_dtype, release_thread_team

log = logging.getLogger(__name__)

STOP = object()  # queued by ``stop``: the batching thread exits when it reaches it


@dataclass(frozen=True)
class EncodeResult:
    """Outcome of one image: its shape on success, or the bad-input message."""

    store_key: str
    num_tokens: int = 0
    grid_thw: tuple[int, int, int] = (0, 0, 0)
    encode_s: float = 0.0
    store_write_s: float = 0.0
    error: str = ""
    embedding: bytes = b""  # the value itself (store format), when asked or when the store was unreachable


@dataclass
class _Job:
    pixel_values: torch.Tensor | None
    grid_thw: tuple[int, int, int]
    done: Future
    cancelled: bool = False  # its caller went away: dropped before it reaches a forward

    @property
    def num_patches(self) -> int:
        return self.pixel_values.shape[0]


class EncoderEngine:
    @staticmethod
    def actor_options(serve: ServeConfig) -> dict:
        """How launchers create the actor: enough concurrent calls for images to queue up and batch."""
        return {"max_concurrency": serve.encode.actor_concurrency}

    def __init__(self, serve: ServeConfig, context: RoleContext) -> None:
        rpc.configure(serve.rpc)
        config = serve.encode
        configure_threads(config.num_threads, config.cpus)
        self.name = context.name
        # before a weight is read: a vision tower that cannot fit is refused in one line
        memory_plan.check_role(serve.model_dir, "encoder", serve, *memory_plan.device_available(default_device()))
        self.vision = checkpoint.build_vision_model(serve.model_dir, dtype=parse_dtype(config.dtype),
                                                    device=default_device())
        weight = next(self.vision.parameters())
        if config.prepack and kernels.can_prepack(weight.device, weight.dtype):
            kernels.prepack_linears(self.vision)  # oneDNN with pre-packed weights (docs/bench/kernels.md)
        # on a CPU: the patch embedding as a packed GEMM; in bfloat16 the attention through oneDNN (epd/kernels_prefill.py)
        kernels_prefill.use_for_vision(self.vision, prepack=config.prepack)
        # a vision forward of a second or more follows the co-located roles' comings and goings
        for block in getattr(self.vision, "blocks", ()):
            block.register_forward_pre_hook(lambda module, args: core_share.rebalance())
        info = ModelInfo.load(serve.model_dir)
        self.settings = info.image_settings(config.max_decoded_pixels)
        self.video_settings = info.video_settings()
        self.video_limits = limits.VideoLimits()
        self.store = EmbeddingStore.from_config(serve.store)
        self.max_batch_patches = config.max_batch_patches or (config.gpu_batch_patches if weight.device.type == "cuda"
                                                              else 1)
        self.lease_s, self.max_wait_s = config.lease_s, config.lease_wait_s
        self.num_encoded = 0
        self.num_joined = 0  # images another replica held the lease of: its result answered them
        self.num_batches = 0
        self.num_dropped = 0  # images cancelled before their forward
        self._jobs: dict[str, _Job] = {}  # the encodes this replica holds, by store key
        self._jobs_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._batch_loop, name="encode-batcher", daemon=True)
        self._thread.start()
        freeze_startup_heap()  # before it takes work: see epd/tensors.py
        self._membership = None
        if context.registry is not None:  # a replica of a deployment: callers find it in the registry
            self._membership = Membership(context)  # callers reach it by its actor name
        release_thread_team()  # the batcher thread runs the forwards (epd/tensors.py)

    def ready(self) -> bool:
        return True

    def device_info(self) -> dict:
        from epd.tensors import device_info

        return device_info()

    def ping(self) -> bool:
        return True

    WAIT_POLL_S = 0.05  # how often an image whose encode another replica holds looks for the result

    def encode(self, store_key: str, data: bytes, max_pixels: int, inline: bool = False,
               video_chunk: tuple | None = None) -> EncodeResult:
        """Encode one image and publish it to the store; the embedding also comes back in the
        result when ``inline`` or when the store cannot be reached. Bad input comes back as
        ``error``, never raised.

        One vision forward per image across the deployment: before its forward the replica takes
        the image's lease in the store (``EmbeddingStore.take_lease``). When another replica, of
        any Encoder service, holds it, this one waits for that replica's result to appear in the
        store and answers with it (``encode_s`` is the wait, nothing is computed); when the lease
        goes without a result (its holder died: the lease expires within ``encode.lease_s``) it tries to
        take it itself. With ``inline`` (the store is out of reach) it encodes at once.

        ``video_chunk`` ``(fps, max_frames, max_pixels, first_patch, num_patches)``: ``data`` is a clip and
        this item is those temporal patches of it (``epd.video``), encoded as one vision forward."""
        if not inline:
            joined = self._join_or_lease(store_key)
            if joined is not None:
                return joined
            renewer = self._renew_while_encoding(store_key)
            try:
                return self._encode(store_key, data, max_pixels, inline, video_chunk)
            finally:
                renewer.set()
                with contextlib.suppress(StoreUnavailable):
                    self.store.release_lease(store_key, self.name)
        return self._encode(store_key, data, max_pixels, inline, video_chunk)

    def _join_or_lease(self, store_key: str) -> EncodeResult | None:
        """None once this replica holds the lease (or the store is out of reach: encode anyway);
        else the result another replica published."""
        start = time.perf_counter()
        try:
            while time.perf_counter() - start < self.max_wait_s:
                (found,) = self.store.get_many([store_key])
                if found is not None:
                    self.num_joined += 1
                    return EncodeResult(store_key=store_key, num_tokens=found.tensor.shape[0],
                                        grid_thw=tuple(found.grid_thw), encode_s=time.perf_counter() - start)
                if self.store.take_lease(store_key, self.name, self.lease_s):
                    return None
                time.sleep(self.WAIT_POLL_S)
        except StoreUnavailable:
            return None
        return None  # waited long enough for a holder that never finishes: compute it here

    def _renew_while_encoding(self, store_key: str) -> threading.Event:
        done = threading.Event()

        def renew() -> None:
            while not done.wait(self.lease_s / 3):
                with contextlib.suppress(StoreUnavailable):
                    self.store.renew_lease(store_key, self.name, self.lease_s)

        threading.Thread(target=renew, name="encode-lease", daemon=True).start()
        return done

    def _encode(self, store_key: str, data: bytes, max_pixels: int, inline: bool,
                video_chunk: tuple | None = None) -> EncodeResult:
        start = time.perf_counter()
        job = _Job(None, (0, 0, 0), Future())
        with self._jobs_lock:
            self._jobs[store_key] = job
        try:
            try:
                job.pixel_values, job.grid_thw = self._pixels(data, max_pixels, video_chunk)
            except (imaging.ImageError, video.VideoError) as error:
                return EncodeResult(store_key=store_key, error=str(error))
            grid_thw = job.grid_thw
            self._queue.put(job)
            embeds = job.done.result()  # the batch's exception (or the cancel), if any, is raised here
        finally:
            with self._jobs_lock:
                if self._jobs.get(store_key) is job:
                    del self._jobs[store_key]
        embedding = Embedding(tensor=embeds, grid_thw=grid_thw)
        written = time.perf_counter()
        try:
            self.store.put(store_key, embedding)
        except StoreUnavailable:
            inline = True  # the caller carries it to prefill instead
        end = time.perf_counter()
        return EncodeResult(
            store_key=store_key,
            num_tokens=embeds.shape[0],
            grid_thw=grid_thw,
            encode_s=end - start,
            store_write_s=end - written,
            embedding=encode_value(store_key, embedding) if inline else b"",
        )

    def _pixels(self, data: bytes, max_pixels: int, video_chunk: tuple | None):
        if video_chunk is None:
            return imaging.load_pixels(data, self.settings.with_max_pixels(max_pixels or None))
        fps, max_frames, clip_pixels, first, count = video_chunk
        settings = self.video_settings.with_overrides(fps=fps or None, max_frames=max_frames or None,
                                                      max_pixels=clip_pixels or None, caps=self.video_limits)
        return video.load_chunk_pixels(data, settings, first, count, self.video_limits)

    def cancel(self, store_key: str) -> bool:
        """Nobody waits for this image any more: drop it if it has not reached a forward yet."""
        with self._jobs_lock:
            job = self._jobs.get(store_key)
            if job is None:
                return False
            job.cancelled = True
            return True

    def stop(self) -> None:
        if self._membership is not None:
            self._membership.close()
        self._queue.put(STOP)
        self._thread.join(timeout=10)

    def _batch_loop(self) -> None:
        carry = None
        while True:
            first = carry or self._queue.get()
            if first is STOP:
                return
            batch, carry = next_batch(first, self._queue, self.max_batch_patches)
            for job in [j for j in batch if j.cancelled]:
                self.num_dropped += 1
                job.done.set_exception(errors.Cancelled("encode: cancelled before its forward"))
            batch = [j for j in batch if not j.cancelled]
            if not batch:
                continue
            try:
                outputs = self._run_vision([j.pixel_values for j in batch], [j.grid_thw for j in batch])
            except Exception as error:  # noqa: BLE001 - fail this batch's calls, keep serving
                log.exception("vision forward failed for a batch of %d images", len(batch))
                for j in batch:
                    j.done.set_exception(error)
                continue
            self.num_batches += 1
            self.num_encoded += len(batch)
            for j, out in zip(batch, outputs):
                j.done.set_result(out)

    @torch.inference_mode()
    def _run_vision(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Images' patches -> each image's merged embeddings ``[num_patches / 4, out_hidden]``, one forward."""
        weight = next(self.vision.parameters())
        grid = torch.tensor(grids, dtype=torch.long, device=weight.device)
        patches = torch.cat(pixel_values).to(weight.device, weight.dtype)
        forward_trace.note(images=len(grids), patches=int(patches.shape[0]))
        with forward_turn():
            out = self.vision(patches, grid_thw=grid).pooler_output.to("cpu")
        merge = self.vision.spatial_merge_size**2
        sizes = [t * h * w // merge for t, h, w in grids]
        return [piece.contiguous() for piece in torch.split(out, sizes)]

    def stats(self) -> dict[str, int]:
        return {"num_encoded": self.num_encoded, "num_batches": self.num_batches, "num_dropped": self.num_dropped,
                "num_joined": self.num_joined, "pid": os.getpid()}


def next_batch(first, waiting: queue.Queue, max_patches: int) -> tuple[list, object | None]:
    """``first`` plus whatever already waits, oldest first, while the patches fit ``max_patches``.

    Returns the batch and the item that did not fit or STOP (it leads the next batch), or None. ``first``
    always runs, however large: a huge image gets a forward of its own instead of waiting.
    """
    batch, patches = [first], first.num_patches
    while True:
        try:
            item = waiting.get_nowait()
        except queue.Empty:
            return batch, None
        if item is STOP or patches + item.num_patches > max_patches:
            return batch, item
        batch.append(item)
        patches += item.num_patches
