"""Conversions between the library's types and the wire messages (``epd.v1``), in one place."""

from __future__ import annotations

from epd.sampling import PromptLogprob, SamplingConfig, TokenLogprobs
from epd.v1 import epd_pb2


def sampling_to_proto(config: SamplingConfig) -> epd_pb2.ResolvedSampling:
    return epd_pb2.ResolvedSampling(
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        seed=config.seed,
        ignore_eos=config.ignore_eos,
        logprobs=config.logprobs,
        stop_token_ids=list(config.stop_token_ids),
        min_tokens=config.min_tokens,
        logit_bias=dict(config.logit_bias),
        min_p=config.min_p,
        presence_penalty=config.presence_penalty,
        frequency_penalty=config.frequency_penalty,
        repetition_penalty=config.repetition_penalty,
        grammar=config.grammar,
    )


def sampling_from_proto(message: epd_pb2.ResolvedSampling) -> SamplingConfig:
    """Raises ValueError naming the first out-of-range value (a forged or corrupt message)."""
    return SamplingConfig(
        max_tokens=message.max_tokens,
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        seed=message.seed,
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs,
        stop_token_ids=tuple(message.stop_token_ids),
        min_tokens=message.min_tokens,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        min_p=message.min_p,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
        grammar=message.grammar,
    )


def logprobs_to_proto(logprobs: TokenLogprobs | None) -> epd_pb2.TokenLogprobs | None:
    if logprobs is None:
        return None
    return epd_pb2.TokenLogprobs(
        logprob=logprobs.logprob, top=[epd_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top]
    )


def prompt_logprob_to_proto(entry: PromptLogprob) -> epd_pb2.TokenLogprobs:
    return epd_pb2.TokenLogprobs(logprob=entry.logprob, rank=entry.rank, token_id=entry.token_id,
                                 top=[epd_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in entry.top])
