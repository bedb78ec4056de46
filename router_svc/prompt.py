"""Chat messages -> prompt token ids, with each image's placeholder expanded to its token count.

The router only reads each image's header here (size -> resized grid -> token count); the pixels
are decoded by the encoder replicas. Client text is plain text (``router_svc.tokens``): control
tokens in it are the characters they are, unless the router trusts its callers
(``router.allow_special_tokens``); only the model's own structure in an assistant message
(``<think>``, ``</think>``, the tool-call markers) stays tokens, as transformers renders it. A
conversation the chat template refuses (its ``raise_exception``) is the client's error. Limits are
checked before anything is rendered or tokenized: images per request, messages and parts, and the
characters of text the context window can hold.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from epd import imaging, limits, store, video
from epd.modelinfo import ModelInfo
from epd.v1 import epd_pb2
from router_svc.tokens import PlainText

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
MAX_TOOLS = 128  # functions a request may offer
MAX_NAME_CHARS = 256  # a message's name
# The model's own structure in its answers: in an assistant message these are tokens, as the
# template renders them (and as transformers tokenizes them), so the template can find and strip
# earlier reasoning. Everywhere else, and every other added token (the role markers) everywhere,
# client text is plain text.
ASSISTANT_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# Text may not smuggle in vision placeholders: they would be matched to images that aren't there.
RESERVED = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")


@dataclass(frozen=True)
class ChunkInfo:
    """The shape of one chunk of a clip: ``grid_thw[0]`` temporal patches of ``h x w`` patches."""

    grid_thw: tuple[int, int, int]
    merge_size: int = 2

    @property
    def merged_grid(self) -> tuple[int, int]:
        _, h, w = self.grid_thw
        return h // self.merge_size, w // self.merge_size

    @property
    def num_tokens(self) -> int:
        h, w = self.merged_grid
        return self.grid_thw[0] * h * w


@dataclass(frozen=True)
class PromptImage:
    """One encoder item: an image, or a chunk of a clip's temporal patches (``video`` set)."""

    data: bytes
    info: imaging.ImageInfo | ChunkInfo
    store_key: str
    max_pixels: int  # the cap this request resized with; part of the key, sent to the encoder
    video: epd_pb2.VideoChunk | None = None


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    images: list[PromptImage]  # encoder items (images and clip chunks) in prompt order
    videos: tuple[video.VideoInfo, ...] = ()  # the clips, in prompt order

    @property
    def num_image_tokens(self) -> int:
        return sum(image.info.num_tokens for image in self.images if image.video is None)

    @property
    def num_video_tokens(self) -> int:
        return sum(clip.num_tokens for clip in self.videos)

    @property
    def num_pictures(self) -> int:
        """Images alone, clip chunks not counted."""
        return sum(image.video is None for image in self.images)


