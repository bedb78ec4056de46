"""One vision forward per image across the deployment: 2 routers, 2 Encoder services and 2 encoder
replicas, and concurrent requests for one new image through all of them (issue 20). Single flight
works per router and per Encoder service; across them the encoder replicas take a lease on the
image in the store (``SET NX`` with an expiry), so one computes and the others wait for its result,
and a holder that died cannot keep the lease past its expiry."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import pytest
import redis

from bench.synthetic import make_image
from control.redis_server import EmbeddedRedis
from epd import client, imaging, store
from epd.modelinfo import ModelInfo
from tests.conftest import ServeProcess, epd_status, ray_address

_STATS = """
import json, sys
from control.cli import _ray_env
_ray_env(sys.argv[1])
import ray
ray.init(address=sys.argv[1], namespace="epd", logging_level="ERROR")
print(json.dumps({n: ray.get(ray.get_actor(n).stats.remote(), timeout=60) for n in sys.argv[2:]}))
"""


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    redis_server = EmbeddedRedis(max_memory_mb=256)
    serve = None
    try:
        serve = ServeProcess(tiny_model_dir, "--routers", "2", "--encode-services", "2", "--encoders", "2",
                             "--redis", redis_server.url,
                             log_path=str(tmp_path_factory.mktemp("logs") / "serve-lease.log"))
        address = ray_address(serve)
        roles = epd_status(address)["roles"]
        serve.routers = [r["address"] for r in roles["router"]]
        serve.encoders = [r["name"] for r in roles["encoder"]]
        serve.redis_url = redis_server.url
        yield serve
    finally:
        left = serve.stop() if serve is not None else []
        redis_server.stop()
    assert left == [], "epd serve left processes behind"


def _forwards(fleet) -> int:
    """Images the encoder replicas ran through the vision tower, in all."""
    out = subprocess.run([sys.executable, "-c", _STATS, ray_address(fleet), *fleet.encoders], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return sum(s["num_encoded"] for s in json.loads(out.stdout.strip().splitlines()[-1]).values())


def _ten_at_once(fleet, image: bytes) -> list[client.GenerateResult]:
    """10 concurrent requests for ``image``, 5 through each router."""
    request = client.user_request("What is it?", [image], max_tokens=8)
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(client.generate, fleet.routers[i % 2], request, timeout_s=120) for i in range(10)]
        return [f.result() for f in futures]


def test_ten_requests_for_one_new_image_through_every_router_and_service_encode_it_once(fleet, oracle):
    before = _forwards(fleet)
    image = make_image(320, 240, seed=2020)
    results = _ten_at_once(fleet, image)
    assert _forwards(fleet) - before == 1
    want = oracle.generate("What is it?", [image], max_new_tokens=8)[0]
    assert all(r.token_ids == want for r in results)


def test_a_lease_whose_holder_died_expires_and_the_image_is_encoded_once(fleet, oracle, tiny_model_dir):
    """The holder's process is gone (the lease is planted as it would have left it: nobody renews
    it): the requests wait for its expiry, then one replica takes the lease and encodes."""
    image = make_image(300, 200, seed=2021)
    info = ModelInfo.load(tiny_model_dir)
    key = store.store_key(info.fingerprint, imaging.image_key(image, info.image_settings(64 * 1024 * 1024)))
    raw = redis.Redis.from_url(fleet.redis_url)
    before = _forwards(fleet)  # (a Ray driver: seconds) before the lease's clock starts
    assert raw.set(store.EmbeddingStore.lease_key(key), "encoder-dead", nx=True, px=3000)
    started = time.monotonic()
    results = _ten_at_once(fleet, image)
    took = time.monotonic() - started
    assert _forwards(fleet) - before == 1
    assert 2.0 < took < 3.0 + 20, f"the requests took {took:.1f} s against a 3 s lease"
    want = oracle.generate("What is it?", [image], max_new_tokens=8)[0]
    assert all(r.token_ids == want for r in results)
    assert not raw.exists(store.EmbeddingStore.lease_key(key))  # the holder gave it back
