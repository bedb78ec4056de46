"""The router's request path in-process (a real tokenizer and prompt builder, a real redis-server),
with the replicas it calls replaced by small stand-ins, to reach the failure paths that a healthy
deployment never takes."""

from __future__ import annotations

import asyncio

import pytest

from bench.synthetic import make_image
from epd import client, errors
from epd.config import RouterConfig
from epd.imaging import probe_image
from epd.modelinfo import ModelInfo
from epd.store import EmbeddingStore
from epd.v1 import epd_pb2
from router_svc.core import RouterCore
from router_svc.prompt import PromptBuilder


class Balancer:
    def num_available(self) -> int:
        return 1

    def capacity_tokens(self) -> int:
        return 0  # no replica said how many tokens its K/V pool holds

    def note_stored(self, address: str, keys: bytes) -> None:
        self.stored = getattr(self, "stored", b"") + keys  # what a prefill reply said it stored


class NoDecode:
    """Never reached in a test that uses it: only its balancer is read (the K/V capacity check)."""

    balancer = Balancer()


class ShortEncoder:
    """An Encoder service whose reply leaves out the last image (a broken or skewed replica)."""

    balancer = Balancer()

    def __init__(self, settings) -> None:
        self.settings = settings
        self.calls = 0
        self.short = True

    async def call(self, method, request, timeout, retry=True, busy_next=False, route=None):
        self.calls += 1
        items = list(request.items)[:-1] if self.short else list(request.items)
        images = [epd_pb2.EncodedImage(store_key=i.store_key, num_tokens=probe_image(i.data, self.settings).num_tokens)
                  for i in items]
        return epd_pb2.EncodeResponse(images=images), "here"


class NoPrefill:
    balancer = Balancer()

    async def call(self, method, request, timeout, retry=True, busy_next=False, route=None):
        raise errors.Unavailable("prefill: there is none in this test")


def test_a_short_encoder_reply_fails_its_request_and_never_strands_a_waiter(tiny_model_dir, redis_url):
    info = ModelInfo.load(tiny_model_dir)
    builder = PromptBuilder.load(tiny_model_dir, info, 64 * 1024 * 1024)
    store = EmbeddingStore(redis_url)
    encoder = ShortEncoder(builder.settings)
    images = [make_image(128, 128, seed=s) for s in (1, 2)]
    request = client.user_request("Two pictures.", images, max_tokens=4)

    async def drain(core):
        async for _ in core.generate(request, 30):
            pass

    async def scenario():
        core = RouterCore(RouterConfig(), builder, store, encoder, NoPrefill(), NoDecode())
        first = asyncio.ensure_future(drain(core))
        second = asyncio.ensure_future(drain(core))  # waits on the first one's encode (single flight)
        with pytest.raises(errors.ServiceError, match="lacks 1 of 2 images"):
            await asyncio.wait_for(first, 10)
        # The waiter is told (it then tries itself), and later requests lead the keys again:
        # none of them is left waiting until its deadline.
        with pytest.raises(errors.ServiceError, match="lacks 1 of 2 images"):
            await asyncio.wait_for(second, 10)
        encoder.short = False
        with pytest.raises(errors.Unavailable, match="prefill: there is none"):
            await asyncio.wait_for(drain(core), 10)  # past the encode: nothing was stranded
        assert encoder.calls == 3

    try:
        asyncio.run(scenario())
    finally:
        store.close()


class OnePrefill:
    """A prefill worker whose reply is the first of ``tokens`` and hands the rest to ``decode-a``."""

    balancer = Balancer()

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    async def call(self, method, request, timeout, retry=True, busy_next=False, route=None):
        return epd_pb2.PrefillResponse(first_token=self.tokens[0], decode_addr="decode-a",
                                       first_logprobs=epd_pb2.TokenLogprobs(logprob=-0.0)), "here"