class PromptBuilder:
    def __init__(self, tokenizer, info: ModelInfo, settings: imaging.ImageSettings, *, max_model_len: int = 0,
                 max_images: int = 16, allow_special_tokens: bool = False,
                 video_settings: video.VideoSettings | None = None, video_chunk_patches: int = 4,
                 video_limits: limits.VideoLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.settings = settings
        self.video_settings = video_settings or video.VideoSettings()
        self.video_chunk_patches = video_chunk_patches
        self.video_limits = video_limits or limits.VideoLimits()
        self.max_model_len = max_model_len or info.max_position_embeddings
        self.max_images = max_images
        self.allow_special_tokens = allow_special_tokens
        self.plain = PlainText(tokenizer)
        kept = [token for token in ASSISTANT_TOKENS if token in self.plain.added]  # those this tokenizer has
        self._assistant_tokens = re.compile("(" + "|".join(map(re.escape, kept)) + ")") if kept else None
        # Text longer than this cannot fit the context window whatever it says: refused untokenized.
        self.max_text_chars = self.plain.max_chars(self.max_model_len)

    @classmethod
    def load(cls, model_dir: str, info: ModelInfo, max_decoded_pixels: int, **limits) -> PromptBuilder:
        """``limits``: ``max_model_len``, ``max_images``, ``allow_special_tokens``, ``video_chunk_patches``
        (see ``__init__``)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir), info, info.image_settings(max_decoded_pixels),
                   video_settings=info.video_settings(), **limits)

    def build(self, messages, max_pixels: int | None, enable_thinking: bool, add_generation_prompt: bool = True,
              tools_json: str = "") -> Prompt:
        """Validate, template and tokenize; raises ValueError (INVALID_ARGUMENT) naming the problem.
        ``add_generation_prompt`` False (``POST /tokenize`` may ask) leaves out the assistant header.
        ``tools_json``: the functions the model may call (``GenerateRequest.tools_json``), given to
        the chat template as transformers' ``apply_chat_template(..., tools=...)`` does."""
        self._check_limits(messages)
        settings = self.settings.with_max_pixels(max_pixels)
        tools = self._tools(tools_json)
        chat, images, clips = self._to_chat(messages, settings)
        extra = {"tools": tools} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=add_generation_prompt,
                enable_thinking=bool(enable_thinking), **extra
            )
        except TemplateError as error:
            if type(error) is not TemplateError:  # a subclass: the template itself is broken (syntax, undefined)
                raise
            # The template's raise_exception: it refuses this conversation (no user turn, an image in
            # a system message, ...). The client's error, in the template's own words.
            log.info("chat template refused the conversation: %s", error.message)
            raise ValueError(f"the model's chat template refuses this conversation: {error.message}") from None
        if self.allow_special_tokens:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.plain.encode(text)
        ids = self._expand_video_placeholders(ids, clips)
        items = self._in_prompt_order(messages, images, clips)
        return Prompt(token_ids=self._expand_placeholders(ids, [i for i in items if i.video is None]), images=items,
                      videos=tuple(clip for clip, _ in clips))

    def build_completion(self, text: str, token_ids) -> Prompt:
        """A completion's prompt, no template: ``text`` tokenized as plain text (as written with
        ``allow_special_tokens``), or ``token_ids`` as they are. Raises ValueError naming the problem."""
        if text and token_ids:
            raise ValueError("send prompt or prompt_token_ids, not both")
        if token_ids:
            ids = list(token_ids)
            if len(ids) > self.max_model_len:
                raise ValueError(f"prompt_token_ids has {len(ids)} tokens, more than the context window of "
                                 f"{self.max_model_len}")
            vocab = self.info.vocab_size or len(self.tokenizer)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids: {bad} is not a token id of this model (0 to {vocab - 1})")
            reserved = {self.info.image_token_id, self.info.vision_start_token_id, self.info.vision_end_token_id}
            reserved |= {self.plain.added[t] for t in RESERVED if t in self.plain.added}
            bad = next((t for t in ids if t in reserved), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids holds the vision token {bad}: a completion has no images")
            return Prompt(token_ids=ids, images=[])
        if not text:
            raise ValueError("prompt is empty")
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            raise ValueError(f"prompt is {len(text)} characters, more than a context window of "
                             f"{self.max_model_len} tokens can hold")
        if self.allow_special_tokens:
            for token in RESERVED:
                if token in text:
                    raise ValueError(f"prompt contains the reserved token {token}: a completion has no images")
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.plain.encode_text(text)
        if not ids:
            raise ValueError("prompt is empty")
        return Prompt(token_ids=ids, images=[])

    def _check_limits(self, messages) -> None:
        """What a request may hold, checked before any of it is rendered, probed or tokenized."""
        if not messages:
            raise ValueError("prompt is empty: the request has no messages")
        # A message costs at least its turn's tokens; more messages and parts than the window has
        # tokens are not worth rendering (thousands of empty parts would only cost time).
        num_parts = sum(len(message.content) for message in messages)
        if len(messages) + num_parts > self.max_model_len:
            raise ValueError(f"request has {len(messages)} messages with {num_parts} content parts; a context "
                             f"window of {self.max_model_len} tokens cannot hold them")
        num_images = sum(part.WhichOneof("part") in ("image", "video") for message in messages
                         for part in message.content)
        if num_images > self.max_images:
            raise ValueError(f"request has {num_images} images; at most {self.max_images} images per request "
                             "are allowed (router.max_images_per_request; a video clip counts as an image)")
        if self.max_text_chars is not None:
            chars = sum(len(part.text) for message in messages for part in message.content)
            if chars > self.max_text_chars:
                raise ValueError(
                    f"prompt text is {chars} characters, more than the {self.max_text_chars} characters a context "
                    f"window of {self.max_model_len} tokens can hold (a token is at most "
                    f"{self.plain.longest_token_bytes} bytes); refused without tokenizing")

    @property
    def renders_tools(self) -> bool:
        """The checkpoint's chat template renders ``tools`` (and the calls in the history)."""
        return "tools" in str(getattr(self.tokenizer, "chat_template", "") or "")

    def _plain(self, value):
        """Client data for the template (tools, call arguments): every string in it plain text."""
        if self.allow_special_tokens:
            return value
        if isinstance(value, str):
            return self.plain.escape(value)
        if isinstance(value, list):
            return [self._plain(item) for item in value]
        if isinstance(value, dict):
            return {self._plain(key): self._plain(item) for key, item in value.items()}
        return value

    def _tools(self, tools_json: str) -> list | None:
        if not tools_json:
            return None
        if self.max_text_chars is not None and len(tools_json) > self.max_text_chars:
            raise ValueError(f"tools are {len(tools_json)} characters, more than a context window of "
                             f"{self.max_model_len} tokens can hold")
        if not self.renders_tools:
            raise ValueError("tools: this model's chat template does not render tools")
        try:
            tools = json.loads(tools_json)
        except ValueError as error:
            raise ValueError(f"tools is not valid JSON: {error}") from None
        if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
            raise ValueError(f"tools must be a list of 1 to {MAX_TOOLS} functions")
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                    or not isinstance(function.get("name"), str) or not function["name"]):
                raise ValueError(f'tools[{index}] must be {{"type": "function", "function": {{"name": STR, '
                                 '"description": STR, "parameters": {JSON Schema}}}}}')
            if "parameters" in function and not isinstance(function["parameters"], dict):
                raise ValueError(f"tools[{index}].function.parameters must be a JSON Schema (an object)")
        return self._plain(tools)

    def _to_chat(self, messages, settings) -> tuple[list[dict], list[PromptImage], list]:
        chat: list[dict] = []
        images: list[PromptImage] = []
        clips: list[tuple[video.VideoInfo, list[PromptImage]]] = []
        frames = 0
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
                elif part.WhichOneof("part") == "video":
                    clips.append(self._video(part.video, len(clips)))
                    frames += len(clips[-1][0].indices)
                    if frames > self.video_limits.max_frames_per_request:
                        raise ValueError(f"request samples {frames} video frames, above the limit of "
                                         f"{self.video_limits.max_frames_per_request} per request "
                                         "(limits.VideoLimits.max_frames_per_request)")
                    parts.append({"type": "video"})
                    has_content = True
                elif part.WhichOneof("part") == "text":
                    if self.allow_special_tokens:
                        self._check_text(part.text, m_index)
                        parts.append({"type": "text", "text": part.text})
                    else:  # plain text: vision placeholders in it are characters too, harmless
                        parts.append({"type": "text", "text": self._escape(part.text, message.role)})
                    has_content = has_content or bool(part.text.strip())
            entry = {"role": message.role, "content": parts}
            if message.tool_calls:
                if message.role != "assistant":
                    raise ValueError(f"message {m_index}: only an assistant message has tool_calls")
                if not self.renders_tools:
                    raise ValueError(f"message {m_index}: this model's chat template does not render tool_calls")
                entry["tool_calls"] = [self._call(call, m_index) for call in message.tool_calls]
            if message.role == "tool":
                if not self.renders_tools:
                    raise ValueError(f"message {m_index}: this model's chat template does not render tool messages")
                entry["tool_call_id"] = self._plain(message.tool_call_id)
            if message.name:  # for a template that renders it (Qwen3.5's does not); plain text like all client text
                if len(message.name) > MAX_NAME_CHARS:
                    raise ValueError(f"message {m_index} name is {len(message.name)} characters; at most {MAX_NAME_CHARS}")
                entry["name"] = message.name if self.allow_special_tokens else self.plain.escape(message.name)
            chat.append(entry)
        if not has_content:
            raise ValueError("prompt is empty: no text and no images")
        return chat, images, clips

    def _call(self, call, m_index: int) -> dict:
        """A call of the history as templates read it: the arguments an object (vLLM and
        transformers parse OpenAI's JSON text the same way)."""
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            raise ValueError(f"message {m_index}: tool call {call.name!r} arguments are not valid JSON") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"message {m_index}: tool call {call.name!r} arguments must be a JSON object")
        return {"id": self._plain(call.id), "type": "function",
                "function": {"name": self._plain(call.name), "arguments": self._plain(arguments)}}

    def _escape(self, text: str, role: str) -> str:
        """Client text as the template must see it: plain text, except the model's own structure
        tokens in an assistant message (``ASSISTANT_TOKENS``), which stay as they are."""
        if role != "assistant" or self._assistant_tokens is None:
            return self.plain.escape(text)
        pieces = self._assistant_tokens.split(text)  # text, token, text, ..., text
        return "".join(piece if index % 2 else self.plain.escape(piece) for index, piece in enumerate(pieces))

    def _image(self, data: bytes, index: int, settings: imaging.ImageSettings) -> PromptImage:
        try:
            info = imaging.probe_image(data, settings)
        except imaging.ImageError as error:
            raise ValueError(f"image {index}: {error}") from None
        key = store.store_key(self.info.fingerprint, imaging.image_key(data, settings))
        return PromptImage(data=data, info=info, store_key=key, max_pixels=settings.max_pixels)

    def _video(self, part: epd_pb2.VideoPart, index: int) -> tuple[video.VideoInfo, list[PromptImage]]:
        """Probe a clip's header (nothing decoded) and cut it into encoder chunks, each keyed by
        the clip's bytes, every setting that changes its embeddings, and its range."""
        try:
            settings = self.video_settings.with_overrides(
                fps=part.fps if part.HasField("fps") else None,
                max_frames=part.max_frames if part.HasField("max_frames") else None,
                max_pixels=part.max_pixels if part.HasField("max_pixels") else None, caps=self.video_limits)
            info = video.probe_video(part.data, settings, self.video_limits)
        except video.VideoError as error:
            raise ValueError(f"video {index}: {error}") from None
        _, h, w = info.grid_thw
        chunks = []
        for first, count in video.chunks(info.grid_thw[0], self.video_chunk_patches):
            key = store.store_key(self.info.fingerprint, video.chunk_key(part.data, settings, first, count))
            spec = epd_pb2.VideoChunk(fps=settings.fps, max_frames=settings.max_frames, max_pixels=settings.max_pixels,
                                      first_patch=first, num_patches=count)
            chunks.append(PromptImage(data=part.data, info=ChunkInfo((count, h, w), settings.merge_size),
                                      store_key=key, max_pixels=0, video=spec))
        return info, chunks

    @staticmethod
    def _in_prompt_order(messages, images: list[PromptImage], clips) -> list[PromptImage]:
        """Images and clip chunks in the order their parts come."""
        image_iter, clip_iter = iter(images), iter(clips)
        out: list[PromptImage] = []
        for message in messages:
            for part in message.content:
                kind = part.WhichOneof("part")
                if kind == "image":
                    out.append(next(image_iter))
                elif kind == "video":
                    out.extend(next(clip_iter)[1])
        return out

    def _expand_video_placeholders(self, ids: list[int], clips) -> list[int]:
        pad = self.info.video_token_id
        if not clips:
            return ids
        if ids.count(pad) != len(clips):
            raise ValueError(f"chat template produced {ids.count(pad)} video placeholders for {len(clips)} clip(s)")
        out: list[int] = []
        remaining = iter(clips)
        for token in ids:
            if token == pad:
                out.extend(video.prompt_token_ids(next(remaining)[0], self.plain.encode_text,
                                                  self.info.vision_start_token_id, self.info.vision_end_token_id, pad))
            else:
                out.append(token)
        return out

    @staticmethod
    def _check_text(text: str, m_index: int) -> None:
        """With special tokens allowed: vision placeholders would be matched to images that aren't there."""
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
        epd_pb2.ImageRef(store_key=i.store_key, merged_height=i.info.merged_grid[0], merged_width=i.info.merged_grid[1],
                         temporal_patches=i.video.num_patches if i.video is not None else 0)
        for i in prompt.images
    ]
