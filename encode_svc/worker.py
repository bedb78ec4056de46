"""One encoder replica: the vision tower and the image processor, publishing to the store.

A replica decodes the image bytes, resizes and patches them (the CPU-heavy preprocessing lives
here so it scales with the replicas, not in the router), runs the ViT with its 2x2 merge and
writes ``[num_tokens, hidden]`` embeddings to the store under the key the router chose. The
launcher wraps this class in ``ray.remote``; it knows nothing about gRPC.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from epd import checkpoint, imaging
from epd.tensors import default_device
from epd.store import Embedding, EmbeddingStore


@dataclass(frozen=True)
class EncodeResult:
    """Outcome of one image: its shape on success, or the bad-input message."""

    store_key: str
    num_tokens: int = 0
    grid_thw: tuple[int, int, int] = (0, 0, 0)
    encode_s: float = 0.0
    store_write_s: float = 0.0
    error: str = ""


class EncoderWorker:
    def __init__(
        self, model_dir: str, redis_url: str, ttl_s: int, max_decoded_pixels: int, num_threads: int = 0
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.vision = checkpoint.build_vision_model(model_dir, device=default_device())
        self.settings = imaging.ImageSettings.from_preprocessor_config(
            os.path.join(model_dir, "preprocessor_config.json"), max_decoded_pixels=max_decoded_pixels
        )
        self.store = EmbeddingStore(redis_url, ttl_s=ttl_s)
        self.num_encoded = 0

    def ready(self) -> bool:
        return self.store.ping()

    def encode(self, store_key: str, data: bytes, max_pixels: int) -> EncodeResult:
        """Encode one image and publish it; bad input comes back as ``error``, never raised."""
        start = time.perf_counter()
        try:
            settings = self.settings.with_max_pixels(max_pixels or None)
            pixel_values, grid_thw = imaging.load_pixels(data, settings)
        except imaging.ImageError as error:
            return EncodeResult(store_key=store_key, error=str(error))
        embeds = self._run_vision(pixel_values, grid_thw)
        written = time.perf_counter()
        self.store.put(store_key, Embedding(tensor=embeds, grid_thw=grid_thw))
        self.num_encoded += 1
        end = time.perf_counter()
        return EncodeResult(
            store_key=store_key,
            num_tokens=embeds.shape[0],
            grid_thw=grid_thw,
            encode_s=end - start,
            store_write_s=end - written,
        )

    @torch.inference_mode()
    def _run_vision(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """``[num_patches, patch_dim]`` -> merged embeddings ``[num_patches / 4, out_hidden]``."""
        weight = next(self.vision.parameters())
        grid = torch.tensor([grid_thw], dtype=torch.long, device=weight.device)
        out = self.vision(pixel_values.to(weight.device, weight.dtype), grid_thw=grid)
        return out.pooler_output.to("cpu").contiguous()

    def stats(self) -> dict[str, int]:
        return {"num_encoded": self.num_encoded, "pid": os.getpid()}
