"""Logits processing (stop_token_ids, min_tokens, logit_bias, min_p, presence / frequency /
repetition penalties) against transformers' own logits processors, applied in vLLM's order:
in-process on random logits, teacher-forced on the tiny model through a real `epd serve` (gRPC and
the HTTP front), and across a resume (prefill replaying the answer so far samples what decode would
have). transformers has no OpenAI presence / frequency processor: ``OpenAIPenalties`` below is
OpenAI's documented formula over the generated tokens, written independently of epd's."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from epd import client
from epd.config import PrefillConfig
from epd.lm import TextModelRunner
from epd.modelinfo import ModelInfo
from epd.sampling import _GOLDEN, _MASK63, SamplingConfig, TokenHistory, process, sample, warp
from epd.store import EmbeddingStore
from epd.v1 import epd_pb2
from epd.wire import sampling_from_proto, sampling_to_proto
from prefill_svc.engine import PrefillEngine

VOCAB = 64
EOS = frozenset({3})
MODEL = "epd-tiny"


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence / frequency penalties: logit -= count * frequency + (count > 0) * presence,
    count over the generated tokens (those after ``prompt_len``)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def oracle_process(scores: torch.Tensor, input_ids: torch.Tensor, prompt_len: int, config: SamplingConfig,
                   eos=EOS) -> torch.Tensor:
    """transformers' processors in vLLM's order: min_tokens, logit_bias, penalties."""
    processors = []
    banned = sorted(set(config.stop_token_ids) | (set() if config.ignore_eos else set(eos)))
    if config.min_tokens and banned:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_len, config.min_tokens, banned))
    if config.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in config.logit_bias]))
    if config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.presence_penalty or config.frequency_penalty:
        processors.append(OpenAIPenalties(prompt_len, config.presence_penalty, config.frequency_penalty))
    scores = scores.reshape(1, -1).float().clone()
    for processor in processors:
        scores = processor(input_ids.reshape(1, -1), scores)
    return scores[0]


def oracle_warp(scores: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """transformers' warpers in vLLM's order: temperature, min_p, top_k, top_p; the probabilities."""
    warpers = [TemperatureLogitsWarper(config.temperature)]
    if config.min_p:
        warpers.append(MinPLogitsWarper(config.min_p))
    if config.top_k:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(config.top_p))
    scores = scores.reshape(1, -1)
    for warper in warpers:
        scores = warper(None, scores)
    return torch.softmax(scores[0], dim=-1)


CONFIGS = {
    "repetition": dict(repetition_penalty=1.7),
    "presence+frequency": dict(presence_penalty=0.8, frequency_penalty=0.6),
    "negative penalties": dict(presence_penalty=-1.5, frequency_penalty=-0.25, repetition_penalty=0.5),
    "logit_bias": dict(logit_bias=((2, 5.0), (9, -100.0), (40, 1.25))),
    "min_tokens": dict(min_tokens=6, stop_token_ids=(7, 11)),
    "min_tokens ignore_eos": dict(min_tokens=6, stop_token_ids=(7,), ignore_eos=True),
    "everything": dict(min_tokens=3, stop_token_ids=(5,), logit_bias=((5, 3.0), (6, -2.0)), repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.7),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_processing_matches_transformers_processors(name):
    config = SamplingConfig(max_tokens=64, **CONFIGS[name])
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB // 2, (20,), generator=gen).tolist()  # half the vocabulary: some unseen
    answer = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    answer[3:6] = [answer[2]] * 3  # a token counted several times
    changed = 0
    for step in range(len(answer)):
        logits = torch.randn(VOCAB, generator=gen) * 3
        history = TokenHistory(prompt, answer[:step])
        ours = process(logits, config, step, history, EOS)
        theirs = oracle_process(logits, torch.tensor(prompt + answer[:step]), len(prompt), config)
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (name, step)
        finite = torch.isfinite(theirs)
        assert torch.allclose(ours[finite], theirs[finite], atol=1e-5, rtol=0), (name, step)
        changed += not torch.equal(ours, logits)
        assert sample(logits, config, step, history, EOS)[0] == int(torch.argmax(theirs))
    assert changed >= len(answer) // 2, f"{name}: the logits changed at {changed} steps only"


def test_min_tokens_masks_eos_and_stop_tokens_only_before_min_tokens():
    config = SamplingConfig(max_tokens=9, min_tokens=2, stop_token_ids=(7,))
    logits = torch.zeros(VOCAB)
    logits[3], logits[7] = 10.0, 9.0  # EOS best, then the stop token
    assert sample(logits, config, 0, None, EOS)[0] not in (3, 7)
    assert sample(logits, config, 1, None, EOS)[0] not in (3, 7)
    assert sample(logits, config, 2, None, EOS)[0] == 3


@pytest.mark.parametrize("warping", [dict(min_p=0.2), dict(min_p=0.05, top_k=9, top_p=0.8), dict(top_k=5),
                                     dict(min_p=0.6, temperature=0.3)])
def test_warping_matches_transformers_warpers(warping):
    config = SamplingConfig(max_tokens=8, **{"temperature": 0.9, **warping})
    for seed in range(5):
        logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
        ours = torch.softmax(warp(logits, config), dim=-1)
        theirs = oracle_warp(logits, config)
        assert torch.equal(ours > 0, theirs > 0), (warping, seed)
        assert torch.allclose(ours, theirs, atol=1e-6), (warping, seed)
    if "min_p" in warping:  # min_p actually drops tokens here
        assert (ours == 0).any()


def test_processing_travels_on_the_wire_and_bad_values_name_the_field():
    config = SamplingConfig(max_tokens=8, stop_token_ids=(4, 9), min_tokens=2, logit_bias=((1, -100.0), (8, 2.5)),
                            min_p=0.25, presence_penalty=-0.5, frequency_penalty=1.5, repetition_penalty=1.25)
    assert sampling_from_proto(sampling_to_proto(config)) == config
    assert sampling_from_proto(epd_pb2.ResolvedSampling(max_tokens=3, top_p=1)).repetition_penalty == 1.0
    for bad, message in [
        (dict(min_tokens=9), "min_tokens must be in [0, max_tokens=8]"),
        (dict(min_p=1.5), "min_p must be in [0, 1]"),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
        (dict(frequency_penalty=-math.inf), "frequency_penalty must be in [-2, 2]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be in (0, 2]"),
        (dict(logit_bias=((3, 100.5),)), "logit_bias: the bias of token 3 must be in [-100, 100]"),
        (dict(logit_bias=((-1, 1.0),)), "logit_bias: token id -1"),
        (dict(stop_token_ids=(-4,)), "stop_token_ids must be token ids"),
        (dict(stop_token_ids=tuple(range(1025))), "stop_token_ids may list at most 1024"),
    ]:
        with pytest.raises(ValueError) as raised:
            SamplingConfig(max_tokens=8, **bad)
        assert message in str(raised.value)


# ---------------------------------------------------------------- the tiny model

PENALTIES = dict(repetition_penalty=1.6, presence_penalty=0.9, frequency_penalty=0.7)


def _prompt_ids(oracle, prompt: str) -> list[int]:
    return oracle.inputs(prompt, [])["input_ids"][0].tolist()


@torch.no_grad()
def _teacher_forced_logits(oracle, prompt_ids: list[int], answer: list[int]) -> torch.Tensor:
    """transformers' logits for every answer position: [len(answer), vocab]."""
    ids = torch.tensor([prompt_ids + answer])
    out = oracle.model(input_ids=ids, mm_token_type_ids=torch.zeros_like(ids))
    return out.logits[0, len(prompt_ids) - 1 : len(prompt_ids) + len(answer) - 1].float()


