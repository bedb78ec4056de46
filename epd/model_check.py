"""Whether a directory holds a checkpoint epd can serve: the check every role's loading path makes
(``epd.checkpoint.read_config``) and the one ``epd serve`` / ``epd deploy`` make before Ray
starts, so a wrong checkpoint is refused in seconds, not by every role's constructor in turn.

Plain Python (json and os only): importing torch and transformers takes seconds, and the
command must not pay that to say no.
"""

from __future__ import annotations

import json
import os

# The model types epd serves; epd.family has one entry per type here (tests/test_moe.py checks it).
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
SUPPORTED = ("Qwen3.5 vision-language checkpoints only, dense or mixture-of-experts "
             "(Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration)")


class UnsupportedCheckpoint(ValueError):
    """The directory is not a Qwen3.5 (dense or MoE) checkpoint; the message says what it holds and what is supported."""


def check_model_type(model_dir) -> dict:
    """config.json of ``model_dir`` as a dict; UnsupportedCheckpoint if it is missing, unreadable
    or names another model type."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    if not os.path.isfile(path):
        raise UnsupportedCheckpoint(f"no config.json in {model_dir}")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as error:
        raise UnsupportedCheckpoint(f"cannot read {path}: {error}") from None
    if not isinstance(raw, dict):
        raise UnsupportedCheckpoint(f"{path} is not a JSON object")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        architectures = raw.get("architectures") or []
        what = f" ({', '.join(map(str, architectures))})" if isinstance(architectures, list) and architectures else ""
        raise UnsupportedCheckpoint(f"{path}: model_type is {model_type!r}{what}, expected "
                                    f"{' or '.join(map(repr, SUPPORTED_MODEL_TYPES))}: epd serves {SUPPORTED}")
    return raw
