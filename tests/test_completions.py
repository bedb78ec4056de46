"""The legacy ``POST /v1/completions`` (and the gRPC completion prompt under it) through a real
`epd serve` and the `openai` client: a prompt as text or token ids is completed as it is (no chat
template), greedy tokens equal transformers' generate on the raw prompt ids, streamed and not, with
echo, the legacy integer logprobs, stop strings, seeds and usage; what is refused names its field.
vLLM's prompt_logprobs on both fronts (chat with an image, completions with echo) against
transformers' forward over the same prompt, on this module's stack."""

from __future__ import annotations

import grpc
import openai
import pytest
import torch

from bench.synthetic import make_image
from epd import client, limits
from epd.dataurl import encode_data_url
from epd.v1 import epd_pb2

MODEL = "epd-tiny"
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def stack(openai_stack):
    openai_stack.completions = openai_stack.openai.completions
    return openai_stack


def _ids(oracle, text: str) -> list[int]:
    return oracle.tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def _generate(oracle, ids: list[int], n: int, ignore_eos: bool = True) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of the raw ids, and the first token's logits."""
    inputs = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.zeros(1, len(ids), dtype=torch.int)}
    if ignore_eos:
        tokens = oracle.generate_through_eos(inputs, n)
    else:
        tokens = oracle.model.generate(**inputs, max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    logits = oracle.model(**inputs).logits[0, -1].float()
    return tokens, logits


def test_greedy_completion_equals_transformers_generate_on_the_raw_prompt(stack, oracle):
    ids = _ids(oracle, PROMPT)
    expected, logits = _generate(oracle, ids, 24)
    reply = stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, logprobs=3,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = reply.choices[0]
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert choice.token_ids == expected and choice.prompt_token_ids == ids
    assert choice.text == oracle.decode(expected) and choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        len(ids), 24, len(ids) + 24)
    # The legacy logprobs object: one entry per token, the first token's against transformers' logits.
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 24
    reference = torch.log_softmax(logits, dim=-1)
    assert abs(lp.token_logprobs[0] - float(reference[expected[0]])) < 1e-4
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(24)]
    # The same prompt as token ids, and as a list of one prompt, gives the same tokens.
    for prompt in (ids, [ids], [PROMPT]):
        again = stack.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        assert again.choices[0].token_ids == expected
    # Without ignore_eos: transformers' own stopping.
    stopped, _ = _generate(oracle, ids, 40, ignore_eos=False)
    plain = stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, extra_body={"return_token_ids": True})
    assert plain.choices[0].token_ids == stopped


def test_streamed_echo_stop_and_seed(stack, oracle):
    ids = _ids(oracle, PROMPT)
    expected, _ = _generate(oracle, ids, 20)
    whole = stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, echo=True,
                                     extra_body={"ignore_eos": True})
    assert whole.choices[0].text == PROMPT + oracle.decode(expected)
    chunks = list(stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stream=True, echo=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])] == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    # A stop string: the text ends before it.
    text = oracle.decode(expected)
    stop = text[len(text) // 2:][:3]
    cut = stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stop=[stop],
                                   extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]
    # Seeded sampling: the same seed, the same text; the answers are not greedy's.
    runs = [stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95, seed=7,
                                     extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0] != expected[:16]


def test_the_grpc_completion_prompt(stack, oracle):
    ids = _ids(oracle, PROMPT)
    expected, _ = _generate(oracle, ids, 12)
    for request in (epd_pb2.GenerateRequest(prompt=PROMPT), epd_pb2.GenerateRequest(prompt_token_ids=ids)):
        request.sampling.max_tokens, request.sampling.ignore_eos = 12, True
        result = client.generate(stack.address, request, timeout_s=120)
        assert result.token_ids == expected and result.summary.prompt_tokens == len(ids)
    for request, message in [
        (epd_pb2.GenerateRequest(prompt=PROMPT, prompt_token_ids=ids), "not both"),
        (epd_pb2.GenerateRequest(prompt=PROMPT, messages=[epd_pb2.ChatMessage(role="user")]), "not both"),
        (epd_pb2.GenerateRequest(prompt_token_ids=[10**8]), "prompt_token_ids: 100000000 is not a token id"),
        (epd_pb2.GenerateRequest(prompt_token_ids=[oracle.image_token_id]), "a completion has no images"),
    ]:
        with pytest.raises(grpc.RpcError) as raised:
            client.generate(stack.address, request, timeout_s=60)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in raised.value.details()