def _assert_teacher_forced(oracle, prompt_ids, answer, config: SamplingConfig, eos) -> None:
    """Each answer token is the argmax of transformers' logits after its processors, given the
    prompt and the answer before it (greedy), or the draw epd's seeded generator makes from
    transformers' warped distribution (sampling)."""
    logits = _teacher_forced_logits(oracle, prompt_ids, answer)
    for step, token in enumerate(answer):
        scores = oracle_process(logits[step], torch.tensor(prompt_ids + answer[:step]), len(prompt_ids), config, eos)
        if config.greedy:
            best = float(scores.max())
            assert float(scores[token]) >= best - 1e-4, f"step {step}: {token} scores {float(scores[token])}, best {best}"
        else:
            probs = oracle_warp(scores, config)
            generator = torch.Generator().manual_seed((config.seed + step * _GOLDEN) & _MASK63)
            assert int(torch.multinomial(probs, 1, generator=generator)) == token, f"step {step}"


@pytest.fixture(scope="module")
def stack(openai_stack):
    return openai_stack


@pytest.fixture(scope="module")
def info(tiny_model_dir):
    return ModelInfo.load(tiny_model_dir)


def _grpc(stack, prompt: str, **sampling) -> client.GenerateResult:
    return client.generate(stack.address, client.user_request(prompt, [], **sampling), timeout_s=120)


