"""The model families epd serves, by config.json's ``model_type``: which transformers classes build
each piece. Checkpoint creation, loading (``epd.checkpoint``), the transformers oracle
(``bench.oracle``) and the cost model (``bench.roofline``) all look a family up here, so a dense
Qwen3.5 and a mixture-of-experts Qwen3.5 go through the same code.

Both families share the hybrid decoder (Gated DeltaNet + gated full attention, the same module
attributes ``epd.lm`` walks) and the vision tower; they differ in the decoder's MLP: a dense SwiGLU
(``qwen3_5``) or ``Qwen3_5MoeSparseMoeBlock`` (``qwen3_5_moe``: a top-k softmax router renormalised
over the top k, experts as 3-D ``gate_up_proj`` / ``down_proj`` parameters, and a sigmoid-gated
shared expert). The runner calls ``layer.mlp`` either way.

The list of supported types that ``epd.model_check`` keeps (plain Python, no torch) must name
exactly these families (``tests/test_moe.py`` checks it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from epd.model_check import check_model_type

# How transformers runs the experts of a MoE layer (``config._experts_implementation``). epd pins it
# so its runner and the oracle compute the experts the same way whatever transformers' default
# becomes: "grouped_mm" (transformers' default on this torch) sorts the (token, expert) pairs by
# expert and runs one grouped product per projection, reading each expert that has tokens once;
# "eager" loops over the experts that have tokens in Python (the same grouping, one product pair
# per hit expert). Measured in docs/BENCHMARKS.md ("MoE experts").
EXPERTS_IMPLEMENTATION = "grouped_mm"


@dataclass(frozen=True)
class Family:
    """One model type's transformers classes, imported on first use: the modeling modules pull in
    transformers' whole model stack (seconds of CPU at each process's start), which the router,
    the Encoder service, the controller and the CLI never need."""

    model_type: str
    prefix: str  # transformers' class-name prefix: ``Qwen3_5`` -> ``Qwen3_5Config``, ``Qwen3_5TextModel``, ...
    moe: bool  # the decoder's MLP is a sparse mixture of experts

    def _class(self, module: str, name: str) -> type:
        return getattr(importlib.import_module(f"transformers.models.{self.model_type}.{module}_{self.model_type}"),
                       self.prefix + name)

    @property
    def config(self) -> type:
        """The top-level config (text_config + vision_config)."""
        return self._class("configuration", "Config")

    @property
    def conditional_generation(self) -> type:
        """The whole model: what checkpoints are created with, and the oracle."""
        return self._class("modeling", "ForConditionalGeneration")

    @property
    def text_model(self) -> type:
        return self._class("modeling", "TextModel")

    @property
    def vision_model(self) -> type:
        return self._class("modeling", "VisionModel")

    @property
    def text_rotary(self) -> type:
        return self._class("modeling", "TextRotaryEmbedding")

    @property
    def vision_rotary(self) -> type:
        return self._class("modeling", "VisionRotaryEmbedding")

    @property
    def architecture(self) -> str:
        """config.json's ``architectures`` entry, as published checkpoints write it."""
        return self.prefix + "ForConditionalGeneration"


FAMILIES: dict[str, Family] = {
    "qwen3_5": Family(model_type="qwen3_5", prefix="Qwen3_5", moe=False),
    "qwen3_5_moe": Family(model_type="qwen3_5_moe", prefix="Qwen3_5Moe", moe=True),
}


def family_of(model_dir) -> Family:
    """The family of the checkpoint in ``model_dir``; ``UnsupportedCheckpoint`` (a ValueError) for
    any other model type, from the same check ``epd serve`` makes before Ray starts."""
    return FAMILIES[check_model_type(model_dir)["model_type"]]


def family_of_config(config) -> Family:
    """The family a config object belongs to (by its ``model_type``)."""
    return FAMILIES[config.model_type]


def model_kwargs(family: Family) -> dict:
    """Keyword arguments for ``from_pretrained`` of ``family.conditional_generation`` so it runs as
    epd's runner does (the pinned experts implementation for a MoE family)."""
    return {"experts_implementation": EXPERTS_IMPLEMENTATION} if family.moe else {}
