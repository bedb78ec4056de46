"""``python -m bench.screen_bits MODEL [--rows 8] [--bits 8,4]``: how many of the LM head's columns a
greedy screen with a BITS-bit copy of the head would leave a row, before any is multiplied exactly.

The rows are real final-normed hidden states of a greedy decode (``bench.greedy_screen``'s: ``--rows``
prompts of random token ids, a few steps in). For each width the head's rows are
quantized as the screen's copy is (``w_i = s_i q_i + b_i``, ``s_i = max|w_i| / (2^(BITS-1) - 1)``,
round to nearest), each hidden row in one int8 level (``h = sh q1 + a``), and each column's logit
bounded as the AVX-512 VNNI path bounds it (``epd/csrc/greedy_screen.h``, Cauchy-Schwarz on both
terms): ``|h . w_i - s_i sh (q1 . q_i)| <= s_i ||a||_2 ||q_i||_2 + ||h||_2 ||b_i||_2``. A column is
left when its upper end reaches the row's best lower end; the exact maximum is checked to be
among them. In float64 in torch, not the C++ screen: it says whether a narrower first
level could prune, not what it would cost (docs/BENCHMARKS.md, "Issue 18 on the AMD EPYC, a sixth
time": a 4-bit copy leaves nearly every column of the 0.8b's head)."""

from __future__ import annotations

import argparse
import json

import torch


def columns_left(weight: torch.Tensor, rows: torch.Tensor, bits: int) -> list[int]:
    """Per row of ``rows [B, K]``: the columns of ``weight [N, K]`` a ``bits``-bit screen leaves."""
    weight, rows = weight.double(), rows.double()
    qmax = 2 ** (bits - 1) - 1
    scale = (weight.abs().amax(1) / qmax).clamp_min(1e-30)  # an all-zero row (a pad token's) stays zero
    q = torch.round(weight / scale[:, None])
    b = weight - scale[:, None] * q
    q_norm, b_norm = q.norm(dim=1), b.norm(dim=1)
    exact = rows @ weight.T
    left = []
    for r, h in enumerate(rows):
        sh = h.abs().max() / 127
        q1 = torch.round(h / sh)
        a = h - sh * q1
        approx = scale * sh * (q @ q1)
        bound = (scale * a.norm() * q_norm + h.norm() * b_norm) * (1 + 1e-5)
        keep = approx + bound >= (approx - bound).max()
        if not bool(keep[int(exact[r].argmax())]):
            raise AssertionError(f"row {r}: the maximum's column was dropped: the bound does not hold")
        left.append(int(keep.sum()))
    return left


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.screen_bits", description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--bits", default="8,4", help="copy widths to compare, comma-separated")
    args = parser.parse_args()
    from bench.greedy_screen import _real

    weight, rows = _real(args.model, args.rows)
    result = {}
    for bits in (int(b) for b in args.bits.split(",")):
        left = columns_left(weight.float(), rows.float(), bits)
        result[bits] = left
        print(f"{bits}-bit copy: columns left a row {left} of {weight.shape[0]}")
    print(json.dumps({"rows": args.rows, "columns_left": result}))


if __name__ == "__main__":
    main()