def test_penalties_through_a_real_stack_match_transformers_teacher_forced(stack, oracle, info):
    """Greedy and seeded requests with every processor, over gRPC and the HTTP front, from
    prefill's first token through decode's batched steps: each token is what transformers'
    processors choose given the prompt and the answer before it, and the answers differ from
    the unprocessed ones (the test can fail)."""
    prompt = "Tell me a long story about a cat."
    prompt_ids = _prompt_ids(oracle, prompt)
    plain = _grpc(stack, prompt, max_tokens=32, ignore_eos=True).token_ids
    bias = {plain[0]: -100.0, plain[4]: 7.5}
    cases = [dict(PENALTIES), dict(PENALTIES, logit_bias=bias), dict(repetition_penalty=2.0),
             dict(frequency_penalty=2.0), dict(PENALTIES, temperature=0.8, seed=11, min_p=0.1, top_k=20)]
    for case in cases:
        result = _grpc(stack, prompt, max_tokens=32, ignore_eos=True, **case)
        assert result.token_ids != plain, case
        assert len(result.token_ids) == 32
        config = SamplingConfig(max_tokens=32, ignore_eos=True, **{k: (tuple(sorted(v.items())) if k == "logit_bias"
                                                                     else v) for k, v in case.items()})
        _assert_teacher_forced(oracle, prompt_ids, result.token_ids, config, info.eos_token_ids)
        # The HTTP front: vLLM's field names (logit_bias keys are strings), the same tokens.
        extra = {k: v for k, v in case.items() if k in ("repetition_penalty", "min_p", "top_k")}
        body = {k: v for k, v in case.items() if k not in extra and k != "logit_bias"}
        if "logit_bias" in case:
            body["logit_bias"] = {str(k): v for k, v in case["logit_bias"].items()}
        reply = stack.openai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=32,
            extra_body={**extra, "ignore_eos": True, "return_token_ids": True}, **body)
        assert reply.choices[0].token_ids == result.token_ids, case


