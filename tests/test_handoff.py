"""The prefill -> decode handoff stream and HybridState's flat tensor view."""

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
import torch

from epd import errors, handoff, rpc
from epd.lm import HybridState
from epd.v1 import epd_pb2, epd_pb2_grpc

NUM_LAYERS = 8  # full attention on layers 3 and 7, linear attention elsewhere
FULL = (3, 7)


def _state(num_tokens=13, seed=0) -> HybridState:
    g = torch.Generator().manual_seed(seed)
    state = HybridState.empty(NUM_LAYERS)
    state.num_tokens = num_tokens
    for layer in range(NUM_LAYERS):
        if layer in FULL:
            dtype = torch.bfloat16 if layer == 3 else torch.float32
            state.keys[layer] = torch.randn(1, 2, num_tokens, 16, generator=g).to(dtype)
            state.values[layer] = torch.randn(1, 2, num_tokens, 16, generator=g).to(dtype)
        else:
            conv_dtype = torch.bfloat16 if layer % 2 else torch.float32
            state.conv[layer] = torch.randn(1, 48, 4, generator=g).to(conv_dtype)
            state.recurrent[layer] = torch.randn(1, 4, 8, 8, generator=g)  # float32
    return state


def _header(**overrides) -> epd_pb2.HandoffHeader:
    fields = dict(
        request_id="req-42",
        prompt_len=13,
        rope_delta=-182,
        first_token=501,
        sampling=epd_pb2.ResolvedSampling(max_tokens=9, temperature=0.5, top_p=0.9, top_k=7, seed=3, logprobs=2),
        deadline_unix=1234567.5,
    )
    fields.update(overrides)
    return epd_pb2.HandoffHeader(**fields)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_same_state(a: HybridState, b: HybridState):
    for kind in ("keys", "values", "conv", "recurrent"):
        for layer, (x, y) in enumerate(zip(getattr(a, kind), getattr(b, kind))):
            if x is None:
                assert y is None, (kind, layer)
                continue
            assert y is not None, (kind, layer)
            assert y.dtype == x.dtype and y.shape == x.shape, (kind, layer)
            assert torch.equal(_bits(x.contiguous()), _bits(y.contiguous())), (kind, layer)
    assert a.num_tokens == b.num_tokens


def test_named_tensors_order_and_names():
    names = [name for name, _ in _state().named_tensors()]
    assert names == (
        [f"keys.{i}" for i in FULL]
        + [f"values.{i}" for i in FULL]
        + [f"conv.{i}" for i in range(NUM_LAYERS) if i not in FULL]
        + [f"recurrent.{i}" for i in range(NUM_LAYERS) if i not in FULL]
    )


