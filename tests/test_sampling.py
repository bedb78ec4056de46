"""Token sampling: greedy, seeded temperature / top-k / top-p, logprobs, validation, protos."""

import math

import pytest
import torch

from epd.sampling import MAX_LOGPROBS, SamplingConfig, TokenLogprobs, sample, validate
from epd.v1 import epd_pb2
from epd.wire import logprobs_to_proto, sampling_from_proto, sampling_to_proto

VOCAB = 64


def _logits(seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax():
    for seed in range(10):
        logits = _logits(seed)
        token, lp = sample(logits, SamplingConfig(max_tokens=4), step=seed)
        assert token == int(torch.argmax(logits))
        assert lp is None


def test_greedy_ignores_seed_and_step():
    logits = _logits(3)
    tokens = {sample(logits, SamplingConfig(max_tokens=1, seed=s), step=st)[0] for s in range(5) for st in range(5)}
    assert tokens == {int(torch.argmax(logits))}


def test_same_seed_and_step_gives_same_token():
    logits = _logits(1, scale=0.5)  # flat enough that sampling is genuinely random
    config = SamplingConfig(max_tokens=8, temperature=1.0, seed=42)
    for step in range(20):
        first = sample(logits, config, step)[0]
        assert all(sample(logits, config, step)[0] == first for _ in range(3))
        # a fresh but equal config (another process) agrees too
        assert sample(logits.clone(), SamplingConfig(max_tokens=8, temperature=1.0, seed=42), step)[0] == first


def test_different_steps_spread_over_tokens():
    logits = torch.zeros(VOCAB)  # uniform: every token equally likely
    config = SamplingConfig(max_tokens=8, temperature=1.0, seed=7)
    tokens = [sample(logits, config, step)[0] for step in range(200)]
    assert len(set(tokens)) > VOCAB // 2
    # and consecutive steps are not stuck on one value
    assert sum(a != b for a, b in zip(tokens, tokens[1:])) > 150


def test_different_seeds_differ():
    logits = torch.zeros(VOCAB)
    by_seed = [tuple(sample(logits, SamplingConfig(max_tokens=8, temperature=1.0, seed=s), st)[0] for st in range(10))
               for s in range(10)]
    assert len(set(by_seed)) == 10


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.tensor([0.0, math.log(3.0)] + [-1e9] * (VOCAB - 2))  # p = 1/4, 3/4
    config = SamplingConfig(max_tokens=8, temperature=1.0, seed=11)
    tokens = [sample(logits, config, step)[0] for step in range(2000)]
    assert set(tokens) == {0, 1}
    assert 0.70 < tokens.count(1) / len(tokens) < 0.80


@pytest.mark.parametrize("temperature", [0.01, 0.7, 1.0, 5.0, 100.0])
def test_top_k_1_equals_greedy(temperature):
    for seed in range(10):
        logits = _logits(seed)
        config = SamplingConfig(max_tokens=4, temperature=temperature, top_k=1, seed=seed)
        for step in range(5):
            assert sample(logits, config, step)[0] == int(torch.argmax(logits))


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_never_samples_outside_top_k(k):
    logits = _logits(5, scale=0.3)  # near-flat, so without top_k outside tokens would be hit
    allowed = set(torch.topk(logits, k).indices.tolist())
    seen = set()
    for seed in range(60):
        config = SamplingConfig(max_tokens=4, temperature=2.0, top_k=k, seed=seed)
        for step in range(5):
            token = sample(logits, config, step)[0]
            assert token in allowed
            seen.add(token)
    assert seen == allowed  # every one of the top k does get sampled


def test_top_k_larger_than_vocab_is_no_filter():
    logits = torch.zeros(VOCAB)
    config = SamplingConfig(max_tokens=4, temperature=1.0, top_k=VOCAB * 2, seed=3)
    assert len({sample(logits, config, step)[0] for step in range(300)}) > VOCAB // 2


@pytest.mark.parametrize("top_p", [1e-9, 1e-3])
def test_tiny_top_p_equals_greedy(top_p):
    for seed in range(10):
        logits = _logits(seed, scale=0.3)
        config = SamplingConfig(max_tokens=4, temperature=1.5, top_p=top_p, seed=seed)
        for step in range(5):
            assert sample(logits, config, step)[0] == int(torch.argmax(logits))


def test_top_p_keeps_the_nucleus():
    # probabilities 0.5, 0.3, 0.15, then a tail; top_p=0.7 keeps the first two only
    probs = torch.tensor([0.5, 0.3, 0.15] + [0.05 / (VOCAB - 3)] * (VOCAB - 3))
    logits = probs.log()
    seen = set()
    for seed in range(40):
        config = SamplingConfig(max_tokens=4, temperature=1.0, top_p=0.7, seed=seed)
        for step in range(5):
            seen.add(sample(logits, config, step)[0])
    assert seen == {0, 1}


def test_logprobs():
    logits = _logits(9)
    reference = torch.log_softmax(logits, dim=-1)
    for temperature in (0.0, 1.0):
        config = SamplingConfig(max_tokens=4, temperature=temperature, logprobs=5, seed=1)
        token, lp = sample(logits, config, step=2)
        assert isinstance(lp, TokenLogprobs)
        assert lp.logprob == pytest.approx(float(reference[token]), abs=1e-6)
        assert len(lp.top) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.top[0][0] == int(torch.argmax(logits))
        for tid, value in lp.top:
            assert value == pytest.approx(float(reference[tid]), abs=1e-6)
        assert [t for t, _ in lp.top] == torch.topk(reference, 5).indices.tolist()


def test_logprobs_use_raw_logits_not_temperature():
    logits = _logits(4)
    _, lp = sample(logits, SamplingConfig(max_tokens=1, temperature=3.0, logprobs=1, seed=0), step=0)
    assert lp.top[0][1] == pytest.approx(float(torch.log_softmax(logits, -1).max()), abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    full = dict(max_tokens=4) | kwargs
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**full)
    args = dict(max_tokens=4, temperature=0.0, top_p=1.0, top_k=0, logprobs=0) | kwargs
    with pytest.raises(ValueError, match=field):
        validate(**args)


def test_validation_accepts_edges():
    SamplingConfig(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, logprobs=0)
    SamplingConfig(max_tokens=1, temperature=2.0, top_p=1e-6, top_k=1, logprobs=MAX_LOGPROBS)


def test_sampling_from_proto_round_trip():
    message = epd_pb2.ResolvedSampling(
        max_tokens=33, temperature=0.75, top_p=0.5, top_k=12, seed=987654321, ignore_eos=True, logprobs=3
    )
    config = sampling_from_proto(message)
    assert config == SamplingConfig(
        max_tokens=33, temperature=0.75, top_p=0.5, top_k=12, seed=987654321, ignore_eos=True, logprobs=3
    )
    assert not config.greedy
    again = epd_pb2.ResolvedSampling.FromString(message.SerializeToString())
    assert sampling_from_proto(again) == config
    assert sampling_from_proto(sampling_to_proto(config)) == config


def test_sampling_from_proto_validates():
    with pytest.raises(ValueError, match="top_p"):
        sampling_from_proto(epd_pb2.ResolvedSampling(max_tokens=3, top_p=0.0))


def test_logprobs_to_proto_round_trip():
    assert logprobs_to_proto(None) is None
    logits = _logits(2)
    _, lp = sample(logits, SamplingConfig(max_tokens=1, logprobs=4), step=0)
    message = epd_pb2.TokenLogprobs.FromString(logprobs_to_proto(lp).SerializeToString())
    assert message.logprob == pytest.approx(lp.logprob, abs=1e-6)
    assert [t.token_id for t in message.top] == [t for t, _ in lp.top]
    assert [t.logprob for t in message.top] == pytest.approx([v for _, v in lp.top], abs=1e-6)


@pytest.mark.parametrize("temperature", [1e-38, 1e-40])
def test_tiny_positive_temperature_behaves_like_greedy(temperature):
    logits = _logits(6, scale=3.0)
    config = SamplingConfig(max_tokens=1, temperature=temperature, seed=1)  # validation accepts it
    assert sample(logits, config, step=0)[0] == int(torch.argmax(logits))


def test_prompt_logprobs_give_each_target_its_logprob_rank_and_the_best():
    from epd.sampling import prompt_logprobs

    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0], [0.0, 3.0, 3.0, -1.0]])
    out = prompt_logprobs(logits, torch.tensor([2, 3]), num_top=2)
    reference = torch.log_softmax(logits, dim=-1)
    assert [entry.token_id for entry in out] == [2, 3]
    assert [entry.logprob for entry in out] == pytest.approx([float(reference[0, 2]), float(reference[1, 3])])
    assert [entry.rank for entry in out] == [2, 4]  # a tie shares the better rank, as vLLM counts
    assert [t for t, _ in out[0].top] == [0, 1] or [t for t, _ in out[0].top] == [0, 2]
    assert [entry.top for entry in prompt_logprobs(logits, torch.tensor([0, 1]), num_top=0)] == [[], []]
