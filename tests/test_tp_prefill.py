"""A tensor-parallel prefill replica (`--prefill-tensor-parallel N`, prefill_svc/tensor_parallel.py).

Default suite: the real ``PrefillEngine`` on rank 0 in the test process (``TensorParallelGroup``:
a real rank-1 process, gloo over loopback), beside a one-process engine on the same checkpoint:
chunked prefill across an image, two prompts sharing forwards, a second turn restored from the
prefix cache (split to both ranks), prompt logprobs (the vocabulary-parallel head) all give the
first token and the whole state of the one-process engine, and greedy decoding from that state
gives transformers' tokens; a prompt cancelled mid-way leaves no shard behind on the follower.
Also by default: a pending TP replica's placement group reported as unplaced (plain Python).

Slow (stacks of their own): `--prefill-tensor-parallel 2 --decode-tensor-parallel 2` through
`epd serve`, token-identical to transformers for text, an image and a second turn served from the
prefix cache (tiny and tiny-moe); a prefill follower killed under several concurrent streams: no
request fails, the replica comes back with a follower, answers equal the oracle, one placement
group per replica before and after (and one fewer after a scale-down); and the placement group of
a replica's ranks on a Ray of its own (bundles, STRICT_PACK, the CPUs Ray counts, removal).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch

from bench.synthetic import make_image
from epd import client
from epd.config import PrefillConfig
from epd.lm import TextModelRunner
from epd.modelinfo import ModelInfo
from epd.sampling import SamplingConfig
from epd.store import EmbeddingStore
from epd.v1 import epd_pb2
from prefill_svc.engine import PrefillEngine
from tests.conftest import epd, epd_status, ray_address, serving
from tests.test_prefill_engine import Case, assert_matches_oracle, user

SQUARE = make_image(448, 448, seed=1)
GREEDY = SamplingConfig(max_tokens=12, temperature=0.0, top_p=1.0, top_k=0, seed=0, ignore_eos=True, logprobs=20)


def _assert_same_state(got, want) -> None:
    assert got.num_tokens == want.num_tokens
    got_tensors, want_tensors = dict(got.named_tensors()), dict(want.named_tensors())
    assert got_tensors.keys() == want_tensors.keys()
    for name, tensor in want_tensors.items():
        assert got_tensors[name].shape == tensor.shape and got_tensors[name].dtype == tensor.dtype, name
        # float32 sums in another order (the row-parallel all-reduce): the last bits only
        assert torch.allclose(got_tensors[name], tensor, atol=1e-4, rtol=1e-4), name


@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny-moe", marks=pytest.mark.slow)])
def test_tp2_prefill_engine_hands_off_the_whole_state_of_one_process(preset, request, redis_url):
    from prefill_svc.tensor_parallel import TensorParallelGroup

    model_dir, oracle = ((request.getfixturevalue("tiny_model_dir"), request.getfixturevalue("oracle"))
                         if preset == "tiny" else
                         (request.getfixturevalue("tiny_moe_model_dir"), request.getfixturevalue("moe_oracle")))
    info = ModelInfo.load(model_dir)
    plain = TextModelRunner.load(model_dir)
    # chunks of 16 tokens: the image's 196 rows span many; two prompts share each forward
    config = PrefillConfig(chunk_tokens=16, batch_tokens=32, prefix_block_size=16, snapshot_every_blocks=4)
    first = Case(oracle, info, redis_url, user("What is in this picture?", SQUARE), max_new_tokens=8)
    text = Case(oracle, info, redis_url, user("Tell me about the weather in three sentences."), max_new_tokens=8)
    history = user("What is in this picture?", SQUARE) + [
        {"role": "assistant", "content": "A square."}, {"role": "user", "content": "And its colour?"}]
    second = Case(oracle, info, redis_url, history, max_new_tokens=8)
    group = TensorParallelGroup(model_dir, 2, "float32", True, 1, "")
    engines = []
    try:
        tp = PrefillEngine(group.runner, info, EmbeddingStore(redis_url), config, states=group.runner)
        one = PrefillEngine(plain, info, EmbeddingStore(redis_url), config)
        engines += [tp, one]
        results: dict = {}

        def run(engine, case, key):
            results[key] = engine.run(case.request(), GREEDY)

        for engine, name in ((tp, "tp"), (one, "one")):  # two prompts at once: their chunks share forwards
            threads = [threading.Thread(target=run, args=(engine, case, (name, key)))
                       for case, key in ((first, "first"), (text, "text"))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            run(engine, second, (name, "second"))  # restored from the first turn's snapshot
        for case, key in ((first, "first"), (text, "text"), (second, "second")):
            got, want = results[("tp", key)], results[("one", key)]
            assert got.first_token == want.first_token and got.cached_tokens == want.cached_tokens, key
            _assert_same_state(got.state, want.state)
            assert_matches_oracle(plain, case, got)  # the whole state decodes as transformers does
        assert results[("tp", "second")].cached_tokens > 196  # the image's rows came from the cache

        # prompt logprobs: every prompt row through the vocabulary-parallel head, in blocks
        asked = epd_pb2.PrefillRequest(request_id="p", token_ids=text.token_ids, prompt_logprobs=3)
        got, want = tp.run(asked, GREEDY).prompt_logprobs, one.run(asked, GREEDY).prompt_logprobs
        assert [e.token_id for e in got] == [e.token_id for e in want] == text.token_ids[1:]
        assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in e.top] for e in want]
        assert torch.allclose(torch.tensor([e.logprob for e in got]), torch.tensor([e.logprob for e in want]),
                              atol=1e-4)

        # a prompt cancelled part-way: its shard on the follower goes with the next command
        long_case = epd_pb2.PrefillRequest(request_id="long", token_ids=text.token_ids * 40)
        job = tp.submit(tp.prepare(long_case))
        deadline = time.monotonic() + 60
        while job.started_at is None and time.monotonic() < deadline:
            time.sleep(0.005)
        tp.cancel(job)
        assert tp.run(text.request(), GREEDY).first_token == results[("one", "text")].first_token
        assert group.runner.held_shards() == [0]  # nothing left on rank 1
    finally:
        for engine in engines:
            engine.stop()
        group.stop()


# ------------------------------------------------------------------ through `epd serve` (slow)


def _prefill_followers(address: str) -> list[psutil.Process]:
    out = []
    for replica in epd_status(address)["roles"]["prefill"]:
        for child in psutil.Process(replica["pid"]).children():
            if "prefill_svc.tensor_parallel" in " ".join(child.cmdline()):
                out.append(child)
    return out


def _proto(messages):
    return [epd_pb2.ChatMessage(role=m["role"], content=[
        epd_pb2.ContentPart(image=p["image"]) if p["type"] == "image" else epd_pb2.ContentPart(text=p["text"])
        for p in ([{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"])])
        for m in messages]


def _chat(address, messages, num_tokens):
    return client.generate(address, client.chat_request(_proto(messages), max_tokens=num_tokens, temperature=0.0,
                                                        ignore_eos=True), timeout_s=240)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_tp2_prefill_and_tp2_decode_are_token_identical_to_transformers(preset, request, tmp_path):
    model_dir, oracle = ((request.getfixturevalue("tiny_model_dir"), request.getfixturevalue("oracle"))
                         if preset == "tiny" else
                         (request.getfixturevalue("tiny_moe_model_dir"), request.getfixturevalue("moe_oracle")))
    num_tokens = 16
    image = make_image(448, 448, seed=7)
    text = [user("Tell me about the weather in three sentences.")[0]]
    turn1 = user("What is in this picture?", image)
    with serving(model_dir, "--encoders", "1", "--prefill-tensor-parallel", "2", "--decode-tensor-parallel", "2",
                 "--prefill-threads", "1", "--decode-threads", "1", "--prefix-block-size", "16",
                 "--prefill-chunk-tokens", "64", "--log-level", "INFO",
                 log_path=str(tmp_path / "serve.log"), ready_timeout_s=600) as server:
        address = ray_address(server)
        assert len(_prefill_followers(address)) == 1
        roles = epd_status(address)["roles"]
        assert len(roles["prefill"]) == 1 and len(roles["decode"]) == 1  # one replica each, to status
        for messages in (text, turn1):
            got = _chat(server.address, messages, num_tokens)
            assert got.token_ids == oracle.generate_through_eos(oracle.chat_inputs(messages), num_tokens)
        answer = oracle.tokenizer.decode(got.token_ids, skip_special_tokens=True)
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And its colour?"}]
        second = _chat(server.address, turn2, num_tokens)
        assert second.summary.cached_tokens > 196  # the first turn's image came from the prefix cache
        assert second.token_ids == oracle.generate_through_eos(oracle.chat_inputs(turn2), num_tokens)


_GROUPS = """
import json, sys
from control.cli import _ray_env
_ray_env(sys.argv[1])
import ray
from ray.util import placement_group_table
ray.init(address=sys.argv[1], namespace="epd", logging_level="ERROR")
print(json.dumps({t["name"]: [t["state"], t["strategy"], len(t["bundles"])] for t in placement_group_table().values()}))
"""


def _groups(address: str) -> dict[str, list]:
    """Every placement group of the stack's Ray, by name: state, strategy, bundles."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _GROUPS, address], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _live_groups(address: str) -> dict[str, list]:
    return {name: rest for name, (state, *rest) in _groups(address).items() if state != "REMOVED"}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_killed_prefill_follower_fails_no_request_and_its_replica_comes_back(tiny_model_dir, oracle, tmp_path):
    """Two TP=2 prefill replicas, each reserving its two ranks' CPUs in a placement group (half a
    CPU a rank: the machine's two cores), six streams at once with long prompts (prefill is busy):
    the follower rank of a replica computing one is killed. Its replica exits; the router retries
    its prompts on the other; every stream ends with transformers' tokens; the replica comes back
    with a new follower, and there is still one group per replica (none leaked)."""
    num_tokens = 8
    # long enough that the poll below finds one computing (at 30 repeats all six were done before it
    # looked, once in three runs on an AMD EPYC)
    prompts = [f"Request {i}: " + "tell me about the weather in three sentences. " * 60 for i in range(6)]
    want = [oracle.generate_through_eos(oracle.inputs(p, []), num_tokens) for p in prompts]
    roles = tmp_path / "roles.toml"
    roles.write_text("[roles.prefill]\nnum_cpus = 0.5\ntensor_parallel = 2\n")
    with serving(tiny_model_dir, "--encoders", "1", "--prefill", "2", "--config", str(roles),
                 "--prefill-threads", "1", "--prefill-chunk-tokens", "16", "--prefix-cache-mb", "0",
                 "--log-level", "INFO", log_path=str(tmp_path / "serve.log"), ready_timeout_s=600) as server:
        address = ray_address(server)
        names = sorted(r["name"] for r in epd_status(address)["roles"]["prefill"])
        assert _live_groups(address) == {f"{name}-ranks": ["STRICT_PACK", 2] for name in names}
        outcome: dict = {}

        def stream(index: int) -> None:
            try:
                outcome[index] = client.generate(server.address, client.user_request(
                    prompts[index], [], max_tokens=num_tokens, temperature=0.0, ignore_eos=True), timeout_s=600)
            except BaseException as error:  # noqa: BLE001 - reported below
                outcome[index] = error

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        killed = None
        deadline = time.monotonic() + 180
        while killed is None and time.monotonic() < deadline and any(t.is_alive() for t in threads):
            for replica in epd_status(address)["roles"]["prefill"]:
                if replica.get("in_flight"):
                    for child in psutil.Process(replica["pid"]).children():
                        if "prefill_svc.tensor_parallel" in " ".join(child.cmdline()):
                            killed = (replica["pid"], child.pid)
                            os.kill(child.pid, signal.SIGKILL)
                            break
                if killed:
                    break
            time.sleep(0.05)
        for thread in threads:
            thread.join(timeout=600)
        assert killed is not None, f"no prefill replica was seen computing: {outcome}"
        failed = {i: r for i, r in outcome.items() if isinstance(r, BaseException)}
        assert not failed and len(outcome) == len(prompts), failed
        for index, result in outcome.items():
            assert result.token_ids == want[index], index
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            prefill = epd_status(address)["roles"]["prefill"]
            if len(prefill) == 2 and all(r["pid"] != killed[0] for r in prefill) and \
                    len(_prefill_followers(address)) == 2:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"the prefill replica did not come back with its follower: {prefill}")
        again = client.generate(server.address, client.user_request(prompts[0], [], max_tokens=num_tokens,
                                                                     temperature=0.0, ignore_eos=True), timeout_s=240)
        assert again.token_ids == want[0]
        names = sorted(r["name"] for r in epd_status(address)["roles"]["prefill"])
        assert _live_groups(address) == {f"{name}-ranks": ["STRICT_PACK", 2] for name in names}
        down = epd("scale", "--address", address, "prefill", "1")  # the newest goes, and its group with it
        assert down.returncode == 0, down.stderr
        left = [r["name"] for r in epd_status(address)["roles"]["prefill"]]
        assert len(left) == 1 and _live_groups(address) == {f"{left[0]}-ranks": ["STRICT_PACK", 2]}