@pytest.mark.parametrize("chunk_bytes", [1000, 4096, 1 << 20])
def test_round_trip_bit_exact(chunk_bytes):
    state = _state()
    parts = list(handoff.chunks(_header(), state, chunk_bytes=chunk_bytes))
    assert parts[0].WhichOneof("part") == "header"
    data = [p.data for p in parts[1:]]
    assert all(p.WhichOneof("part") == "data" for p in parts[1:])
    assert sum(map(len, data)) == state.nbytes()
    assert all(len(d) == chunk_bytes for d in data[:-1]) and 0 < len(data[-1]) <= chunk_bytes
    if chunk_bytes == 1000:
        # tensors straddle chunk boundaries, and some chunks hold parts of several tensors
        offsets, total = [], 0
        for _, t in state.named_tensors():
            offsets.append((total, total + t.numel() * t.element_size()))
            total = offsets[-1][1]
        assert sum(start // 1000 != (end - 1) // 1000 for start, end in offsets) >= 5
        assert len(data) < len(offsets)

    got = handoff.receive(iter(parts), NUM_LAYERS)
    _assert_same_state(state, got.state)
    assert got.state.num_tokens == 13  # from header.prompt_len


def test_header_fields_preserved():
    state = _state()
    parts = [epd_pb2.HandoffChunk.FromString(p.SerializeToString()) for p in handoff.chunks(_header(), state, 1000)]
    got = handoff.receive(parts, NUM_LAYERS)
    h = got.header
    assert h.request_id == "req-42"
    assert h.prompt_len == 13 and h.rope_delta == -182 and h.first_token == 501
    assert h.deadline_unix == 1234567.5
    assert h.sampling == _header().sampling
    specs = {(s.name, s.dtype, tuple(s.shape)) for s in h.tensors}
    assert ("keys.3", "bfloat16", (1, 2, 13, 16)) in specs
    assert ("recurrent.0", "float32", (1, 4, 8, 8)) in specs
    assert len(specs) == len(state.named_tensors())
    _assert_same_state(state, got.state)


def test_header_tensor_list_is_replaced_not_appended():
    header = _header(tensors=[epd_pb2.TensorSpec(name="keys.0", dtype="float32", shape=[99])])
    parts = list(handoff.chunks(header, _state(), 1000))
    assert [s.name for s in parts[0].header.tensors] == [n for n, _ in _state().named_tensors()]
    _assert_same_state(_state(), handoff.receive(parts, NUM_LAYERS).state)


def test_non_contiguous_tensor_round_trip():
    state = HybridState.empty(4)
    state.num_tokens = 5
    state.keys[3] = torch.randn(1, 5, 2, 16).transpose(1, 2)  # non-contiguous view
    state.values[3] = torch.randn(1, 2, 5, 16).to(torch.bfloat16)
    got = handoff.receive(handoff.chunks(_header(prompt_len=5), state, 100), 4)
    _assert_same_state(state, got.state)


def test_empty_state_round_trip():
    state = HybridState.empty(4)
    state.num_tokens = 0
    parts = list(handoff.chunks(_header(prompt_len=0), state, 1000))
    assert len(parts) == 1
    got = handoff.receive(parts, 4)
    assert got.state.named_tensors() == []


# --------------------------------------------------------------------------- malformed streams


def _parts():
    return list(handoff.chunks(_header(), _state(), 1000))


def test_empty_stream_rejected():
    with pytest.raises(ValueError, match="must start with a header"):
        handoff.receive([], NUM_LAYERS)


def test_data_first_rejected():
    parts = _parts()
    with pytest.raises(ValueError, match="must start with a header"):
        handoff.receive(parts[1:], NUM_LAYERS)


def test_two_headers_rejected():
    parts = _parts()
    with pytest.raises(ValueError, match="second header"):
        handoff.receive(parts[:3] + [parts[0]] + parts[3:], NUM_LAYERS)


def test_truncated_stream_rejected():
    parts = _parts()
    with pytest.raises(ValueError, match="ended inside tensor"):
        handoff.receive(parts[:-1], NUM_LAYERS)
    last = parts[-1].data
    cut = parts[:-1] + [epd_pb2.HandoffChunk(data=last[:-1])]
    with pytest.raises(ValueError, match="ended inside tensor 'recurrent.6'"):
        handoff.receive(cut, NUM_LAYERS)


def test_extra_bytes_rejected():
    parts = _parts() + [epd_pb2.HandoffChunk(data=b"\x00\x01\x02")]
    with pytest.raises(ValueError, match="3 bytes past its last tensor"):
        handoff.receive(parts, NUM_LAYERS)


def test_too_few_layers_on_receiver_rejected():
    with pytest.raises(ValueError, match="unknown state tensor"):
        handoff.receive(_parts(), num_layers=4)


@pytest.mark.parametrize("name", ["kv.0", "keys.8", "keys.-1", "conv.99", "gates.2"])
def test_from_named_tensors_rejects_unknown_names(name):
    with pytest.raises(ValueError, match="unknown state tensor"):
        HybridState.from_named_tensors(NUM_LAYERS, 3, {name: torch.zeros(1)})


@pytest.mark.parametrize("name", ["keys", "keys.1.2", "keys.x"])
def test_from_named_tensors_rejects_malformed_names(name):
    with pytest.raises(ValueError):
        HybridState.from_named_tensors(NUM_LAYERS, 3, {name: torch.zeros(1)})


def test_from_named_tensors_places_tensors():
    t = torch.ones(2)
    state = HybridState.from_named_tensors(4, 7, {"values.3": t, "conv.0": t * 2})
    assert state.values[3] is t and torch.equal(state.conv[0], t * 2)
    assert state.keys == [None] * 4 and state.recurrent == [None] * 4
    assert state.num_tokens == 7
    assert state.nbytes() == 2 * 2 * 4


# --------------------------------------------------------------------------- checked against the model


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    from epd.lm import TextModelRunner

    return TextModelRunner.load(tiny_model_dir, device="cpu")


@pytest.fixture(scope="module")
def real(runner):
    """A real prefill state of 9 tokens from the tiny model, and its handoff chunks."""
    from epd import positions

    state = runner.new_state()
    ids = torch.arange(5, 14)
    runner.forward(runner.embed(ids), positions.mrope_positions(9, [])[0], state)
    header = _header(prompt_len=9, first_token=7)
    return state, list(handoff.chunks(header, state, chunk_bytes=4096))


def _with_header(parts, **changes):
    header = epd_pb2.HandoffHeader()
    header.CopyFrom(parts[0].header)
    for name, value in changes.items():
        if isinstance(value, epd_pb2.ResolvedSampling):
            getattr(header, name).CopyFrom(value)
        else:
            setattr(header, name, value)
    return [epd_pb2.HandoffChunk(header=header), *parts[1:]]


def _respec(parts, tensor, **changes):
    header = epd_pb2.HandoffHeader()
    header.CopyFrom(parts[0].header)
    spec = next(s for s in header.tensors if s.name == tensor)
    if "shape" in changes:
        del spec.shape[:]
        spec.shape.extend(changes.pop("shape"))
    for field, value in changes.items():
        setattr(spec, field, value)
    return [epd_pb2.HandoffChunk(header=header), *parts[1:]]


def test_a_real_state_passes_the_model_checks_bit_exact(runner, real):
    state, parts = real
    got = handoff.receive(parts, runner.num_layers, runner=runner)
    _assert_same_state(state, got.state)


def _refused_at_header(runner, parts, match):
    """The header alone is refused: nothing after it is read or kept."""
    receiver = handoff.Receiver(runner.num_layers, runner=runner)
    with pytest.raises(ValueError, match=match):
        receiver.add(parts[0])
    assert len(receiver._data) == 0


@pytest.mark.parametrize("prompt_len", [0, -3, 2**31 - 1])
def test_a_forged_prompt_length_is_refused_before_anything_is_kept(runner, real, prompt_len):
    _refused_at_header(runner, _with_header(real[1], prompt_len=prompt_len), "prompt_len")


def test_a_request_that_would_grow_past_the_model_positions_is_refused(runner, real):
    """Decode's K/V grows a token per step: max_tokens past the model's positions is refused up
    front, not after the memory is spent (a resumed request counts what it already generated)."""
    max_len = runner.model.config.max_position_embeddings
    parts = real[1]
    sampling = epd_pb2.ResolvedSampling(max_tokens=max_len - 9 + 2)
    _refused_at_header(runner, _with_header(parts, sampling=sampling), "past the model's")
    fits = epd_pb2.ResolvedSampling(max_tokens=max_len - 9 + 1)
    handoff.receive(_with_header(parts, sampling=fits), runner.num_layers, runner=runner)
    handoff.receive(_with_header(parts, sampling=sampling, num_generated=2), runner.num_layers, runner=runner)


@pytest.mark.parametrize("token", [-1, 10**9])
def test_a_first_token_outside_the_vocabulary_is_refused(runner, real, token):
    _refused_at_header(runner, _with_header(real[1], first_token=token), "first_token")


def test_tensors_that_do_not_fit_the_model_are_refused_at_the_header(runner, real):
    parts = real[1]
    keys = next(s.name for s in parts[0].header.tensors if s.name.startswith("keys."))
    _refused_at_header(runner, _respec(parts, keys, shape=[1, 2, 2**30, 256]), f"handoff tensor {keys} is")
    _refused_at_header(runner, _respec(parts, keys, dtype="bfloat16"), f"handoff tensor {keys} is bfloat16")
    _refused_at_header(runner, _respec(parts, keys, name="keys.999"), "do not match the model")
    header = epd_pb2.HandoffHeader()
    header.CopyFrom(parts[0].header)
    del header.tensors[-1]
    _refused_at_header(runner, [epd_pb2.HandoffChunk(header=header)], "missing")


def test_bytes_past_the_header_are_refused_as_they_arrive(runner, real):
    """A stream that never ends is cut at the first chunk past what its header lists: memory is
    bounded by a real state's size, not by what the sender keeps sending."""
    _, parts = real
    receiver = handoff.Receiver(runner.num_layers, runner=runner)
    receiver.add(parts[0])
    with pytest.raises(ValueError, match="past its last tensor"):
        for _ in range(10**6):
            receiver.add(epd_pb2.HandoffChunk(data=b"\x00" * 4096))
    assert len(receiver._data) <= receiver._total


@pytest.mark.parametrize("shape,dtype", [([-1, 4], "float32"), ([-2, -2], "float32"), ([4], "int8"), ([2], "")])
def test_without_a_model_bad_specs_are_value_errors(shape, dtype):
    header = _header(prompt_len=1, tensors=[epd_pb2.TensorSpec(name="keys.3", dtype=dtype, shape=shape)])
    with pytest.raises(ValueError, match="expected a supported dtype"):
        handoff.receive([epd_pb2.HandoffChunk(header=header), epd_pb2.HandoffChunk(data=b"\x00" * 16)], NUM_LAYERS)


# --------------------------------------------------------------------------- through shared memory


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """The handoff's shared-memory directory, a fresh one (a tmpfs like /dev/shm or not: the
    code is the same)."""
    monkeypatch.setenv(handoff.SHARED_DIR_ENV, str(tmp_path))
    return tmp_path


def _files(directory):
    return sorted(p.name for p in directory.iterdir())


def test_a_shared_file_round_trip_is_bit_exact_and_leaves_nothing(shared):
    state = _state()
    header = _header()
    path = handoff.write_shared(header, state)
    assert path is not None and header.shared_file == os.path.basename(path)
    assert os.stat(path).st_mode & 0o777 == 0o600  # nobody else on the host reads a prompt's state
    parts = [epd_pb2.HandoffChunk.FromString(p.SerializeToString()) for p in handoff.shared_parts(header)]
    assert len(parts) == 1  # the header alone crosses the wire
    got = handoff.receive(parts, NUM_LAYERS)
    assert _files(shared) == []  # the receiver removed it as it mapped it
    _assert_same_state(state, got.state)
    got.state.recurrent[0].add_(1.0)  # the views are copy-on-write: writable, and the writer's file untouched
    handoff.remove_shared(path)  # the sender's clean-up after the receiver's is a no-op


def test_a_stream_after_a_shared_try_carries_no_file_name(shared):
    header = _header()
    assert handoff.write_shared(header, _state())
    parts = list(handoff.chunks(header, _state(), 1000))
    assert not parts[0].header.shared_file
    _assert_same_state(_state(), handoff.receive(parts, NUM_LAYERS).state)


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "epd-handoff-1-" + "g" * 32,
                                  "epd-handoff-x-" + "0" * 32, "epd-handoff-1-" + "0" * 31, "other"])