class RunAheadDecode:
    """A decode worker that streams ``tokens`` in batches of ``batch`` (as a busy worker runs ahead of
    the router: a batch can carry tokens generated after a stop string), each with its own logprob
    (-index, so every token's logprob says which token it is)."""

    balancer = Balancer()
    metadata = ()

    def __init__(self, tokens: list[int], batch: int) -> None:
        self.tokens, self.batch = tokens, batch
        self.cancelled = False
        self.stubs = self

    def get(self, address):
        return self

    def Stream(self, request, timeout, metadata):  # noqa: N802 - the stub's method name
        decode = self

        class Call:
            def __aiter__(self):
                return self.batches()

            async def batches(self):
                for start in range(1, len(decode.tokens), decode.batch):
                    ids = decode.tokens[start:start + decode.batch]
                    yield epd_pb2.TokenBatch(token_ids=ids, logprobs=[
                        epd_pb2.TokenLogprobs(logprob=-float(i)) for i in range(start, start + len(ids))])
                yield epd_pb2.TokenBatch(finish_reason="length")

            def cancel(self):
                decode.cancelled = True

        return Call()


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 64])
def test_a_stop_string_ends_token_ids_and_logprobs_at_the_token_that_completed_it(tiny_model_dir, redis_url, batch):
    """However decode batches its tokens, the completion ends with the token whose text completes the
    stop string: the usage count, the token ids and the logprobs relayed are the same every time."""
    info = ModelInfo.load(tiny_model_dir)
    builder = PromptBuilder.load(tiny_model_dir, info, 64 * 1024 * 1024)
    tokenizer = builder.tokenizer
    tokens = tokenizer.encode("one two three STOP four five six seven eight nine ten")
    # The first prefix of the tokens whose text holds the stop string: where it completes.
    complete = next(n for n in range(1, len(tokens) + 1) if "STOP" in tokenizer.decode(tokens[:n]))
    assert 2 < complete < len(tokens) - 4  # tokens come after the stop, so a batch can run past it
    request = client.user_request("Count.", [], max_tokens=len(tokens), logprobs=1, stop=["STOP"])
    decode = RunAheadDecode(tokens, batch)

    store = EmbeddingStore(redis_url)

    async def scenario():
        core = RouterCore(RouterConfig(), builder, store, ShortEncoder(builder.settings), OnePrefill(tokens), decode)
        return [event async for event in core.generate(request, 30)]

    try:
        events = asyncio.run(scenario())
    finally:
        store.close()
    chunks = [e.chunk for e in events if e.WhichOneof("event") == "chunk"]
    summary = events[-1].summary
    token_ids = [t for c in chunks for t in c.token_ids]
    logprobs = [entry.logprob for c in chunks for entry in c.logprobs]
    assert token_ids == tokens[:complete]
    assert logprobs == [-float(i) for i in range(complete)]
    assert summary.completion_tokens == complete and summary.finish_reason == "stop"
    assert "".join(c.text for c in chunks) == "one two three "
    assert decode.cancelled


class SilentDecode:
    """A decode worker that accepts the stream of a handed-off request and sends nothing (the
    first token is still being computed), and answers a drop (``discovery.drop_handoff``'s read)."""

    balancer = Balancer()
    metadata = ()

    def __init__(self) -> None:
        self.streams: list[str] = []  # the request ids of every Stream call, in order
        self.reads = 0
        self.stubs = self

    def get(self, address):
        return self

    def Stream(self, request, timeout, metadata):  # noqa: N802 - the stub's method name
        decode = self
        decode.streams.append(request.request_id)

        class Call:
            def __aiter__(self):
                return self.batches()

            async def batches(self):
                await asyncio.Event().wait()  # nothing comes until the caller leaves
                yield epd_pb2.TokenBatch()

            async def read(self):
                decode.reads += 1
                return epd_pb2.TokenBatch(finish_reason="abort")

            def cancel(self):
                pass

        return Call()


def test_a_client_that_leaves_before_its_first_streamed_token_is_no_longer_carried(tiny_model_dir, redis_url):
    """A client leaves after its prompt was handed to decode and before decode streamed anything:
    the router drops the handoff (its slot is freed now) and no longer counts the request as one
    it carries (the running gauge once stayed at 1 for each such departure)."""
    info = ModelInfo.load(tiny_model_dir)
    builder = PromptBuilder.load(tiny_model_dir, info, 64 * 1024 * 1024)
    request = client.user_request("Count.", [], max_tokens=16)
    decode = SilentDecode()
    store = EmbeddingStore(redis_url)

    def running(core) -> float:
        families = {family.name: family for family in core.metrics()}
        return sum(families["epd_router_running_requests"].samples.values())

    async def scenario():
        core = RouterCore(RouterConfig(), builder, store, ShortEncoder(builder.settings), OnePrefill([7]), decode)

        async def consume():
            async for _ in core.generate(request, 30):
                pass

        task = asyncio.ensure_future(consume())
        for _ in range(500):  # until the relay has opened the decode stream
            if decode.streams:
                break
            await asyncio.sleep(0.01)
        assert decode.streams and running(core) == 1
        task.cancel()  # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the drop runs beside the departure
            if decode.reads:
                break
            await asyncio.sleep(0.01)
        assert decode.reads == 1 and len(decode.streams) == 2  # the relay's stream, then the drop's
        assert core.active == set() and running(core) == 0

    try:
        asyncio.run(scenario())
    finally:
        store.close()