def test_stop_token_ids_and_min_tokens_through_a_real_stack(stack, oracle, info):
    """A stop token ends the answer with finish_reason stop, its id the last token and its text
    left out (vLLM); min_tokens keeps it (and EOS) from being sampled before that many tokens,
    teacher-forced against transformers' MinNewTokensLengthLogitsProcessor; over both fronts."""
    prompt = "Count to ten."
    prompt_ids = _prompt_ids(oracle, prompt)
    plain = _grpc(stack, prompt, max_tokens=24, ignore_eos=True).token_ids
    at = next(i for i in range(2, 20) if plain[i] not in plain[:i] and oracle.decode([plain[i]]).strip())
    stop = plain[at]
    result = _grpc(stack, prompt, max_tokens=24, stop_token_ids=[stop])
    assert result.token_ids == plain[:at + 1]
    assert result.summary.finish_reason == "stop" and result.summary.completion_tokens == at + 1
    assert result.text == oracle.decode(plain[:at])  # the stop token's text is not part of it
    reply = stack.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=24, extra_body={"stop_token_ids": [stop],
                                                                            "return_token_ids": True})
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.token_ids, choice.message.content) == ("stop", plain[:at + 1], result.text)
    assert reply.usage.completion_tokens == at + 1
    # As the very first token (prefill ends the request).
    first = _grpc(stack, prompt, max_tokens=24, stop_token_ids=[plain[0]])
    assert (first.token_ids, first.summary.finish_reason, first.text) == ([plain[0]], "stop", "")
    # min_tokens past the stop's position: it cannot end the answer there.
    min_tokens = at + 3
    held = _grpc(stack, prompt, max_tokens=24, stop_token_ids=[stop], min_tokens=min_tokens)
    assert len(held.token_ids) > min_tokens and stop not in held.token_ids[:min_tokens]
    config = SamplingConfig(max_tokens=24, stop_token_ids=(stop,), min_tokens=min_tokens)
    _assert_teacher_forced(oracle, prompt_ids, held.token_ids, config, info.eos_token_ids)
    if held.summary.finish_reason == "stop":
        assert held.token_ids[-1] == stop
    else:
        assert held.summary.finish_reason == "length" and len(held.token_ids) == 24


def test_bad_processing_values_are_invalid_argument_naming_the_field(stack):
    import grpc

    for bad, message in [(dict(min_tokens=9, max_tokens=4), "min_tokens"), (dict(repetition_penalty=3.0),
                         "repetition_penalty"), (dict(logit_bias={10**8: 1.0}), "logit_bias: token id 100000000"),
                         (dict(stop_token_ids=[10**9]), "stop_token_ids: token id")]:
        with pytest.raises(grpc.RpcError) as raised:
            _grpc(stack, "hi", **bad)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in raised.value.details()
    with pytest.raises(openai.BadRequestError) as refused:
        stack.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, presence_penalty=2.5)
    assert "presence_penalty must be in [-2, 2]" in refused.value.body["message"]


# ---------------------------------------------------------------- a resume


@pytest.mark.parametrize("sampling", [dict(PENALTIES), dict(PENALTIES, temperature=0.9, seed=5, min_p=0.05)],
                         ids=["greedy", "seeded"])
def test_a_resume_samples_what_decode_would_have(stack, oracle, info, tiny_model_dir, redis_url, sampling):
    """Prefill replaying the prompt plus the first k answer tokens (what the router sends when a
    decode worker died) samples token k exactly as the stack's decode did: the penalties read the
    replayed answer, the seeded draw is step k's."""
    prompt = "Describe the weather today."
    prompt_ids = _prompt_ids(oracle, prompt)
    answer = _grpc(stack, prompt, max_tokens=20, ignore_eos=True, **sampling).token_ids
    engine = PrefillEngine(TextModelRunner.load(tiny_model_dir), info, EmbeddingStore(redis_url), PrefillConfig())
    try:
        config = SamplingConfig(max_tokens=20, ignore_eos=True, **sampling)
        for k in (1, 6, 13):
            request = epd_pb2.PrefillRequest(request_id=f"r{k}", token_ids=prompt_ids + answer[:k], num_generated=k,
                                             sampling=sampling_to_proto(config))
            assert engine.run(request, config).first_token == answer[k], k
    finally:
        engine.stop()


# ---------------------------------------------------------------- structured outputs