def test_a_shared_file_name_that_is_not_a_handoff_file_is_refused(shared, name):
    with pytest.raises(ValueError, match="not a handoff file's name"):
        handoff.receive([epd_pb2.HandoffChunk(header=_header(shared_file=name))], NUM_LAYERS)


def test_data_chunks_beside_a_shared_file_are_refused(shared):
    header = _header()
    handoff.write_shared(header, _state())
    with pytest.raises(ValueError, match="data chunks but its header names a shared file"):
        handoff.receive([epd_pb2.HandoffChunk(header=header), epd_pb2.HandoffChunk(data=b"x")], NUM_LAYERS)


def test_a_file_this_host_cannot_see_is_a_failed_precondition(shared, monkeypatch):
    header = _header()
    handoff.write_shared(header, _state())
    os.unlink(shared / header.shared_file)
    with pytest.raises(errors.FailedPrecondition, match="cannot be read here"):
        handoff.receive([epd_pb2.HandoffChunk(header=header)], NUM_LAYERS)
    monkeypatch.setenv(handoff.SHARED_DIR_ENV, "")  # a host without shared memory
    with pytest.raises(errors.FailedPrecondition, match="no shared-memory directory"):
        handoff.receive([epd_pb2.HandoffChunk(header=header)], NUM_LAYERS)


