"""Incremental detokenization with stop strings, using the tiny checkpoint's real tokenizer."""

import pytest
from transformers import AutoTokenizer

from epd.checkpoint import create_checkpoint
from router_svc.text import TextStream

MIXED = "Hello 世界! 🎉 naïve — café 😀👍🏽 日本語のテキスト, the end."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model_dir = create_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0, progress=False)
    return AutoTokenizer.from_pretrained(model_dir)


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _feed(stream, ids, batch=1):
    deltas = []
    for i in range(0, len(ids), batch):
        deltas.append(stream.add(ids[i : i + batch]))
    return deltas


@pytest.mark.parametrize("batch", [1, 2, 3, 7])
def test_deltas_concatenate_to_full_decode(tokenizer, batch):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    stream = TextStream(tokenizer, stop=[])
    deltas = _feed(stream, ids, batch)
    assert "".join(deltas) + stream.flush() == _decode(tokenizer, ids)
    assert not stream.stopped
    assert stream.token_ids == ids


def test_no_hold_without_stop_strings(tokenizer):
    ids = tokenizer.encode("abc def ghi")
    stream = TextStream(tokenizer, stop=[])
    emitted = ""
    for i, tid in enumerate(ids):
        emitted += stream.add([tid])
        assert emitted == _decode(tokenizer, ids[: i + 1])  # ASCII text is final at once
    assert stream.flush() == ""


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("stop", [[], ["zzz"]])
def test_multibyte_characters_never_emitted_half_way(tokenizer, batch, stop):
    ids = tokenizer.encode(MIXED)
    # the test only means something if some characters really are split across tokens
    assert any("\ufffd" in _decode(tokenizer, ids[:i]) for i in range(1, len(ids)))
    stream = TextStream(tokenizer, stop=stop)
    deltas = _feed(stream, ids, batch)
    for d in deltas:
        assert "\ufffd" not in d
    tail = stream.flush()
    assert "\ufffd" not in tail
    assert "".join(deltas) + tail == _decode(tokenizer, ids) == MIXED


def test_stop_string_cuts_text_before_it(tokenizer):
    ids = tokenizer.encode("one two three STOP four five")
    stream = TextStream(tokenizer, stop=["STOP"])
    out = ""
    for tid in ids:
        out += stream.add([tid])
        if stream.stopped:
            break
    assert stream.stopped
    assert out == "one two three "
    assert stream.flush() == ""


def test_stop_string_in_one_batch(tokenizer):
    stream = TextStream(tokenizer, stop=["four"])
    out = stream.add(tokenizer.encode("one two three four five"))
    assert stream.stopped and out == "one two three "


def test_stop_string_spanning_two_batches(tokenizer):
    prefix, stop_word = "hello there, ", "goodbye"
    ids = tokenizer.encode(prefix + stop_word + " and more")
    # find a split point that falls inside the stop word
    split = next(
        i for i in range(1, len(ids))
        if len(prefix) < len(_decode(tokenizer, ids[:i])) < len(prefix) + len(stop_word)
    )
    stream = TextStream(tokenizer, stop=[stop_word])
    first = stream.add(ids[:split])
    assert not stream.stopped
    assert stop_word[:2] not in first  # the possible start of the stop is held back
    second = stream.add(ids[split:])
    assert stream.stopped
    assert first + second == prefix
    assert stream.flush() == ""


def test_stop_string_spanning_many_single_tokens(tokenizer):
    text = "alpha beta gamma delta epsilon"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, stop=["ma del"])
    out = "".join(_feed(stream, ids, 1))
    assert stream.stopped and out == "alpha beta gam"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    stream = TextStream(tokenizer, stop=["delta", "beta", ""])
    out = "".join(_feed(stream, tokenizer.encode("alpha beta gamma delta"), 2))
    assert stream.stopped and out == "alpha "


def test_stop_after_multibyte_text(tokenizer):
    ids = tokenizer.encode("日本語 😀 END tail")
    stream = TextStream(tokenizer, stop=["END"])
    deltas = _feed(stream, ids, 1)
    assert stream.stopped
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "日本語 😀 "


def test_text_that_only_resembles_a_stop_is_released(tokenizer):
    ids = tokenizer.encode("sto stop st")
    stream = TextStream(tokenizer, stop=["stop!"])
    out = "".join(_feed(stream, ids, 1))
    assert not stream.stopped
    assert out + stream.flush() == "sto stop st"
    assert len(out) == len("sto stop st") - 4  # only the last len(stop)-1 chars held back


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("hi there") + [eos]
    stream = TextStream(tokenizer, stop=[])
    assert "".join(_feed(stream, ids, 1)) + stream.flush() == "hi there"


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_incremental_text_equals_decoding_everything_each_time(tokenizer, batch):
    """The stream decodes only a tail, yet at every step its text is the full decode's."""
    import random

    rng = random.Random(batch)
    ids = tokenizer.encode(MIXED * 3)
    ids += [rng.randrange(len(tokenizer)) for _ in range(200)]  # arbitrary ids: split characters, specials
    stream = TextStream(tokenizer, stop=[])
    for i in range(0, len(ids), batch):
        stream.add(ids[i : i + batch])
        assert stream._text() == _decode(tokenizer, stream.token_ids)
    assert stream._settled >= len(ids) - 64, "the settled point stopped moving: decoding is quadratic again"


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 100])
def test_a_stop_keeps_the_tokens_up_to_the_one_that_completed_it(tokenizer, batch):
    """Whatever the batching, the completion ends with the token whose text completes the stop
    string; ``consumed`` says how many of the last batch that is."""
    ids = tokenizer.encode("one two three STOP four five six seven")
    complete = next(n for n in range(1, len(ids) + 1) if "STOP" in _decode(tokenizer, ids[:n]))
    stream = TextStream(tokenizer, stop=["STOP"])
    kept, out = [], ""
    for i in range(0, len(ids), batch):
        chunk = ids[i : i + batch]
        out += stream.add(chunk)
        kept += chunk[: stream.consumed]
        if stream.stopped:
            break
    assert stream.stopped and out == "one two three "
    assert kept == stream.token_ids == ids[:complete]
    assert stream.add(ids[-2:]) == "" and stream.consumed == 0 and stream.token_ids == ids[:complete]


def test_stop_strings_are_looked_for_only_past_min_tokens(tokenizer):
    """vLLM's rule: with min_tokens, a stop string completed by one of the first min_tokens tokens
    does not end the completion; one completed later does."""
    ids = tokenizer.encode("one two one two one two")
    first = next(n for n in range(1, len(ids) + 1) if "two" in _decode(tokenizer, ids[:n]))
    eager = TextStream(tokenizer, stop=["two"])
    _feed(eager, ids)
    assert eager.stopped and len(eager.token_ids) == first and eager.matched == "two"
    patient = TextStream(tokenizer, stop=["two"], min_tokens=first)
    text = "".join(_feed(patient, ids))
    assert patient.stopped and len(patient.token_ids) > first
    assert text.count("two") == 1 and text.startswith(_decode(tokenizer, ids[:first]))


@pytest.mark.parametrize("batch", [1, 3])
def test_a_stop_token_counts_but_its_text_is_left_out(tokenizer, batch):
    ids = tokenizer.encode("alpha beta gamma delta")
    stream = TextStream(tokenizer, stop=[])
    text = "".join(_feed(stream, ids[:-1], batch))
    text += stream.add(ids[-1:], ends=True) + stream.flush()
    assert text == _decode(tokenizer, ids[:-1]) and stream.token_ids == ids and stream.stop_token == ids[-1]
    assert stream.add([5]) == "" and stream.token_ids == ids  # nothing after it