@pytest.mark.parametrize("extra,message", [
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": [1, "x"]}, "prompt must be a string, a list of token ids"),
    ({"prompt": PROMPT, "suffix": "!"}, "suffix: not supported"),
    ({"prompt": PROMPT, "best_of": 2}, "best_of: not supported"),
    ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs must be an integer in [0, 20]"),
    ({"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs -1 (the whole vocabulary) is not supported"),
    ({"prompt": [[7] * (limits.MAX_PROMPT_LOGPROB_ENTRIES // 21 + 2)], "prompt_logprobs": 20},
     f"more than the {limits.MAX_PROMPT_LOGPROB_ENTRIES} one answer may hold"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ({"prompt": PROMPT, "n": 17}, "n must be an integer in [1, 16]"),
    ({"prompt": PROMPT, "cache_salt": ""}, "cache_salt must be a non-empty string"),
    ({"prompt": PROMPT, "min_p": 2.0}, "min_p must be in [0, 1]"),
    ({"prompt": [[10**8]]}, "is not a token id"),
])
def test_refusals_name_the_field(stack, extra, message):
    with pytest.raises(openai.BadRequestError) as raised:
        stack.completions.create(model=MODEL, max_tokens=4, **{"prompt": extra.pop("prompt")}, extra_body=extra)
    assert message in raised.value.body["message"]


def _check_prompt_logprobs(reference: torch.Tensor, prompt_ids: list[int], entries: list[dict | None], num_top: int):
    """vLLM's prompt_logprobs list (null, then {token id: {logprob, rank, decoded_token}} per token,
    the prompt token first) against transformers' log-softmax rows: logprobs within 1e-4, ranks
    within the tolerance's ties, the same top ids."""
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for position, step in enumerate(entries[1:], start=1):
        row, token = reference[position - 1], prompt_ids[position]
        ids = [int(key) for key in step]
        assert ids[0] == token
        first = step[str(token)]
        assert abs(first["logprob"] - float(row[token])) < 1e-4
        assert int((row > row[token] + 1e-4).sum()) + 1 <= first["rank"] <= int((row > row[token] - 1e-4).sum()) + 1
        top = torch.topk(row, num_top).indices.tolist()
        assert ids == [token] + [t for t in top if t != token]  # the prompt token, then the best, once each
        for rank, t in enumerate(top, start=1):
            assert abs(step[str(t)]["logprob"] - float(row[t])) < 1e-4
            assert t == token or step[str(t)]["rank"] == rank


def test_prompt_logprobs_on_both_fronts_equal_transformers(stack, oracle):
    """A chat with an image: gRPC and HTTP (whole and streamed) give every prompt token's logprob,
    rank and top 3 as transformers' forward over the prompt does; a repeat of the request (whose
    prefix is cached by now) computes it again, and the answer is the same."""
    image = make_image(448, 448, seed=11)
    inputs = oracle.inputs("Describe it.", [image])
    prompt_ids = inputs["input_ids"][0].tolist()
    reference = oracle.prompt_logprobs(inputs)
    request = client.user_request("Describe it.", [image], max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    result = client.generate(stack.address, request, timeout_s=120)
    grpc_entries = [None] + [{str(e.token_id): {"logprob": e.logprob, "rank": e.rank},
                              **{str(a.token_id): {"logprob": a.logprob, "rank": r} for r, a in enumerate(e.top, 1)
                                 if a.token_id != e.token_id}} for e in result.prompt_logprobs]
    _check_prompt_logprobs(reference, prompt_ids, grpc_entries, 3)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": encode_data_url(image)}},
                                             {"type": "text", "text": "Describe it."}]}]
    chat = stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                extra_body={"prompt_logprobs": 3, "ignore_eos": True})
    entries = chat.to_dict()["prompt_logprobs"]
    _check_prompt_logprobs(reference, prompt_ids, entries, 3)
    assert entries[1][str(prompt_ids[1])]["decoded_token"] == oracle.decode([prompt_ids[1]])
    assert chat.usage.prompt_tokens == len(prompt_ids)
    chunks = list(stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True,
                                                       extra_body={"prompt_logprobs": 3, "ignore_eos": True}))
    streamed = [c.to_dict()["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c.to_dict()]
    assert len(streamed) == 1 and _close(streamed[0], entries)


def _close(a: list, b: list) -> bool:
    """Two prompt_logprobs lists with the same ids and ranks, logprobs within 1e-5 (other forwards)."""
    return len(a) == len(b) and all(x == y if x is None or y is None else list(x) == list(y) and all(
        abs(x[k]["logprob"] - y[k]["logprob"]) < 1e-5 and x[k]["rank"] == y[k]["rank"] for k in x) for x, y in zip(a, b))


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(stack, oracle):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 1): the logprobs object covers
    the prompt's tokens (the first one's null) and then the completion's, streamed and not."""
    ids = _ids(oracle, PROMPT)
    inputs = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.zeros(1, len(ids), dtype=torch.int)}
    reference = oracle.prompt_logprobs(inputs)
    reply = stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2, temperature=0)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [float(reference[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert all(abs(got - w) < 1e-4 for got, w in zip(lp.token_logprobs[1:len(ids)], want))
    assert all(oracle.decode([ids[p]]) in lp.top_logprobs[p] and len(lp.top_logprobs[p]) <= 3 for p in range(1, len(ids)))
    assert abs(lp.token_logprobs[-1] - float(reference[-1].max())) < 1e-4  # greedy: the best token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids) + 1)]
    assert choice.text.startswith(PROMPT)
    _check_prompt_logprobs(reference, ids, choice.to_dict()["prompt_logprobs"], 2)
    chunks = list(stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2,
                                           temperature=0, stream=True))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == choice.text
    assert [t for p in pieces if p.logprobs for t in p.logprobs.tokens] == lp.tokens
    assert _close(pieces[0].to_dict()["prompt_logprobs"], choice.to_dict()["prompt_logprobs"])


def test_prompt_logprobs_bounds_on_grpc(stack):
    for sampling, message in [
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20], got 21"),
        ({"prompt_logprobs": 20}, f"more than the {limits.MAX_PROMPT_LOGPROB_ENTRIES} one answer may hold"),
    ]:
        request = epd_pb2.GenerateRequest(prompt_token_ids=[7] * (limits.MAX_PROMPT_LOGPROB_ENTRIES // 21 + 2),
                                          sampling=epd_pb2.SamplingParams(max_tokens=1, **sampling))
        with pytest.raises(grpc.RpcError) as raised:
            client.generate(stack.address, request, timeout_s=60)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in raised.value.details()


def test_top_logprobs_hold_the_sampled_token_then_the_best(stack, oracle):
    """The legacy logprobs object, as OpenAI's API and vLLM give it: one {text: logprob} object per
    token holding the sampled token itself, then the best ``logprobs`` (up to logprobs + 1 entries;
    ``logprobs: 0``: the sampled token's alone), streamed and not. Sampled at temperature 1, so the
    token is often not among the best."""
    ids = _ids(oracle, PROMPT)
    extra = {"ignore_eos": True, "return_token_ids": True}
    only = stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=0, extra_body=extra)
    lp = only.choices[0].logprobs
    assert lp.top_logprobs == [{token: logprob} for token, logprob in zip(lp.tokens, lp.token_logprobs)]
    reply = stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=1, temperature=1.0, seed=5,
                                     extra_body=extra)
    lp, token_ids = reply.choices[0].logprobs, reply.choices[0].token_ids
    full = ids + token_ids
    with torch.no_grad():
        logits = oracle.model(input_ids=torch.tensor([full]), mm_token_type_ids=torch.zeros(1, len(full), dtype=torch.int)
                              ).logits[0].float()
    outside = 0
    for position, (token, top) in enumerate(zip(lp.tokens, lp.top_logprobs)):
        best = int(logits[len(ids) - 1 + position].argmax())
        assert list(top)[0] == token and top[token] == lp.token_logprobs[position]
        assert oracle.tokenizer.decode([best]) in top and len(top) <= 2
        outside += token_ids[position] != best
    assert outside > 0  # some sampled token was not the best: its object held both
    chunks = list(stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=1, temperature=1.0,
                                           seed=5, stream=True, extra_body=extra))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs]
    assert [list(top) for top in streamed] == [list(top) for top in lp.top_logprobs]  # the prefix cache: 1e-4
    assert all(abs(a[k] - b[k]) < 1e-4 for a, b in zip(streamed, lp.top_logprobs) for k in a)