def test_a_link_in_place_of_the_file_is_never_followed(shared, tmp_path_factory):
    header = _header()
    handoff.write_shared(header, _state())
    target = tmp_path_factory.mktemp("elsewhere") / "secret"
    os.replace(shared / header.shared_file, target)
    os.symlink(target, shared / header.shared_file)
    with pytest.raises(errors.FailedPrecondition, match="cannot be read here"):
        handoff.receive([epd_pb2.HandoffChunk(header=header)], NUM_LAYERS)


def test_a_shared_file_of_the_wrong_size_is_refused(shared):
    header = _header()
    handoff.write_shared(header, _state())
    with open(shared / header.shared_file, "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(ValueError, match="bytes; its header lists"):
        handoff.receive([epd_pb2.HandoffChunk(header=header)], NUM_LAYERS)


def test_without_a_shared_directory_the_writer_says_stream(monkeypatch, tmp_path):
    monkeypatch.setenv(handoff.SHARED_DIR_ENV, str(tmp_path / "missing"))
    header = _header()
    assert handoff.write_shared(header, _state()) is None and not header.shared_file


def test_a_full_shared_directory_leaves_nothing_and_says_stream(shared):
    """A write past what the directory holds (a container's small /dev/shm; here a file-size
    limit, in a child process) fails, and the partial file is removed."""
    script = (
        "import resource, signal, sys, torch\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from tests.test_handoff import _header, _state\n"
        "from epd import handoff\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
        "header = _header()\n"
        "print(handoff.write_shared(header, _state(num_tokens=200)), repr(header.shared_file))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script, root], capture_output=True, text=True, timeout=120,
                         env={**os.environ, handoff.SHARED_DIR_ENV: str(shared)}, check=True).stdout
    assert out.split() == ["None", "''"]
    assert _files(shared) == []


def test_files_of_writers_that_are_gone_are_removed(shared):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = shared / f"{handoff.SHARED_PREFIX}{dead}-{'a' * 32}"
    live = shared / f"{handoff.SHARED_PREFIX}{os.getpid()}-{'b' * 32}"
    other = shared / "not-ours"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    assert handoff.remove_stale_shared() == 1
    assert _files(shared) == sorted([live.name, other.name])


# --------------------------------------------------------------------------- prefill's choice of path


class _Decode(epd_pb2_grpc.DecodeServicer):
    """A decode worker's handoff end over real gRPC: the real ``Receiver`` (header checks, the
    shared file or the stream), looking for shared files in ``directory``; it keeps what arrived."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.received: list[tuple[bool, HybridState]] = []  # (came as a shared file, the state)

    @rpc.unary_errors
    async def Reserve(self, header, context):
        return epd_pb2.HandoffAck(request_id=header.request_id)

    @rpc.unary_errors
    async def Handoff(self, request_iterator, context):
        receiver = handoff.Receiver(NUM_LAYERS, shared_directory=self.directory)
        async for part in request_iterator:
            receiver.add(part)
        got = receiver.finish()
        self.received.append((bool(got.header.shared_file), got.state))
        return epd_pb2.HandoffAck(request_id=got.header.request_id)


class _Targets:
    """The one decode worker at ``address``, called as ``discovery.Targets`` calls a replica."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = epd_pb2_grpc.DecodeStub(self.channel)

    async def call(self, method, request, timeout, busy_next=False, route=None):
        return await getattr(self.stub, method)(request, timeout=timeout), self.address

    async def call_at(self, address, method, request, timeout):
        return await getattr(self.stub, method)(request, timeout=timeout)


class _Context:
    def time_remaining(self):
        return 30.0


@pytest.mark.parametrize("decode_sees_the_file", [True, False])
def test_prefill_hands_off_through_shared_memory_and_streams_to_a_worker_that_cannot_read_it(
        shared, tmp_path_factory, decode_sees_the_file):
    """On one host the state goes as a shared file; a decode worker that cannot see it (another
    mount namespace: here, another directory) answers FAILED_PRECONDITION, gets the same state as
    a stream at once, and streams from then on. Bit-exact either way; no file is left."""
    from prefill_svc.server import PrefillServicer

    directory = str(shared) if decode_sees_the_file else str(tmp_path_factory.mktemp("other-namespace"))
    decode = _Decode(directory)

    async def scenario():
        server = grpc.aio.server()
        epd_pb2_grpc.add_DecodeServicer_to_server(decode, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        targets = _Targets(f"127.0.0.1:{port}")
        try:
            servicer = PrefillServicer(None, targets, host="127.0.0.1")
            for seed in (0, 1):
                await servicer._hand_off(_header(request_id=f"r{seed}"), _state(seed=seed), _Context())
            return servicer
        finally:
            await targets.channel.close()
            await server.stop(None)

    servicer = asyncio.run(scenario())
    assert [via for via, _ in decode.received] == ([True, True] if decode_sees_the_file else [False, False])
    for seed, (_, state) in enumerate(decode.received):
        _assert_same_state(_state(seed=seed), state)
    expected = {"local": 0, "shared_memory": 2, "stream": 0} if decode_sees_the_file else \
        {"local": 0, "shared_memory": 0, "stream": 2}
    assert servicer.handoffs == expected
    assert _files(shared) == []
    assert servicer.waits == 0  # the fallback is at once, not after a pause
    # the worker that could not read the file was tried through it once, and is streamed to since
    assert len(servicer._streams_only) == (0 if decode_sees_the_file else 1)
