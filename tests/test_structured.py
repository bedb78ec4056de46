"""Structured outputs at the unit level (epd/grammar.py, epd/sampling.py): invalid schemas, regexes
and grammars refused naming the problem; a grammar state rebuilt from an answer so far (what a
resumed or replayed request does on another worker) masks exactly as the state that produced it;
answers drawn through the masks parse and validate. The real-stack tests (every answer validates,
greedy equals transformers' generate with llguidance's matcher, a resume) are in
tests/test_logits_processing.py, beside that module's stack."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from epd import grammar
from epd.modelinfo import ModelInfo
from epd.sampling import SamplingConfig, process, sample
from epd.v1 import epd_pb2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "kind", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def info(tiny_model_dir):
    return ModelInfo.load(tiny_model_dir)


@pytest.fixture(scope="module")
def llg_tokenizer(info):
    return grammar.tokenizer_for(info)


def _compile(llg_tokenizer, **kind) -> str:
    return grammar.compile_structured(epd_pb2.StructuredOutput(**kind), llg_tokenizer)


@pytest.mark.parametrize("kind,problem", [
    (dict(json_schema='{"type": "foo"}'), "invalid json schema: Invalid type: foo"),
    (dict(json_schema='{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'), "/nowhere"),
    (dict(json_schema="{"), "json_schema is not valid JSON"),
    (dict(json_schema="[1, 2]"), "json_schema must be a JSON object"),
    (dict(regex="[a-"), "invalid regex"),
    (dict(grammar="start: missing_rule"), 'unknown name: "missing_rule"'),
    (dict(choice=epd_pb2.StructuredOutput.Choices(values=[])), "choice must list 1 to"),
])
def test_invalid_structured_outputs_are_refused_naming_the_problem(llg_tokenizer, kind, problem):
    with pytest.raises(ValueError) as refused:
        _compile(llg_tokenizer, **kind)
    assert problem in str(refused.value)
    assert str(refused.value).startswith("structured output: ")


def _walk(llg_tokenizer, compiled: str, vocab: int, seed: int, steps: int = 200, eos=(587, 589)):
    """Sample through the masks from seeded random logits until an end token (or ``steps``); also
    compares, at every step, the mask of a state rebuilt from the answer so far with the running one."""
    config = SamplingConfig(max_tokens=steps, temperature=1.0, seed=seed, grammar=compiled)
    state = grammar.GrammarState(llg_tokenizer, compiled)
    generator = torch.Generator().manual_seed(seed)
    answer = []
    for step in range(steps):
        logits = torch.randn(vocab, generator=generator) * 4
        if step % 7 == 3:  # a resume here: a fresh state fed the answer so far masks exactly as the running one
            rebuilt = grammar.GrammarState(llg_tokenizer, compiled, answer)
            assert torch.equal(rebuilt.allowed(), state.allowed()), step
        token, _ = sample(logits, config, step, grammar=state)
        answer.append(token)
        if token in eos:
            return answer, True
    return answer, False


def test_answers_drawn_through_the_masks_validate_and_a_rebuilt_state_masks_the_same(info, llg_tokenizer, oracle):
    compiled = _compile(llg_tokenizer, json_schema=json.dumps(SCHEMA))
    finished = 0
    for seed in range(6):
        answer, ended = _walk(llg_tokenizer, compiled, info.vocab_size, seed)
        if not ended:
            continue
        finished += 1
        text = oracle.decode(answer)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert finished >= 4, "too few random walks reached the end of the schema within 200 tokens"


def test_choice_regex_and_lark_grammar_hold(info, llg_tokenizer, oracle):
    choices = ["red apple", "green pear", "blue"]
    for kind, check in [
        (dict(choice=epd_pb2.StructuredOutput.Choices(values=choices)), lambda text: text in choices),
        (dict(regex=r"[0-9]{3}-[a-z]{2}"), lambda text: len(text) == 6 and text[3] == "-" and text[:3].isdigit()),
        (dict(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'),
         lambda text: text[0] == "(" and text[-1] == ")" and all(p.isdigit() for p in text[1:-1].split("+"))),
        (dict(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    ]:
        compiled = _compile(llg_tokenizer, **kind)
        for seed in range(3):
            answer, ended = _walk(llg_tokenizer, compiled, info.vocab_size, seed, steps=120)
            if ended:
                assert check(oracle.decode(answer)), (kind, oracle.decode(answer))


def test_a_state_refuses_an_answer_the_grammar_does_not_allow(llg_tokenizer, oracle):
    compiled = _compile(llg_tokenizer, choice=epd_pb2.StructuredOutput.Choices(values=["yes", "no"]))
    off = oracle.tokenizer("maybe", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="does not match the grammar"):
        grammar.GrammarState(llg_tokenizer, compiled, off)


def test_the_grammar_masks_last_and_its_end_wins_over_min_tokens(info, llg_tokenizer, oracle):
    """Once a choice is complete only the end tokens are allowed: min_tokens (which masks them)
    yields rather than leave nothing to sample. Before that, the mask and logit_bias compose."""
    compiled = _compile(llg_tokenizer, choice=epd_pb2.StructuredOutput.Choices(values=["yes"]))
    ids = oracle.tokenizer("yes", add_special_tokens=False)["input_ids"]
    state = grammar.GrammarState(llg_tokenizer, compiled, ids)
    eos = info.eos_token_ids
    config = SamplingConfig(max_tokens=16, min_tokens=8, grammar=compiled)
    scores = process(torch.zeros(info.vocab_size), config, len(ids), eos_token_ids=eos, grammar=state)
    assert set(torch.isfinite(scores).nonzero().flatten().tolist()) == set(eos)
    # A request without a grammar keeps min_tokens' mask (the old behaviour).
    plain = process(torch.zeros(info.vocab_size), SamplingConfig(max_tokens=16, min_tokens=8), 0, eos_token_ids=eos)
    assert all(plain[t] == float("-inf") for t in eos)
    with pytest.raises(ValueError, match="needs the request's grammar state"):
        process(torch.zeros(info.vocab_size), config, 0, eos_token_ids=eos)


def test_a_grammar_with_ignore_eos_is_refused():
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingConfig(max_tokens=4, ignore_eos=True, grammar='{"grammars": []}')
