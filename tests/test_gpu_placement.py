"""Each model role on a device of its own: on a node with GPUs, `epd serve` has every model replica
ask Ray for one (epd.config.share_gpus), Ray gives each its own and sets its CUDA_VISIBLE_DEVICES,
and a replica that asked for none computes on the CPU (epd.tensors.default_device) instead of
landing on the first GPU it can see. Checked on this CPU machine with a Ray node that says it has
GPUs (`--num-gpus`), as Ray allows."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import epd_status, ray_address, serving

_ASK = """
import json, sys
from control.cli import _ray_env
_ray_env(sys.argv[1])  # the environment every epd driver connects with
import ray
ray.init(address=sys.argv[1], namespace="epd", logging_level="ERROR")
out = {}
for name in sys.argv[2:]:
    out[name] = ray.get(ray.get_actor(name).device_info.remote(), timeout=60)
print(json.dumps(out))
"""


def _devices(address: str, names: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _ASK, address, *names], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_model_replica_gets_a_gpu_of_its_own(tiny_model_dir, tmp_path):
    with serving(tiny_model_dir, "--num-gpus", "3", log_path=str(tmp_path / "serve.log")) as server:
        address = ray_address(server)
        roles = epd_status(address)["roles"]
        model = [r["name"] for role in ("encoder", "prefill", "decode") for r in roles[role]]
        others = [r["name"] for role in ("router", "encode") for r in roles[role]]
        devices = _devices(address, model + others)
    gpus = [devices[name]["gpu_ids"] for name in model]
    assert all(len(ids) == 1 for ids in gpus), devices
    assert len({ids[0] for ids in gpus}) == len(model), f"two model replicas share a GPU: {devices}"
    for name in model:  # Ray pointed each at its own device
        assert devices[name]["cuda_visible_devices"] == devices[name]["gpu_ids"][0]
        assert devices[name]["device"] == "cpu"  # no CUDA on this machine: torch finds no device
    for name in others:
        assert devices[name]["gpu_ids"] == [] and devices[name]["device"] == "cpu"