class GuidanceProcessor(LogitsProcessor):
    """llguidance's matcher as a transformers logits processor, built here from the tokenizer
    transformers loads (``llguidance.hf``), not through epd.grammar: what the answer is compared with."""

    def __init__(self, tokenizer, grammar_text: str, prompt_len: int, vocab: int, eos) -> None:
        import llguidance
        import llguidance.hf

        llg = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=sorted(eos))
        self.matcher = llguidance.LLMatcher(llg, grammar_text)
        self.prompt_len, self.fed = prompt_len, 0

    def __call__(self, input_ids, scores):
        answer = input_ids[0, self.prompt_len:].tolist()
        for token in answer[self.fed:]:
            assert self.matcher.consume_token(token)
        self.fed = len(answer)
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8) > 0
        scores = scores.clone()
        scores[:, : allowed.numel()][:, ~allowed] = float("-inf")
        scores[:, allowed.numel():] = float("-inf")
        return scores


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "kind", "tags", "owner"],
    "additionalProperties": False,
}


def _guided_generate(oracle, info, prompt: str, schema: dict, max_new_tokens: int) -> list[int]:
    import llguidance

    compiled = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
    inputs = oracle.inputs(prompt, [])
    processor = GuidanceProcessor(oracle.tokenizer, compiled, inputs["input_ids"].shape[1], info.vocab_size,
                                  info.eos_token_ids)
    with torch.no_grad():
        out = oracle.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    logits_processor=[processor])
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_structured_outputs_through_a_real_stack_validate_and_equal_transformers(stack, oracle, info):
    """A JSON-schema answer (nesting, enums, arrays, numbers) over gRPC, chat (plain and streamed)
    and completions parses and validates; greedy, it is token for token what transformers'
    generate gives with llguidance's matcher as its logits processor; seeded answers validate too.
    Without the constraint the random model's answer is no JSON at all (the test can fail)."""
    import jsonschema

    prompt = "Describe a pet as JSON."
    schema_text = json.dumps(STRUCTURED_SCHEMA)
    free = _grpc(stack, prompt, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(free.text)
    result = _grpc(stack, prompt, max_tokens=160, structured=epd_pb2.StructuredOutput(json_schema=schema_text))
    assert result.summary.finish_reason == "eos", result.text
    jsonschema.validate(json.loads(result.text), STRUCTURED_SCHEMA)
    assert result.token_ids == _guided_generate(oracle, info, prompt, STRUCTURED_SCHEMA, 160)
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": STRUCTURED_SCHEMA}}
    messages = [{"role": "user", "content": prompt}]
    reply = stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=160,
                                                 response_format=response_format)
    assert reply.choices[0].message.content == result.text and reply.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stack.openai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=160, response_format=response_format, stream=True)
        if chunk.choices)
    assert streamed == result.text
    for seed in (1, 2, 3):
        sampled = stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, seed=seed,
                                                       temperature=1.0, response_format=response_format)
        if sampled.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(sampled.choices[0].message.content), STRUCTURED_SCHEMA)
    completion = stack.openai.completions.create(model=MODEL, prompt="A pet:", max_tokens=160,
                                                 extra_body={"structured_outputs": {"json": STRUCTURED_SCHEMA}})
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), STRUCTURED_SCHEMA)
    # json_object, a choice and a regex (vLLM's structured_outputs / guided_*).
    obj = stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=120,
                                               response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                  extra_body={"structured_outputs": {"choice": ["cat", "dog"]}})
    assert choice.choices[0].message.content in ("cat", "dog")
    regex = stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                 extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    text = regex.choices[0].message.content
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha(), text


def test_bad_structured_outputs_are_refused_naming_the_problem(stack):
    import grpc

    messages = [{"role": "user", "content": "hi"}]
    for extra, problem in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "invalid json schema: Invalid type: foo"),
        ({"structured_outputs": {"regex": "[a-"}}, "invalid regex"),
        ({"response_format": {"type": "yaml"}}, "response_format.type 'yaml' is not supported"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "send one structured output per request"),
        ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos cannot be combined"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=extra)
        assert problem in refused.value.body["message"], (extra, refused.value.body)
    with pytest.raises(grpc.RpcError) as raised:
        _grpc(stack, "hi", max_tokens=4, structured=epd_pb2.StructuredOutput(grammar="start: nope"))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'structured output: invalid grammar: ' in raised.value.details()
    assert _grpc(stack, "hi", max_tokens=2).summary.completion_tokens >= 1  # still serving


