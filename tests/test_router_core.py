"""The router's request path in-process (a real tokenizer and prompt builder, a real redis-server),
with the replicas it calls replaced by small stand-ins, to reach the failure paths that a healthy
deployment never takes."""

from __future__ import annotations

import asyncio

import pytest

from bench.synthetic import make_image
from control.redis_server import EmbeddedRedis
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


class ShortEncoder:
    """An Encoder service whose reply leaves out the last image (a broken or skewed replica)."""

    balancer = Balancer()

    def __init__(self, settings) -> None:
        self.settings = settings
        self.calls = 0
        self.short = True

    async def call(self, method, request, timeout, retry=True):
        self.calls += 1
        items = list(request.items)[:-1] if self.short else list(request.items)
        images = [epd_pb2.EncodedImage(store_key=i.store_key, num_tokens=probe_image(i.data, self.settings).num_tokens)
                  for i in items]
        return epd_pb2.EncodeResponse(images=images), "here"


class NoPrefill:
    balancer = Balancer()

    async def call(self, method, request, timeout, retry=True):
        raise errors.Unavailable("prefill: there is none in this test")


@pytest.fixture(scope="module")
def redis_url():
    server = EmbeddedRedis(max_memory_mb=16)
    yield server.url
    server.stop()


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
        core = RouterCore(RouterConfig(), builder, store, encoder, NoPrefill(), None)
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
