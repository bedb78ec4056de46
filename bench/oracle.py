"""The correctness oracle: transformers' own Qwen3_5ForConditionalGeneration.generate (or
Qwen3_5MoeForConditionalGeneration's for a mixture-of-experts checkpoint: ``epd.family``).

Inputs are built the way Qwen3VLProcessor builds them (chat template, each <|image_pad|> expanded
to the image's token count, Qwen2VLImageProcessorPil pixels of the image turned upright by its EXIF
orientation, as transformers' load_image does), independently of epd's router code. With
``split_special_tokens`` the client's text is tokenized as plain text (transformers'
``split_special_tokens=True`` on each text part) between the template's own tokens.
The benchmark's transformers baseline runs through it too (any dtype, whole conversations).

Video parts go through transformers' own pipeline: ``video_utils.load_video(backend="pyav")``, its
``Qwen3VLVideoProcessor`` (sampling, smart_resize, patchify) and ``Qwen3VLProcessor``'s
``replace_video_token`` (timestamps, placeholders). transformers' processor calls torchvision for two
steps, and torchvision cannot import in epd's venv (``scripts/video_ref_env.py``); ``_VideoProcessor``
replaces just those two with what torchvision 0.28 runs on CPU for them: ``resize`` is
``torch.nn.functional.interpolate`` (bicubic, antialias) on the uint8 frames, ``normalize`` is
``sub_(mean).div_(std)``. tests/test_video_reference.py (slow) checks this against the unmodified
processor in that venv.
"""

from __future__ import annotations

import copy
import io

import torch
from PIL import Image, ImageOps
from transformers import AutoTokenizer
from transformers.generation.streamers import BaseStreamer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import logging as transformers_logging

from epd.family import family_of, model_kwargs


def _video_processor_class():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

    class _VideoProcessor(Qwen3VLVideoProcessor):
        def resize(self, videos, size, resample, factor, temporal_factor, cap_pixels_per_frame=None, **kwargs):
            # Qwen3VLVideoProcessor.resize up to its call of torchvision's resize (no per-frame cap: 5.24's default)
            num_frames = videos.shape[1]
            height, width = videos.shape[-2:]
            new_h, new_w = smart_resize(num_frames=num_frames, height=height, width=width, factor=factor,
                                        temporal_factor=temporal_factor, min_pixels=size.shortest_edge,
                                        max_pixels=size.longest_edge)
            if (new_h, new_w) == (height, width):
                return videos
            flat = videos.reshape(-1, *videos.shape[-3:])
            out = torch.nn.functional.interpolate(flat, size=[new_h, new_w], mode="bicubic", align_corners=False,
                                                  antialias=True)
            return out.reshape(*videos.shape[:-2], new_h, new_w)

        def normalize(self, image, mean, std, inplace=False, **kwargs):
            mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
            return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)

    return _VideoProcessor


def video_inputs(model_dir: str, clips: list[dict]) -> tuple[dict, list[str]]:
    """transformers' ``pixel_values_videos``/``video_grid_thw`` for clips ``{"video": bytes, "fps"?,
    "max_frames"?, "max_pixels"?}`` and each clip's prompt text (what replaces its ``<|video_pad|>``)."""
    import os
    import tempfile
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import load_video

    processor = _video_processor_class().from_pretrained(model_dir)
    pixels, grids, texts = [], [], []
    for clip in clips:
        with tempfile.NamedTemporaryFile(suffix=".video", delete=False) as f:
            f.write(clip["video"])
        try:
            frames, metadata = load_video(f.name, backend="pyav")
        finally:
            os.unlink(f.name)
        kwargs = {"fps": clip["fps"]} if clip.get("fps") else {}
        if clip.get("max_frames"):
            kwargs["max_frames"] = clip["max_frames"]
        if clip.get("max_pixels"):
            kwargs["size"] = {"shortest_edge": processor.size.shortest_edge, "longest_edge": clip["max_pixels"]}
        out = processor(videos=[frames], video_metadata=[metadata], return_tensors="pt", return_metadata=True,
                        do_convert_rgb=False, cap_pixels_per_frame=False, **kwargs)
        this = SimpleNamespace(video_processor=processor, vision_start_token="<|vision_start|>",
                               vision_end_token="<|vision_end|>", video_token="<|video_pad|>")
        this._calculate_timestamps = lambda *args: Qwen3VLProcessor._calculate_timestamps(this, *args)
        texts.append(Qwen3VLProcessor.replace_video_token(this, out, 0))
        pixels.append(out["pixel_values_videos"])
        grids.append(out["video_grid_thw"])
    return {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.cat(grids)}, texts

# A chat message: {"role": ..., "content": str | [{"type": "image", "image": bytes} | {"type": "text", "text": str}]}
ChatMessage = dict


