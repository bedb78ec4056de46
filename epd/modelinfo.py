"""What every role needs to know about a checkpoint, read once from its directory."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from epd import checkpoint, imaging, video


@dataclass(frozen=True)
class ModelInfo:
    model_dir: str
    fingerprint: str  # identifies the weights in store keys: another model never reads these embeddings
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: frozenset[int]
    max_position_embeddings: int
    hidden_size: int
    im_start_token_id: int | None = None  # <|im_start|>: where each chat turn begins (None if the tokenizer lacks it)
    vocab_size: int = 0  # the language model's vocabulary (token ids a request may name are below it); 0: unknown
    video_token_id: int | None = None  # <|video_pad|>

    def video_settings(self) -> video.VideoSettings:
        """The checkpoint's video_preprocessor_config.json over Qwen3VLVideoProcessor's defaults."""
        return video.VideoSettings.from_config(os.path.join(self.model_dir, "video_preprocessor_config.json"))

    def image_settings(self, max_decoded_pixels: int) -> imaging.ImageSettings:
        """The checkpoint's preprocessing settings (preprocessor_config.json) with the decode ceiling."""
        return imaging.ImageSettings.from_preprocessor_config(
            os.path.join(self.model_dir, "preprocessor_config.json"), max_decoded_pixels=max_decoded_pixels)

    @classmethod
    def load(cls, model_dir: str) -> ModelInfo:
        config = checkpoint.read_config(model_dir)
        return cls(
            model_dir=model_dir,
            fingerprint=checkpoint.model_fingerprint(model_dir)[:32],
            image_token_id=config.image_token_id,
            vision_start_token_id=config.vision_start_token_id,
            vision_end_token_id=config.vision_end_token_id,
            eos_token_ids=frozenset(_eos_ids(model_dir, config.text_config.eos_token_id)),
            max_position_embeddings=config.text_config.max_position_embeddings,
            hidden_size=config.text_config.hidden_size,
            im_start_token_id=_added_token_id(model_dir, "<|im_start|>"),
            vocab_size=config.text_config.vocab_size,
            video_token_id=getattr(config, "video_token_id", None),
        )


def _added_token_id(model_dir: str, content: str) -> int | None:
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        added = json.load(f).get("added_tokens", [])
    return next((token["id"] for token in added if token.get("content") == content), None)


def _eos_ids(model_dir: str, fallback: int | list[int] | None) -> list[int]:
    """generation_config.json's eos ids (what generate stops on), else the config's."""
    path = os.path.join(model_dir, "generation_config.json")
    value = fallback
    if os.path.isfile(path):
        with open(path) as f:
            value = json.load(f).get("eos_token_id", fallback)
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