def test_a_structured_resume_masks_what_decode_did(stack, oracle, info, tiny_model_dir, redis_url):
    """Prefill replaying the prompt plus the first k tokens of a constrained answer (the router's
    resume after a decode worker's death, or a replayed preemption) rebuilds the grammar state from
    them and samples token k exactly as the stack's decode did, greedy and seeded."""
    prompt = "Describe a pet as JSON."
    prompt_ids = _prompt_ids(oracle, prompt)
    spec = epd_pb2.StructuredOutput(json_schema=json.dumps(STRUCTURED_SCHEMA))
    from epd import grammar

    compiled = grammar.compile_structured(spec, grammar.tokenizer_for(info))
    engine = PrefillEngine(TextModelRunner.load(tiny_model_dir), info, EmbeddingStore(redis_url), PrefillConfig())
    try:
        for sampling in (dict(), dict(temperature=1.0, seed=7)):
            answer = _grpc(stack, prompt, max_tokens=60, structured=spec, **sampling).token_ids
            config = SamplingConfig(max_tokens=60, grammar=compiled, **sampling)
            for k in (1, 5, 12, len(answer) - 1):
                request = epd_pb2.PrefillRequest(request_id=f"s{k}", token_ids=prompt_ids + answer[:k],
                                                 num_generated=k, sampling=sampling_to_proto(config))
                assert engine.run(request, config).first_token == answer[k], (sampling, k)
    finally:
        engine.stop()


# ---------------------------------------------------------------- tools


WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
FORCED_CALL = r"<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n" \
              r"[1-9]\n</parameter>\n</function>\n</tool_call>"


def _template_ids(oracle, messages, tools) -> list[int]:
    ids = oracle.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                               enable_thinking=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_tool_conversation_round_trips_through_the_openai_client(stack, oracle):
    """tools -> an answer whose call (forced here with a regex: a random-weight model calls nothing
    by itself) comes back as tool_calls with finish_reason tool_calls, streamed and not -> the call
    and a role "tool" reply in the history -> a final answer. Each prompt is token for token what
    transformers' apply_chat_template(..., tools=...) gives."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = stack.openai.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER_TOOLS, max_tokens=160,
        extra_body={"guided_regex": FORCED_CALL, "return_token_ids": True})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert reply.prompt_token_ids == _template_ids(oracle, messages, WEATHER_TOOLS)
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] == "Paris" and 1 <= arguments["days"] <= 9
    chunks = list(stack.openai.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER_TOOLS, max_tokens=160, stream=True,
        extra_body={"guided_regex": FORCED_CALL}))
    streamed = [c for chunk in chunks if chunk.choices for c in (chunk.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without tools the same text is content (no parser runs).
    plain = stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=160,
                                                 extra_body={"guided_regex": FORCED_CALL})
    assert plain.choices[0].message.content.startswith("<tool_call>") and plain.choices[0].finish_reason == "stop"
    # The second turn: the call and its result in the history, then a final answer.
    history = messages + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    final = stack.openai.chat.completions.create(model=MODEL, messages=history, tools=WEATHER_TOOLS, max_tokens=8,
                                                 extra_body={"return_token_ids": True})
    assert final.choices[0].finish_reason in ("stop", "length") and not final.choices[0].message.tool_calls
    expected = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        history[-1]]
    assert final.prompt_token_ids == _template_ids(oracle, expected, WEATHER_TOOLS)
    # tool_choice a named function (or required): the grammar engine makes the answer that call.
    named = stack.openai.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER_TOOLS, max_tokens=300, temperature=1.0, seed=4,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    assert named.choices[0].finish_reason == "tool_calls", named.choices[0]
    (forced,) = named.choices[0].message.tool_calls
    assert forced.function.name == "get_weather" and "city" in json.loads(forced.function.arguments)
    with pytest.raises(openai.BadRequestError) as refused:
        stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                             extra_body={"tool_choice": "auto"})
    assert "tool_choice needs tools" in refused.value.body["message"]