# ------------------------------------------------------------------ the ranks' placement group (a real local Ray)

_RESERVE = """
import json, sys
from control.cli import _ray_env
_ray_env("127.0.0.1:0")
import ray
from ray.util import placement_group_table
from control import placement
from epd.config import DeployConfig, PrefillConfig, RoleResources, ServeConfig
ray.init(num_cpus=4, resources={"epd_prefill": 2}, include_dashboard=False, logging_level="ERROR", namespace="tp")
serve = ServeConfig(model_dir=sys.argv[1], prefill=PrefillConfig(tensor_parallel=2))
config = DeployConfig(serve=serve, resources={"prefill": RoleResources(num_cpus=1, resources={"epd_prefill": 1}),
                                              "decode": RoleResources(num_cpus=1)})
out = {"decode": placement.reserve_ranks(config, "decode", "decode-0") is None,  # one process: no group
       "unreserved": placement.reserve_ranks(DeployConfig(serve=serve), "prefill", "prefill-9") is None}
strategy = placement.reserve_ranks(config, "prefill", "prefill-0")
out["same"] = placement.reserve_ranks(config, "prefill", "prefill-0").placement_group.id == \
    strategy.placement_group.id  # asking again finds the same group


@ray.remote
class Rank0:
    def resources(self):
        return ray.get_runtime_context().get_assigned_resources()


actor = Rank0.options(num_cpus=1, resources={"epd_prefill": 1}, scheduling_strategy=strategy).remote()
out["actor"] = ray.get(actor.resources.remote(), timeout=120)
table = placement_group_table(strategy.placement_group)
out["bundles"] = [dict(b) for b in table["bundles"].values()]
out["strategy"], out["state"] = table["strategy"], table["state"]
out["free_cpus"] = ray.available_resources().get("CPU", 0)
placement.release_ranks("prefill-0")
placement.release_ranks("prefill-0")  # twice, or for a replica without one: nothing happens
out["after"] = placement_group_table(strategy.placement_group)["state"]
print(json.dumps(out))
"""


