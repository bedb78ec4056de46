"""The prefill -> decode handoff stream and HybridState's flat tensor view."""

import pytest
import torch

from epd import handoff
from epd.lm import HybridState
from epd.v1 import epd_pb2

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
