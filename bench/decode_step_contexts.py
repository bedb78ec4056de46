"""Decode step times at several context lengths, for before/after comparisons across trees.

``python -m bench.decode_step_contexts MODEL [DTYPE]`` prints one JSON line: the median step
(``bench.decode_step.time_decode_step``, 12 steps after 3 warm-up) at batch 1 and 16 with 64 and
1024 tokens of context. It only uses ``time_decode_step`` and the module's ``_PROMPT_TOKENS``, so
the same file runs against an older checkout too (``PYTHONPATH=OLD_TREE python this_file.py``).
"""

from __future__ import annotations

import json
import sys

import bench.decode_step as decode_step
from epd.lm import TextModelRunner


def main() -> None:
    model, dtype = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "float32")
    runner = TextModelRunner.load(model, dtype=dtype)
    out = {}
    for context in (64, 1024):
        decode_step._PROMPT_TOKENS = context
        for batch in (1, 16):
            out[f"ctx{context}_b{batch}"] = decode_step.time_decode_step(runner, batch, steps=12, warmup=3)
    print("RESULT", json.dumps(out))


if __name__ == "__main__":
    main()
