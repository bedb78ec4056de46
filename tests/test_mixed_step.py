"""The mixed forward (``TextModelRunner.mixed_step``): prefill chunks and a decode batch's rows in
one pass over the weights give what separate forwards give, on the dense and the MoE preset.

Two copies of the same work run side by side in float32: one through ``mixed_step``, the other
through ``forward_rows`` + ``decode_step`` (the separate prefill and decode forwards, which the
parity tests hold to transformers). Prompts of several chunks (one with an image span, so 3-D
M-RoPE positions) run while a decode batch steps; a prompt whose last chunk ran samples its first
token from the mixed forward's logits and joins the decode batch there. Logits agree to float32
rounding (the concatenated GEMMs sum in another blocking), every greedy token is identical, and
the slot states match at the end.
"""

from __future__ import annotations

import pytest
import torch

from decode_svc.batch import DecodeBatch
from epd import positions
from epd.lm import TextModelRunner

CHUNK = 16
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def runner(request) -> TextModelRunner:
    fixture = "tiny_model_dir" if request.param == "tiny" else "tiny_moe_model_dir"
    return TextModelRunner.load(request.getfixturevalue(fixture))


class Prompt:
    """A prompt of random ids (an image span's rows get their own embeddings), its M-RoPE positions."""

    def __init__(self, runner: TextModelRunner, length: int, seed: int, image: bool = False) -> None:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, runner.vocab_size, (length,), generator=generator)
        self.embeds = runner.embed(ids).clone()
        spans = []
        if image:
            span = positions.ImageSpan(start=3, merged_height=4, merged_width=5)
            self.embeds[span.start:span.end] = torch.randn(span.num_tokens, self.embeds.shape[1], generator=generator)
            spans = [span]
        self.positions, self.rope_delta = positions.mrope_positions(length, spans)
        self.length = length
        self.done = 0

    def next_chunk(self, state) -> tuple[tuple[torch.Tensor, torch.Tensor, object], bool]:
        lo, hi = self.done, min(self.done + CHUNK, self.length)
        return (self.embeds[lo:hi], self.positions[:, lo:hi], state), hi == self.length


class Side:
    """One copy of the work: its prefill states, its decode batch and the batch's next tokens."""

    def __init__(self, runner: TextModelRunner, decoding: list[Prompt]) -> None:
        self.batch = DecodeBatch(runner)
        self.tokens: list[int] = []
        self.positions: list[int] = []
        for prompt in decoding:
            state = runner.new_state()
            first = int(runner.logits(runner.forward(prompt.embeds, prompt.positions, state)).argmax())
            self.join(state, first, prompt)
        self.states: dict[int, object] = {}

    def join(self, state, first: int, prompt: Prompt) -> None:
        self.batch.add(state)
        self.tokens.append(first)
        self.positions.append(positions.decode_position(prompt.length, 0, prompt.rope_delta))

    def stepped(self, logits: torch.Tensor) -> list[int]:
        self.tokens = [int(row.argmax()) for row in logits]
        self.positions = [p + 1 for p in self.positions]
        return self.tokens


def test_a_mixed_forward_gives_the_separate_forwards_logits_and_tokens(runner):
    decoding = [Prompt(runner, n, seed) for seed, n in enumerate([9, 40, 23])]
    prompts = {"image": Prompt(runner, 37, 10, image=True), "short": Prompt(runner, 12, 11),
               "late": Prompt(runner, 20, 12)}
    schedule = [["image", "short"], ["image"], ["image", "late"], ["late"], [], []]  # prompts with a chunk per step
    mixed, separate = Side(runner, decoding), Side(runner, decoding)
    for step, names in enumerate(schedule):
        chunks = {side: [] for side in ("mixed", "separate")}
        finishing = set()
        for i, name in enumerate(names):
            prompt = prompts[name]
            for side, holder in (("mixed", mixed), ("separate", separate)):
                state = holder.states.setdefault(name, runner.new_state())
                chunk, last = prompt.next_chunk(state)
                chunks[side].append(chunk)
            if last:
                finishing.add(i)
            prompt.done = min(prompt.done + CHUNK, prompt.length)
        every_row = frozenset({0}) if step == 1 else frozenset()  # prompt logprobs' rows, once
        out = runner.mixed_step(chunks["mixed"], mixed.batch, mixed.tokens, mixed.positions,
                                sample_chunks=frozenset(finishing), every_row=every_row)
        want_decode = runner.decode_step(separate.batch, separate.tokens, separate.positions)
        want_last, want_rows = (runner.forward_rows(chunks["separate"], every_row) if names
                                else (None, {}))
        torch.testing.assert_close(out.decode_logits, want_decode, **TOL)
        assert mixed.stepped(out.decode_logits) == separate.stepped(want_decode), f"step {step}"
        assert out.rows.keys() == want_rows.keys()
        for i, rows in want_rows.items():
            torch.testing.assert_close(out.rows[i], rows, **TOL)
        if names:
            torch.testing.assert_close(out.last_hidden, want_last, **TOL)
        assert sorted(out.chunk_logits) == sorted(finishing)
        for i in finishing:  # the prompt ends here: its first token comes from this forward, then it decodes
            want = runner.logits(want_last[i])
            torch.testing.assert_close(out.chunk_logits[i], want, **TOL)
            first = int(out.chunk_logits[i].argmax())
            assert first == int(want.argmax())
            name = names[i]
            mixed.join(mixed.states.pop(name), first, prompts[name])
            separate.join(separate.states.pop(name), first, prompts[name])
    assert len(mixed.batch) == len(decoding) + len(prompts)
    for slot in range(len(mixed.batch)):
        got, want = mixed.batch.state_of(slot), separate.batch.state_of(slot)
        assert got.num_tokens == want.num_tokens
        for (name, tensor), (_, reference) in zip(got.named_tensors(), want.named_tensors()):
            torch.testing.assert_close(tensor, reference, **TOL, msg=f"slot {slot} {name}")


