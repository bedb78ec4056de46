"""A tensor-parallel decode replica through a real `epd serve` stack (Ray local, embedded redis,
gRPC on loopback): `--decode-tensor-parallel 2` makes the decode replica two processes (rank 0 the
Ray actor, rank 1 a local process it starts, gloo over loopback), each holding half of every
sharded weight and half of every request's K/V and linear state. A plain (TP=1) prefill hands it
the whole state. Greedy tokens equal transformers' generate (float32) for text, an image and
concurrent requests sharing steps; a follower rank killed under a stream takes its replica down,
the stream resumes on the other decode replica and the killed one comes back (these three start
stacks: slow). In the default suite: the same engine and ranks without a stack (rank 0 in the
test process, rank 1 a real process), preemption by swap included, and the configuration of
both roles' degrees (prefill's replica of N ranks: tests/test_tp_prefill.py)."""

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
from tests.conftest import epd_status, ray_address, serving

PROMPT = "Tell me about the weather in three sentences."


@pytest.fixture(scope="module")
def tp_stack(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir, "--encoders", "1", "--decode", "1", "--decode-tensor-parallel", "2",
                 "--decode-threads", "1", "--max-batch-size", "4", "--log-level", "INFO",
                 log_path=str(tmp_path_factory.mktemp("logs") / "serve-tp.log")) as server:
        yield server


def _followers(address: str) -> list[psutil.Process]:
    """The decode replicas' follower ranks (children of the decode actor running
    ``decode_svc.tensor_parallel``), by decode pid."""
    out = []
    for replica in epd_status(address)["roles"]["decode"]:
        for child in psutil.Process(replica["pid"]).children():
            if "decode_svc.tensor_parallel" in " ".join(child.cmdline()):
                out.append(child)
    return out


@pytest.mark.slow  # a stack of its own (~25-85 s to start); test_tp2_engine_... below is the default one
def test_tp2_decode_is_token_identical_to_transformers(tp_stack, oracle):
    assert len(_followers(ray_address(tp_stack))) == 1  # rank 1 of the one decode replica runs
    image = make_image(448, 448, seed=1)
    cases = [(PROMPT, []), ("What is in this picture?", [image])]
    expected = [oracle.generate_through_eos(oracle.inputs(prompt, images), 24) for prompt, images in cases]
    results: list = [None] * len(cases)

    def run(index: int) -> None:  # concurrently: the two requests share decode steps
        prompt, images = cases[index]
        results[index] = client.generate(tp_stack.address, client.user_request(
            prompt, images, max_tokens=24, temperature=0.0, ignore_eos=True), timeout_s=180)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=200)
    for result, want in zip(results, expected):
        assert result is not None and result.token_ids == want


@pytest.mark.slow
def test_status_shows_one_decode_replica(tp_stack):
    decode = epd_status(ray_address(tp_stack))["roles"]["decode"]
    assert len(decode) == 1 and decode[0].get("kv")  # one replica to the router and status, its pool reported


@pytest.mark.slow
@pytest.mark.timeout(1500)  # two TP=2 replicas are 4 decode processes: slow to start on a loaded 2-core machine
def test_a_killed_follower_rank_restarts_its_replica_and_no_request_fails(tiny_model_dir, oracle, tmp_path):
    """Two TP=2 decode replicas; while a long stream runs, the follower rank of the replica holding
    it is killed: the replica exits, the stream resumes on the other one (token-identical), and
    the replica comes back with a new follower."""
    num_tokens = 300
    inputs = oracle.inputs(PROMPT, [])
    want = oracle.generate_through_eos(inputs, num_tokens)
    with serving(tiny_model_dir, "--encoders", "1", "--decode", "2", "--decode-tensor-parallel", "2",
                 "--decode-threads", "1", "--log-level", "INFO", log_path=str(tmp_path / "serve.log")) as server:
        address = ray_address(server)
        outcome: dict = {}

        def stream() -> None:
            try:
                outcome["result"] = client.generate(server.address, client.user_request(
                    PROMPT, [], max_tokens=num_tokens, temperature=0.0, ignore_eos=True), timeout_s=300)
            except BaseException as error:  # noqa: BLE001 - reported below
                outcome["error"] = error

        thread = threading.Thread(target=stream)
        thread.start()
        killed = None
        deadline = time.monotonic() + 120
        while killed is None and thread.is_alive() and time.monotonic() < deadline:
            for replica in epd_status(address)["roles"]["decode"]:
                if replica.get("in_flight"):
                    for child in psutil.Process(replica["pid"]).children():
                        if "decode_svc.tensor_parallel" in " ".join(child.cmdline()):
                            killed = (replica["pid"], child.pid)
                            os.kill(child.pid, signal.SIGKILL)
            time.sleep(0.1)
        thread.join(timeout=300)
        assert killed is not None, f"the stream ended before a decode replica was seen holding it: {outcome}"
        assert "error" not in outcome, outcome["error"]
        assert outcome["result"].summary.resumes >= 1
        assert outcome["result"].token_ids == want
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            decode = epd_status(address)["roles"]["decode"]
            if len(decode) == 2 and all(r["pid"] != killed[0] for r in decode) and len(_followers(address)) == 2:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"the replica did not come back with its follower: {decode}")
        again = client.generate(server.address, client.user_request(PROMPT, [], max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True), timeout_s=120)
        assert again.token_ids == want[:12]


