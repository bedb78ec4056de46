"""The correctness oracle: transformers' own Qwen3_5ForConditionalGeneration.generate.

Inputs are built the way Qwen3VLProcessor builds them (chat template, each <|image_pad|> expanded
to the image's token count, Qwen2VLImageProcessorPil pixels), independently of epd's router code.
The benchmark's transformers baseline runs through it too (any dtype, whole conversations).
"""

from __future__ import annotations

import io

import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration
from transformers.generation.streamers import BaseStreamer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# A chat message: {"role": ..., "content": str | [{"type": "image", "image": bytes} | {"type": "text", "text": str}]}
ChatMessage = dict


class Oracle:
    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        self.model = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.image_token_id = self.model.config.image_token_id

    def inputs(self, prompt: str, images: list[bytes], max_pixels: int | None = None) -> dict:
        """One user turn: the images first, then the text."""
        content = [{"type": "image", "image": data} for data in images] + [{"type": "text", "text": prompt}]
        return self.chat_inputs([{"role": "user", "content": content}], max_pixels)

    def chat_inputs(self, messages: list[ChatMessage], max_pixels: int | None = None) -> dict:
        """``generate`` keyword arguments for a conversation: each message's content is a string or
        a list of ``{"type": "text", "text": str}`` / ``{"type": "image", "image": bytes}`` parts;
        images in the order they appear."""
        chat, images = [], []
        for message in messages:
            content = message["content"]
            if not isinstance(content, str):
                images += [part["image"] for part in content if part["type"] == "image"]
                content = [{"type": "image"} if part["type"] == "image" else part for part in content]
            chat.append({"role": message["role"], "content": content})
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=False)
        out: dict = {}
        if images:
            size = {"shortest_edge": self.processor.size.shortest_edge,
                    "longest_edge": max_pixels or self.processor.size.longest_edge}
            pil = [Image.open(io.BytesIO(data)) for data in images]
            pixels = self.processor(images=pil, return_tensors="pt", size=size)
            out["pixel_values"] = pixels["pixel_values"].to(self.model.dtype)
            out["image_grid_thw"] = pixels["image_grid_thw"]
            pieces = text.split("<|image_pad|>")
            counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
            text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out["input_ids"] = ids
        out["mm_token_type_ids"] = (ids == self.image_token_id).int()
        return out

    def generate(self, prompt: str, images: list[bytes] = (), max_new_tokens: int = 32,
                 max_pixels: int | None = None) -> tuple[list[int], torch.Tensor, int]:
        """Greedy tokens, the first token's logits, and the prompt length."""
        return self._generate(self.inputs(prompt, list(images), max_pixels), max_new_tokens)

    def generate_chat(self, messages: list[ChatMessage], max_new_tokens: int = 32,
                      max_pixels: int | None = None) -> tuple[list[int], torch.Tensor, int]:
        """``generate`` for a whole conversation (see ``chat_inputs``)."""
        return self._generate(self.chat_inputs(messages, max_pixels), max_new_tokens)

    @torch.no_grad()
    def _generate(self, inputs: dict, max_new_tokens: int) -> tuple[list[int], torch.Tensor, int]:
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True)
        prompt_len = inputs["input_ids"].shape[1]
        return out.sequences[0, prompt_len:].tolist(), out.logits[0][0].float(), prompt_len

    @torch.no_grad()
    def generate_exact(self, inputs: dict, num_tokens: int, streamer: BaseStreamer | None = None) -> list[int]:
        """Greedy, exactly ``num_tokens`` new tokens (EOS cannot end it early), optionally streamed."""
        out = self.model.generate(**inputs, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                                  streamer=streamer)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    def decode(self, token_ids: list[int]) -> str:
        """Text as the router streams it (special tokens skipped)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