def _metric(stack, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://{stack.http}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_n_choices_compute_the_prompt_logprobs_once(stack, oracle):
    """With n > 1 the prompt's logprobs are computed for the first choice only (the router's
    epd_prompt_logprob_tokens_total grows by the prompt once) and every choice shows them:
    completions per choice, chat once at the top, streamed and not."""
    ids = _ids(oracle, PROMPT)
    extra = {"prompt_logprobs": 2, "ignore_eos": True}
    before = _metric(stack, "epd_prompt_logprob_tokens_total")
    reply = stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=3, temperature=1.0, seed=1,
                                     extra_body=extra)
    assert _metric(stack, "epd_prompt_logprob_tokens_total") - before == len(ids) - 1
    lists = [choice.to_dict()["prompt_logprobs"] for choice in reply.choices]
    assert len(lists[0]) == len(ids) and lists[1] == lists[0] and lists[2] == lists[0]
    chunks = list(stack.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=3, temperature=1.0, seed=1,
                                           stream=True, extra_body=extra))
    assert _metric(stack, "epd_prompt_logprob_tokens_total") - before == 2 * (len(ids) - 1)
    streamed = {c.choices[0].index: c.choices[0].to_dict()["prompt_logprobs"] for c in chunks
                if c.choices and "prompt_logprobs" in c.choices[0].to_dict()}
    assert sorted(streamed) == [0, 1, 2] and all(_close(entries, lists[0]) for entries in streamed.values())
    messages = [{"role": "user", "content": PROMPT}]
    chat = stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=3, temperature=1.0,
                                                extra_body=extra)
    prompt = chat.to_dict()["prompt_logprobs"]
    assert len(prompt) == chat.usage.prompt_tokens and len(chat.choices) == 3
    assert _metric(stack, "epd_prompt_logprob_tokens_total") - before == 2 * (len(ids) - 1) + len(prompt) - 1
    chunks = list(stack.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=3,
                                                       temperature=1.0, stream=True, extra_body=extra))
    carrying = [c.to_dict()["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c.to_dict()]
    assert len(carrying) == 1 and _close(carrying[0], prompt)