# ------------------------------------------------------------------ configuration (no stack)


def _serve_config(model_dir: str, *argv: str, roles: str = "", tmp_path=None):
    from control import cli, flags

    config_file = None
    if roles:
        config_file = str(tmp_path / "roles.toml")
        (tmp_path / "roles.toml").write_text(roles)
    args = cli._parser().parse_args(["serve", "--model", model_dir, *argv])
    return flags.deploy_config(args, flags.SERVE, config_file).serve


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_tensor_parallel_from_the_flag_or_the_roles_file(tiny_model_dir, tmp_path, role):
    other = {"prefill": "decode", "decode": "prefill"}[role]
    assert getattr(_serve_config(tiny_model_dir), role).tensor_parallel == 1
    flagged = _serve_config(tiny_model_dir, f"--{role}-tensor-parallel", "2", f"--{role}-threads", "1")
    assert getattr(flagged, role).tensor_parallel == 2 and getattr(flagged, other).tensor_parallel == 1
    roles = f"[roles.{role}]\nnum_cpus = 2\ntensor_parallel = 2\n"
    assert getattr(_serve_config(tiny_model_dir, roles=roles, tmp_path=tmp_path), role).tensor_parallel == 2
    # the flag wins over the file
    assert getattr(_serve_config(tiny_model_dir, f"--{role}-tensor-parallel", "1", roles=roles,
                                 tmp_path=tmp_path), role).tensor_parallel == 1


@pytest.mark.parametrize("argv, roles, message", [
    (["--decode-tensor-parallel", "0"], "", "decode.tensor_parallel: must be in [1, 64], got 0"),
    (["--prefill-tensor-parallel", "65"], "", "prefill.tensor_parallel: must be in [1, 64], got 65"),
    ([], "[roles.encoder]\ntensor_parallel = 2\n", "tensor_parallel is served for prefill and decode only"),
    ([], "[roles.decode]\ntensor_parallel = \"two\"\n", "roles.decode.tensor_parallel: must be an integer"),
    ([], "[roles.prefill]\ntensor_parallel = 2.0\n", "roles.prefill.tensor_parallel: must be an integer"),
])
def test_a_bad_tensor_parallel_is_refused_naming_it(tiny_model_dir, tmp_path, argv, roles, message):
    from epd.config import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _serve_config(tiny_model_dir, *argv, roles=roles, tmp_path=tmp_path)


