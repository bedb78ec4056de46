"""`epd serve` starts every role, answers, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import signal

from bench.synthetic import make_image
from epd import client, rpc
from tests.conftest import ServeProcess


def test_ctrl_c_stops_every_process(tiny_model_dir, tmp_path):
    # Started with SIGINT ignored, as a background job of a script is (and as this suite's own
    # process ended up after earlier tests): SIGINT must still stop it.
    server = ServeProcess(tiny_model_dir, "--encoders", "1", log_path=str(tmp_path / "serve.log"), sigint_ignored=True)
    try:
        assert rpc.is_serving(server.address, "epd.v1.Router")
        names = {p.name() for p in server.descendants}
        assert any("redis-server" in n for n in names), names  # the embedded store is a real redis-server
        assert any("raylet" in n or "gcs_server" in n for n in names), names  # and a real local Ray
        result = client.generate(server.address, client.user_request("hi", [make_image(64, 64, seed=1)], max_tokens=3))
        assert result.summary.image_tokens == 64  # 64x64 is enlarged to 256x256
    finally:
        alive = server.stop(signal.SIGINT)
    assert alive == []
    assert server.proc.returncode == 0
