"""Scaling at run time on a real local Ray (`epd serve` + `epd scale`), and encoder autoscaling.

Requests keep flowing while the encoder count changes; none may fail and every answer must still
match transformers token for token. Every request carries fresh images so the encoders really
work during the change (a store hit would bypass them).
"""

from __future__ import annotations

import itertools
import re
import threading
import time
import urllib.request

import pytest

from bench.synthetic import make_image
from epd import client
from tests.conftest import ServeProcess, epd, epd_status, ray_address, serving


def encoder_count(ray_address: str) -> int:
    return len([r for r in epd_status(ray_address)["roles"]["encoder"] if not r["draining"]])


class Load:
    """Clients sending requests with fresh images until stopped; keeps every answer and failure."""

    def __init__(self, address: str, num_clients: int, images_per_request: int, size: int = 224,
                 max_tokens: int = 6, pause_s: float = 0.0) -> None:
        self.pause_s = pause_s  # between a client's requests: keeps the oracle's later check short
        self.address = address
        self.images_per_request = images_per_request
        self.size = size
        self.max_tokens = max_tokens
        self.seeds = itertools.count(10_000)
        self.lock = threading.Lock()
        self.done: list[tuple[str, list[bytes], list[int]]] = []
        self.failures: list[BaseException] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(num_clients)]
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        while not self.stop.is_set():
            self.send(self.images_per_request)
            self.stop.wait(self.pause_s)

    def send(self, images_per_request: int) -> None:
        """One request with fresh images; keeps its answer, or its failure."""
        with self.lock:
            seeds = [next(self.seeds) for _ in range(images_per_request)]
        images = [make_image(self.size, self.size, seed=s) for s in seeds]
        prompt = f"Describe {len(images)} pictures."
        try:
            result = client.generate(self.address, client.user_request(
                prompt, images, max_tokens=self.max_tokens, temperature=0.0), timeout_s=300)
            with self.lock:
                self.done.append((prompt, images, result.token_ids))
        except BaseException as error:  # noqa: BLE001 - every failure is a test failure
            with self.lock:
                self.failures.append(error)

    def burst(self, num_requests: int, images_per_request: int) -> None:
        """``num_requests`` concurrent requests now, each with fresh images; waits for them."""
        threads = [threading.Thread(target=self.send, args=(images_per_request,)) for _ in range(num_requests)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)

    def wait_for(self, count: int, timeout_s: float = 300) -> None:
        """Until ``count`` requests have answered (or one failed: the test reports it)."""
        deadline = time.monotonic() + timeout_s
        while len(self.done) < count and not self.failures:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(self.done)} of {count} requests answered in {timeout_s:.0f} s")
            time.sleep(0.2)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=300)


@pytest.fixture(scope="module")
def scalable(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir, "--encoders", "1",
                 log_path=str(tmp_path_factory.mktemp("logs") / "scalable.log")) as server:
        yield server


@pytest.mark.timeout(1800)
def test_scale_encoders_1_3_1_while_requests_run(scalable, oracle):
    address = ray_address(scalable)
    load = Load(scalable.address, num_clients=2, images_per_request=2, pause_s=1.0)
    try:
        load.wait_for(3)
        up = epd("scale", "--address", address, "encoders", "3")
        assert up.returncode == 0, up.stderr
        assert encoder_count(address) == 3
        at_three = len(load.done)
        load.wait_for(at_three + 4)
        down = epd("scale", "--address", address, "encoders", "1")
        assert down.returncode == 0, down.stderr
        load.burst(num_requests=3, images_per_request=3)  # at once: nothing may still pick a removed replica
        assert encoder_count(address) == 1
        load.wait_for(len(load.done) + 2)
    finally:
        load.finish()
    assert load.failures == [], load.failures[:3]
    assert len(load.done) >= 8
    for prompt, images, token_ids in load.done:
        assert token_ids == oracle.generate(prompt, images, max_new_tokens=load.max_tokens)[0]


def test_scale_refuses_unknown_counts_and_roles(scalable):
    address = ray_address(scalable)
    out = epd("scale", "--address", address, "encoders", "0")
    assert out.returncode == 2 and "epd scale: error: argument count: must be in [1, 256], got 0" in out.stderr
    out = epd("scale", "--address", address, "--namespace", "nobody", "encoders", "2")
    assert out.returncode != 0 and "no epd deployment in namespace 'nobody'" in out.stderr


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.timeout(1200)
def test_encoders_autoscale_to_max_under_a_burst_and_back_to_min(tiny_model_dir, tmp_path):
    config = tmp_path / "autoscale.toml"
    config.write_text("[autoscale]\nenabled = true\nmin_replicas = 1\nmax_replicas = 3\n"
                      "target_queue_per_replica = 1\ncooldown_s = 4\ninterval_s = 0.2\n")
    server = ServeProcess(tiny_model_dir, "--encoders", "1", "--config", str(config),
                          log_path=str(tmp_path / "autoscale.log"))
    try:
        address = ray_address(server)
        assert encoder_count(address) == 1
        load = Load(server.address, num_clients=6, images_per_request=4, size=448)
        try:
            reached_max = False
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not load.failures:
                if encoder_count(address) == 3:
                    reached_max = True
                    break
                time.sleep(0.5)
        finally:
            load.finish()
        assert load.failures == [], load.failures[:3]
        assert reached_max, epd_status(address)["decisions"]
        deadline = time.monotonic() + 120
        while encoder_count(address) != 1 and time.monotonic() < deadline:
            time.sleep(1)
        final = epd_status(address)
        assert len(final["roles"]["encoder"]) == 1, final["decisions"]
        directions = [d["direction"] for d in final["decisions"]]
        assert "up" in directions and directions[-1] == "down", final["decisions"]
        assert all(d["reason"] for d in final["decisions"])
        text = urllib.request.urlopen(f"http://{final['metrics']}/metrics", timeout=10).read().decode()
        assert _metric(text, 'epd_autoscale_decisions_total{direction="up"}') >= 1
        assert _metric(text, 'epd_autoscale_decisions_total{direction="down"}') >= 1
        assert _metric(text, 'epd_replicas{role="encoder"}') == 1
    finally:
        alive = server.stop()
    assert alive == []