def test_a_shard_loaded_in_bfloat16_from_float32_files_equals_a_cut_of_the_bfloat16_model(tiny_model_dir):
    """load_shard opens the float32 files as stored and converts each slice as it is cut: the same
    tensors as loading the whole model in bfloat16 and cutting it."""
    from epd.lm import TextModelRunner
    from epd.tensor_parallel import shard_runner
    from epd.tp_group import load_shard

    for rank in range(2):
        shard = load_shard(tiny_model_dir, "bfloat16", rank, 2, prepack=False)
        want = shard_runner(TextModelRunner.load(tiny_model_dir, dtype="bfloat16", prepack=False), rank, 2)
        got, expected = shard.model.state_dict(), want.model.state_dict()
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        assert torch.equal(shard.lm_head.weight, want.lm_head.weight) and shard.lm_head.weight.dtype == torch.bfloat16
        assert shard.lm_head_weight is shard.model.embed_tokens.weight  # tiny ties its head: still tied


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_serve_refuses_a_degree_the_model_does_not_split_by_before_ray_starts(tiny_model_dir, capsys, role):
    from control import cli

    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--model", tiny_model_dir, f"--{role}-tensor-parallel", "3"])
    assert exit_.value.code == 2 and time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert f"{role}.tensor_parallel = 3: the model does not split over 3 ranks (num_attention_heads 4, " \
           "num_key_value_heads 2" in err and "Traceback" not in err


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_memory_plan_counts_what_each_more_rank_holds(tiny_model_dir, role):
    import dataclasses

    from epd import memory_plan
    from epd.config import DecodeConfig, PrefillConfig, ServeConfig

    raw = memory_plan.read_raw_config(tiny_model_dir)
    one = ServeConfig(model_dir=tiny_model_dir)
    config = {"prefill": PrefillConfig, "decode": DecodeConfig}[role](tensor_parallel=2)
    two = dataclasses.replace(one, **{role: config})
    plain, split = memory_plan.need_of_role(raw, role, one), memory_plan.need_of_role(raw, role, two)
    embedding = memory_plan.count_params(raw).embedding * 4
    assert split.total - plain.total == embedding + 512 * memory_plan.MIB
    assert split.parts["embedding in 1 more ranks"] == embedding
    # and the other role is untouched
    other = "decode" if role == "prefill" else "prefill"
    assert memory_plan.need_of_role(raw, other, two).total == memory_plan.need_of_role(raw, other, one).total


@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny-moe", marks=pytest.mark.slow)])
def test_tp2_engine_decodes_like_transformers_through_swap(preset, request):
    """Rank 0 in this process (``TensorParallelGroup``: a real rank-1 process, gloo), the real
    ``DecodeEngine`` over ``TPBatch``: three requests prefilled by a plain one-process runner (their
    whole states handed in, as a TP=1 prefill hands them) decode in shared steps in a K/V pool too
    small for all three, so requests are swapped out (whole state gathered from both ranks) and
    back in (split again): every answer equals transformers' greedy tokens."""
    import queue

    from bench import tp_driver
    from decode_svc.engine import DecodeEngine
    from decode_svc.tensor_parallel import TensorParallelGroup
    from epd.config import DecodeConfig
    from epd.lm import TextModelRunner
    from epd.sampling import SamplingConfig

    tiny_model_dir, oracle = ((request.getfixturevalue("tiny_model_dir"), request.getfixturevalue("oracle"))
                              if preset == "tiny" else
                              (request.getfixturevalue("tiny_moe_model_dir"), request.getfixturevalue("moe_oracle")))
    prompts = [PROMPT, "Name three colours.", "Count from one to ten, slowly."]
    num_tokens = 40
    inputs = [oracle.inputs(prompt, []) for prompt in prompts]
    want = [oracle.generate_through_eos(one, num_tokens) for one in inputs]
    plain = TextModelRunner.load(tiny_model_dir, prepack=False)
    handoffs = []
    for one in inputs:
        ids = one["input_ids"][0].tolist()
        state, logits = tp_driver.prefill(plain, ids)
        handoffs.append((len(ids), state, int(logits.argmax())))
    longest = max(length for length, _, _ in handoffs) + num_tokens
    block = 16
    # room for two of the three at their longest, not three: the youngest is swapped out
    config = DecodeConfig(max_batch_size=4, kv_block_tokens=block,
                          kv_cache_bytes=2 * (-(-longest // block) + 1) * block * plain.kv_bytes_per_token(),
                          swap_space_bytes=64 << 20)
    group = TensorParallelGroup(tiny_model_dir, 2, "float32", True, 1, "")
    engine = None
    try:
        engine = DecodeEngine(group.runner, frozenset(), config, make_batch=group.make_batch)
        assert engine.capacity_tokens() < 3 * longest
        events: dict[str, queue.Queue] = {}
        for index, (length, state, first) in enumerate(handoffs):
            request_id = f"r{index}"
            events[request_id] = queue.Queue()
            engine.submit(request_id, length, 0, first, SamplingConfig(max_tokens=num_tokens, ignore_eos=True),
                          state, deadline_unix=0)
            assert engine.claim(request_id, events[request_id].put) is not None
        for index, (_, _, first) in enumerate(handoffs):
            tokens = [first]
            while True:
                event = events[f"r{index}"].get(timeout=120)
                if event.token_id >= 0:
                    tokens.append(event.token_id)
                if event.finish_reason is not None:
                    break
            assert tokens == want[index], index
        assert engine.scheduler.preempted.get("swap", 0) >= 1  # the pool was too small: swapped out and back
    finally:
        if engine is not None:
            engine.stop()
        group.stop()
