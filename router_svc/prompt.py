"""Chat messages -> prompt token ids, with each image's placeholder expanded to its token count.

The router only reads each image's header here (size -> resized grid -> token count); the pixels
are decoded by the encoder replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from epd import imaging, store
from epd.modelinfo import ModelInfo
from epd.v1 import epd_pb2

ROLES = ("system", "user", "assistant")
# Text may not smuggle in vision placeholders: they would be matched to images that aren't there.
RESERVED = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")


@dataclass(frozen=True)
class PromptImage:
    data: bytes
    info: imaging.ImageInfo
    store_key: str
    max_pixels: int  # the cap this request resized with; part of the key, sent to the encoder


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    images: list[PromptImage]  # in prompt order

    @property
    def num_image_tokens(self) -> int:
        return sum(image.info.num_tokens for image in self.images)


class PromptBuilder:
    def __init__(self, tokenizer, info: ModelInfo, settings: imaging.ImageSettings) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.settings = settings

    @classmethod
    def load(cls, model_dir: str, info: ModelInfo, max_decoded_pixels: int) -> PromptBuilder:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir), info, info.image_settings(max_decoded_pixels))

    def build(self, messages, max_pixels: int | None, enable_thinking: bool) -> Prompt:
        """Validate, template and tokenize; raises ValueError (INVALID_ARGUMENT) naming the problem."""
        settings = self.settings.with_max_pixels(max_pixels)
        chat, images = self._to_chat(messages, settings)
        text = self.tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Prompt(token_ids=self._expand_placeholders(ids, images), images=images)

    def _to_chat(self, messages, settings) -> tuple[list[dict], list[PromptImage]]:
        if not messages:
            raise ValueError("prompt is empty: the request has no messages")
        chat: list[dict] = []
        images: list[PromptImage] = []
        has_content = False
        for m_index, message in enumerate(messages):
            if message.role not in ROLES:
                raise ValueError(f"message {m_index} has role {message.role!r}; expected one of {', '.join(ROLES)}")
            parts = []
            for part in message.content:
                if part.WhichOneof("part") == "image":
                    images.append(self._image(part.image, len(images), settings))
                    parts.append({"type": "image"})
                    has_content = True
                elif part.WhichOneof("part") == "text":
                    self._check_text(part.text, m_index)
                    parts.append({"type": "text", "text": part.text})
                    has_content = has_content or bool(part.text.strip())
            chat.append({"role": message.role, "content": parts})
        if not has_content:
            raise ValueError("prompt is empty: no text and no images")
        return chat, images

    def _image(self, data: bytes, index: int, settings: imaging.ImageSettings) -> PromptImage:
        try:
            info = imaging.probe_image(data, settings)
        except imaging.ImageError as error:
            raise ValueError(f"image {index}: {error}") from None
        key = store.store_key(self.info.fingerprint, imaging.image_key(data, settings))
        return PromptImage(data=data, info=info, store_key=key, max_pixels=settings.max_pixels)

    @staticmethod
    def _check_text(text: str, m_index: int) -> None:
        for token in RESERVED:
            if token in text:
                raise ValueError(f"message {m_index} text contains the reserved token {token}; send images as image parts")

    def _expand_placeholders(self, ids: list[int], images: list[PromptImage]) -> list[int]:
        pad = self.info.image_token_id
        if ids.count(pad) != len(images):
            raise ValueError(f"chat template produced {ids.count(pad)} image placeholders for {len(images)} image(s)")
        out: list[int] = []
        remaining = iter(images)
        for token in ids:
            out.extend([pad] * next(remaining).info.num_tokens if token == pad else [token])
        return out


def request_images_proto(prompt: Prompt) -> list[epd_pb2.ImageRef]:
    return [
        epd_pb2.ImageRef(store_key=i.store_key, merged_height=i.info.merged_grid[0], merged_width=i.info.merged_grid[1])
        for i in prompt.images
    ]