class Oracle:
    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        family = family_of(model_dir)
        self.model = family.conditional_generation.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), **model_kwargs(family)).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.image_token_id = self.model.config.image_token_id
        self.video_token_id = self.model.config.video_token_id
        self.model_dir = model_dir

    def inputs(self, prompt: str, images: list[bytes], max_pixels: int | None = None,
               split_special_tokens: bool = False) -> dict:
        """One user turn: the images first, then the text."""
        content = [{"type": "image", "image": data} for data in images] + [{"type": "text", "text": prompt}]
        return self.chat_inputs([{"role": "user", "content": content}], max_pixels, split_special_tokens)

    def chat_inputs(self, messages: list[ChatMessage], max_pixels: int | None = None,
                    split_special_tokens: bool = False) -> dict:
        """``generate`` keyword arguments for a conversation: each message's content is a string or
        a list of ``{"type": "text", "text": str}`` / ``{"type": "image", "image": bytes}`` parts;
        images in the order they appear. ``split_special_tokens``: special tokens in the text parts
        are plain text (the template's own stay special)."""
        chat, images, texts, clips = [], [], [], []
        for message in messages:
            content = message["content"]
            if isinstance(content, str) and not split_special_tokens:
                chat.append({"role": message["role"], "content": content})
                continue
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            images += [part["image"] for part in content if part["type"] == "image"]
            clips += [part for part in content if part["type"] == "video"]
            parts = []
            for part in content:
                if part["type"] in ("image", "video"):
                    parts.append({"type": part["type"]})
                elif split_special_tokens:  # a marker now, tokenized on its own below
                    parts.append({"type": "text", "text": f"\x00{len(texts)}\x00"})
                    texts.append(part["text"])
                else:
                    parts.append(part)
            chat.append({"role": message["role"], "content": parts})
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=False)
        out: dict = {}
        if images:
            size = {"shortest_edge": self.processor.size.shortest_edge,
                    "longest_edge": max_pixels or self.processor.size.longest_edge}
            pil = [ImageOps.exif_transpose(Image.open(io.BytesIO(data))) for data in images]
            pixels = self.processor(images=pil, return_tensors="pt", size=size)
            out["pixel_values"] = pixels["pixel_values"].to(self.model.dtype)
            out["image_grid_thw"] = pixels["image_grid_thw"]
            pieces = text.split("<|image_pad|>")
            counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
            text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
        if clips:
            video, replacements = video_inputs(self.model_dir, clips)
            out["pixel_values_videos"] = video["pixel_values_videos"].to(self.model.dtype)
            out["video_grid_thw"] = video["video_grid_thw"]
            pieces = text.split("<|video_pad|>")
            text = pieces[0] + "".join(r + rest for r, rest in zip(replacements, pieces[1:]))
        if split_special_tokens:
            pieces = text.split("\x00")  # template, text 0, template, text 1, ..., template
            ids = torch.tensor([[token for index, piece in enumerate(pieces) for token in self.tokenizer(
                texts[int(piece)] if index % 2 else piece, add_special_tokens=False,
                split_special_tokens=bool(index % 2))["input_ids"]]])
        else:
            ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out["input_ids"] = ids
        out["mm_token_type_ids"] = (ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int()
        return out

    def generate(self, prompt: str, images: list[bytes] = (), max_new_tokens: int = 32,
                 max_pixels: int | None = None, split_special_tokens: bool = False) -> tuple[list[int], torch.Tensor, int]:
        """Greedy tokens, the first token's logits, and the prompt length."""
        return self._generate(self.inputs(prompt, list(images), max_pixels, split_special_tokens), max_new_tokens)

    def generate_chat(self, messages: list[ChatMessage], max_new_tokens: int = 32,
                      max_pixels: int | None = None, split_special_tokens: bool = False
                      ) -> tuple[list[int], torch.Tensor, int]:
        """``generate`` for a whole conversation (see ``chat_inputs``)."""
        return self._generate(self.chat_inputs(messages, max_pixels, split_special_tokens), max_new_tokens)

    @torch.no_grad()
    def _generate(self, inputs: dict, max_new_tokens: int) -> tuple[list[int], torch.Tensor, int]:
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True)
        prompt_len = inputs["input_ids"].shape[1]
        return out.sequences[0, prompt_len:].tolist(), out.logits[0][0].float(), prompt_len

    @torch.no_grad()
    def prompt_logprobs(self, inputs: dict) -> torch.Tensor:
        """transformers' float32 log-softmax at every prompt position, ``[prompt_len, vocab]`` (one
        forward over ``chat_inputs``): row p is the distribution of token p + 1."""
        return torch.log_softmax(self.model(**inputs).logits[0].float(), dim=-1)

    @torch.no_grad()
    def generate_through_eos(self, inputs: dict, num_tokens: int) -> list[int]:
        """Greedy, exactly ``num_tokens`` new tokens, EOS sampled like any other token when it is
        the argmax and generation going on past it: what a request with ``ignore_eos`` gets (vLLM's
        meaning). ``generate_exact`` instead forbids EOS (``min_new_tokens``), a different answer
        wherever EOS would have been the argmax."""
        config = copy.deepcopy(self.model.generation_config)
        config.eos_token_id = -1  # no id is -1: nothing stops it, nothing is masked
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # its warning that -1 is not a real token id
        try:
            out = self.model.generate(**inputs, generation_config=config, max_new_tokens=num_tokens, do_sample=False)
        finally:
            transformers_logging.set_verbosity(verbosity)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    @torch.no_grad()
    def generate_exact(self, inputs: dict, num_tokens: int, streamer: BaseStreamer | None = None) -> list[int]:
        """Greedy, exactly ``num_tokens`` new tokens (EOS cannot end it early), optionally streamed."""
        out = self.model.generate(**inputs, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                                  streamer=streamer)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    def decode(self, token_ids: list[int]) -> str:
        """Text as the router streams it (special tokens skipped)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