@pytest.mark.slow  # a Ray of its own (~15-45 s to start here); the kill test below checks the groups in a stack too
def test_a_tp_replica_reserves_its_ranks_together_and_gives_them_back(tiny_model_dir):
    """``control.placement.reserve_ranks`` on a real local Ray: a TP=2 prefill replica's actor runs
    in bundle 0 of a STRICT_PACK group of two bundles of the role's resources (Ray counts the
    follower's CPU too: 2 of 4 taken), asking again finds the same group, and ``release_ranks``
    removes it; a replica of one process, or a role that asks for nothing, makes no group."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RESERVE, tiny_model_dir], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["decode"] and found["unreserved"] and found["same"]
    assert found["bundles"] == [{"CPU": 1.0, "epd_prefill": 1.0}] * 2 and found["strategy"] == "STRICT_PACK"
    assert found["state"] == "CREATED" and found["actor"]["CPU"] == 1.0
    assert found["free_cpus"] == 2.0  # both ranks' CPUs are reserved, not only the actor's
    assert found["after"] == "REMOVED"


def test_a_tp_replica_ray_cannot_place_is_reported_by_its_whole_group(tiny_model_dir):
    """A pending placement group is one gang demand: its bundles summed (one node must hold them
    all), equal groups counted together, and put down to the role whose replica asks for exactly
    that (N times its role's resources)."""
    from control.fleet import unplaced
    from control.placement import gang_demands, replica_shape
    from epd.config import DeployConfig, PrefillConfig, RoleResources, ServeConfig

    config = DeployConfig(serve=ServeConfig(model_dir=tiny_model_dir, prefill=PrefillConfig(tensor_parallel=2)),
                          resources={"prefill": RoleResources(num_cpus=2, resources={"epd_lm": 1}),
                                     "decode": RoleResources(num_cpus=2, resources={"epd_lm": 1})})
    assert replica_shape(config, "prefill") == {"CPU": 4.0, "epd_lm": 2.0}
    assert replica_shape(config, "decode") == {"CPU": 2.0, "epd_lm": 1.0}
    bundle = {"CPU": 2.0, "epd_lm": 1.0}
    demands = gang_demands([[bundle, bundle], [bundle, bundle]])
    assert demands == [({"CPU": 4.0, "epd_lm": 2.0}, 2)]
    node = {"CPU": 3.0, "epd_lm": 4.0}  # holds one rank's bundle, not both
    (entry,) = unplaced(demands, {role: replica_shape(config, role) for role in ("prefill", "decode")},
                        {"prefill": ["prefill-3"], "decode": []}, [node])
    assert entry["roles"] == ["prefill"] and entry["count"] == 1
    assert entry["reason"].startswith("no alive node offers {CPU: 4, epd_lm: 2}")