def test_a_mixed_forward_refuses_mismatched_rows(runner):
    batch = DecodeBatch(runner)
    prompt = Prompt(runner, 5, 0)
    with pytest.raises(ValueError, match="one token and position per slot"):
        runner.mixed_step([prompt.next_chunk(runner.new_state())[0]], batch, [1], [5])
    with pytest.raises(ValueError, match="a prefill chunk or a decode row"):
        runner.mixed_step([], batch, [], [])


def test_a_chunk_split_inside_gives_two_forwards_results_and_the_state_between(runner):
    """A chunk with splits (the prefill engine's snapshot points inside it) runs its mixing cores
    piece by piece in one forward: the same last row and final state as forwards that end at
    each split, and at each split the state those forwards leave (what the prefix cache keeps).
    The chunk here continues a prompt (a state with tokens already) beside another prompt's
    chunk and a decode row."""
    prompt, other = Prompt(runner, 57, 20, image=True), Prompt(runner, 14, 21)
    head, cuts = 9, [16, 32]  # tokens already computed; splits inside the 48-token chunk after them
    states = {}
    for side in ("split", "pieces"):
        state = runner.new_state()
        runner.forward(prompt.embeds[:head], prompt.positions[:, :head], state)
        states[side] = state
    decoding = Prompt(runner, 11, 22)
    split_side, pieces_side = Side(runner, [decoding]), Side(runner, [decoding])
    rows = slice(head, prompt.length)
    chunk = (prompt.embeds[rows], prompt.positions[:, rows], states["split"])
    out = runner.mixed_step([(other.embeds, other.positions, runner.new_state()), chunk], split_side.batch,
                            split_side.tokens, split_side.positions, sample_chunks=frozenset({1}),
                            splits={1: cuts})
    # the same chunk as three forwards, each ending at a split; the state after each kept whole
    between, edges = [], [head, *(head + c for c in cuts), prompt.length]
    for start, end in zip(edges, edges[1:]):
        last = runner.forward(prompt.embeds[start:end], prompt.positions[:, start:end], states["pieces"])
        if end < prompt.length:
            kept = runner.new_state()
            for kind in ("keys", "values", "conv", "recurrent"):
                setattr(kept, kind, list(getattr(states["pieces"], kind)))
            kept.num_tokens = states["pieces"].num_tokens
            between.append(kept)
    want_decode = runner.decode_step(pieces_side.batch, pieces_side.tokens, pieces_side.positions)
    torch.testing.assert_close(out.last_hidden[1], last, **TOL)
    torch.testing.assert_close(out.chunk_logits[1], runner.logits(last), **TOL)
    torch.testing.assert_close(out.decode_logits, want_decode, **TOL)
    assert list(out.snapshots) == [1] and len(out.snapshots[1]) == len(cuts)
    for got, want in zip(out.snapshots[1], between):
        assert got.num_tokens == want.num_tokens
        names = [name for name, _ in got.named_tensors()]
        assert names == [name for name, _ in want.named_tensors()]
        for (name, tensor), (_, reference) in zip(got.named_tensors(), want.named_tensors()):
            torch.testing.assert_close(tensor, reference, **TOL, msg=f"{got.num_tokens} tokens: {name}")
    assert states["split"].num_tokens == states["pieces"].num_tokens == prompt.length
    for (name, tensor), (_, reference) in zip(states["split"].named_tensors(), states["pieces"].named_tensors()):
        torch.testing.assert_close(tensor, reference, **TOL, msg=f"final {name}")
    with pytest.raises(ValueError, match="cannot be split"):
        runner.mixed_step([(prompt.embeds[:8], prompt.positions[:, :8], runner.new_state())], None, [], [],
                          splits={0: [8]})
