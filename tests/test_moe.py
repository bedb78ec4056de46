"""The mixture-of-experts family in process: the family table, the tiny-moe checkpoint in
transformers' own architecture, epd's loaders building the MoE classes, the experts running
grouped by expert inside epd's runner (prefill chunks and batched decode), pre-packing that leaves
the 3-D expert parameters alone, and greedy tokens equal to transformers' generate."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3_5MoeForConditionalGeneration
from transformers.integrations import moe as hf_moe
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mm

from bench.synthetic import make_image
from decode_svc.batch import DecodeBatch
from epd import checkpoint, kernels, model_check, positions
from epd.family import EXPERTS_IMPLEMENTATION, FAMILIES, family_of
from epd.lm import TextModelRunner
from epd.modelinfo import ModelInfo
from tests.test_batching import _prefill

NUM_EXPERTS, TOP_K = 8, 2


@pytest.fixture(scope="module")
def hf_model(tiny_moe_model_dir):
    model, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_moe_model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def runner(tiny_moe_model_dir) -> TextModelRunner:
    return TextModelRunner.load(tiny_moe_model_dir)


@pytest.fixture(scope="module")
def dense_runner(tiny_moe_model_dir) -> TextModelRunner:
    return TextModelRunner.load(tiny_moe_model_dir, prepack=False)


def test_the_family_table_and_the_torch_free_check_name_the_same_types():
    assert set(FAMILIES) == set(model_check.SUPPORTED_MODEL_TYPES)
    for model_type, family in FAMILIES.items():
        assert family.model_type == model_type == family.config.model_type
    # the pre-Ray check stays plain Python: importing it must not pull in torch or transformers
    out = subprocess.run([sys.executable, "-c", "import sys, epd.model_check; "
                          "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_router_and_a_family_s_names_leave_transformers_model_stack_unimported():
    """transformers' modeling modules (modeling_utils and the model's own) cost seconds of CPU to
    import: the router, the Encoder service's front and the controller never build a model, so
    ``epd.family`` imports them on first use (``docs/BENCHMARKS.md``, "Stack start-up")."""
    check = ("import sys, router_svc.server\nfrom epd.family import FAMILIES\n"
             "names = [f.architecture for f in FAMILIES.values()]\n"
             "print(sorted(m for m in sys.modules if m.startswith('transformers.models.qwen3_5')"
             " and '.modeling_' in m or m == 'transformers.modeling_utils'))")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    assert FAMILIES["qwen3_5"].text_model.__module__ == "transformers.models.qwen3_5.modeling_qwen3_5"


def test_tiny_moe_is_qwen3_5_moe_in_the_real_architecture(tiny_moe_model_dir, hf_model):
    assert family_of(tiny_moe_model_dir) is FAMILIES["qwen3_5_moe"]
    config = checkpoint.read_config(tiny_moe_model_dir)
    assert type(config) is FAMILIES["qwen3_5_moe"].config
    assert config.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    text = config.text_config
    tiny = checkpoint.config_from_name("tiny").text_config
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "linear_num_key_heads", "linear_num_value_heads", "layer_types", "vocab_size"):
        assert getattr(text, name) == getattr(tiny, name), name
    assert (text.num_experts, text.num_experts_per_tok) == (NUM_EXPERTS, TOP_K)
    assert (text.moe_intermediate_size, text.shared_expert_intermediate_size) == (32, 64)
    hidden = text.hidden_size
    for layer in hf_model.model.language_model.layers:
        block = layer.mlp
        assert type(block) is mm.Qwen3_5MoeSparseMoeBlock
        assert type(block.gate) is mm.Qwen3_5MoeTopKRouter and block.gate.weight.shape == (NUM_EXPERTS, hidden)
        assert block.experts.gate_up_proj.shape == (NUM_EXPERTS, 2 * 32, hidden)
        assert block.experts.down_proj.shape == (NUM_EXPERTS, hidden, 32)
        assert type(block.shared_expert_gate) is torch.nn.Linear and block.shared_expert_gate.out_features == 1
        assert block.shared_expert.gate_proj.out_features == 64
        # transformers' random init, not zeros (the router is created with zeros and initialised)
        assert block.gate.weight.std() > 0.05 and block.experts.gate_up_proj.std() > 0.05
    saved = load_file(f"{tiny_moe_model_dir}/model.safetensors")
    state = hf_model.state_dict()
    assert {k for k in state if k != "lm_head.weight"} == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    info = ModelInfo.load(tiny_moe_model_dir)
    assert info.hidden_size == hidden and info.image_token_id == config.image_token_id


def test_loaders_build_the_moe_classes_and_compute_what_transformers_does(tiny_moe_model_dir, hf_model):
    text, head = checkpoint.build_text_model(tiny_moe_model_dir)
    ref = hf_model.model.language_model
    assert type(text) is mm.Qwen3_5MoeTextModel and type(text.rotary_emb) is mm.Qwen3_5MoeTextRotaryEmbedding
    assert text.config._experts_implementation == EXPERTS_IMPLEMENTATION == ref.config._experts_implementation
    assert text.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in text.state_dict().items())
    assert head is text.embed_tokens.weight
    ids = torch.tensor([[5, 17, 300, 42, 9, 120, 77, 3, 600]])
    with torch.no_grad():
        torch.testing.assert_close(text(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state,
                                   rtol=0, atol=0)
    vision = checkpoint.build_vision_model(tiny_moe_model_dir)
    assert type(vision) is mm.Qwen3_5MoeVisionModel
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(vision(pixels, grid_thw=grid).pooler_output,
                                   hf_model.model.visual(pixels, grid_thw=grid).pooler_output, rtol=0, atol=0)


class _ExpertTrace:
    """Records, for every experts call in the runner, the tokens it got and their routing, and every
    grouped product transformers' grouped_mm experts forward ran for it."""

    def __init__(self, model, monkeypatch) -> None:
        self.calls: list[dict] = []
        real = hf_moe._grouped_mm

        def grouped_mm(input, weight, offs):
            self.calls[-1]["products"].append((input.detach().clone(), weight, offs.detach().clone()))
            return real(input, weight, offs)

        monkeypatch.setattr(hf_moe, "_grouped_mm", grouped_mm)
        self.handles = []
        for layer in model.layers:
            def pre(module, args, layer=layer):
                hidden, top_k_index, _ = args
                self.calls.append({"experts": module, "hidden": hidden.detach().clone(),
                                   "routing": top_k_index.detach().clone(), "products": []})
            self.handles.append(layer.mlp.experts.register_forward_pre_hook(pre))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def check(self, num_layers: int, num_tokens: int) -> set[int]:
        """Every layer's experts ran over all ``num_tokens`` tokens in two grouped products (gate_up,
        down) over the whole 3-D parameter, each expert's rows contiguous and exactly the tokens
        the router sent to it: each hit expert's weights multiply all its tokens at once, and an
        expert with no tokens is an empty group. Returns the experts hit."""
        assert len(self.calls) == num_layers, len(self.calls)
        hit: set[int] = set()
        for call in self.calls:
            experts, hidden, routing = call["experts"], call["hidden"], call["routing"]
            assert hidden.shape[0] == num_tokens and routing.shape == (num_tokens, TOP_K)
            assert len(call["products"]) == 2, "one grouped product per projection, not one per token or expert"
            counts = torch.bincount(routing.reshape(-1), minlength=NUM_EXPERTS)
            offsets = counts.cumsum(0)
            for (rows, weight, offs), param in zip(call["products"], (experts.gate_up_proj, experts.down_proj)):
                assert rows.shape[0] == num_tokens * TOP_K
                assert weight.shape[0] == NUM_EXPERTS and weight.data_ptr() == param.data_ptr()  # a view, no copy
                assert offs.tolist() == offsets.tolist()
            gathered = call["products"][0][0]
            start = 0
            for expert in range(NUM_EXPERTS):
                end = int(offsets[expert])
                tokens = (routing == expert).any(dim=1).nonzero().flatten()
                want = hidden[tokens]
                got = gathered[start:end]
                assert got.shape == want.shape, (expert, got.shape, want.shape)
                # the same rows as a set (the sort inside may order ties either way)
                order = lambda t: t[torch.argsort(t[:, 0])]  # noqa: E731
                assert torch.equal(order(got), order(want)), expert
                if end > start:
                    hit.add(expert)
                start = end
        return hit


def test_experts_run_grouped_by_expert_in_prefill_chunks_and_batched_decode(runner, monkeypatch):
    vocab = runner.vocab_size
    lengths = [37, 20]
    chunks = []
    for seed, length in enumerate(lengths):
        ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))
        pos, _ = positions.mrope_positions(length, [])
        chunks.append((runner.embed(ids), pos, runner.new_state()))
    trace = _ExpertTrace(runner.model, monkeypatch)
    try:
        hidden = runner.forward_many(chunks)  # one forward over both prompts' tokens
        hit = trace.check(runner.num_layers, sum(lengths))
        assert len(hit) >= 4, hit  # enough experts hit that the grouping means something
        trace.calls.clear()
        batch = DecodeBatch(runner)
        for _, _, state in chunks:
            batch.add(state)
        tokens = runner.logits(hidden).argmax(dim=-1).tolist()
        runner.decode_step(batch, tokens, lengths)
        trace.check(runner.num_layers, len(lengths))
    finally:
        trace.close()


def test_prepack_packs_the_linear_layers_and_leaves_the_expert_parameters(runner, dense_runner):
    assert kernels.can_prepack(runner.device, runner.dtype), "this test needs a CPU with oneDNN"
    hidden = runner.model.config.hidden_size
    for packed_layer, dense_layer in zip(runner.model.layers, dense_runner.model.layers):
        block = packed_layer.mlp
        # the router's weight is a Parameter read by F.linear; the experts are 3-D Parameters
        assert isinstance(block.gate.weight, torch.nn.Parameter) and not block.gate.weight.is_mkldnn
        for param in (block.experts.gate_up_proj, block.experts.down_proj):
            assert isinstance(param, torch.nn.Parameter) and param.dim() == 3 and not param.is_mkldnn
        assert torch.equal(block.experts.gate_up_proj, dense_layer.mlp.experts.gate_up_proj)
        for linear in (block.shared_expert.gate_proj, block.shared_expert.up_proj, block.shared_expert.down_proj,
                       block.shared_expert_gate):
            assert type(linear) is kernels.PackedLinear
        assert block.shared_expert_gate.out_features == 1 and block.shared_expert_gate.in_features == hidden
    assert not any(type(m) is torch.nn.Linear for m in runner.model.modules())
    # still exact: the packed runner gives the unpacked one's logits to float32 rounding, same tokens
    ids = torch.randint(0, runner.vocab_size, (50,), generator=torch.Generator().manual_seed(9))
    pos, _ = positions.mrope_positions(50, [])
    states = [runner.new_state(), dense_runner.new_state()]
    outs = [r.logits(r.forward(r.embed(ids), pos, s)) for r, s in zip((runner, dense_runner), states)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    tokens = [int(o.argmax()) for o in outs]
    for step in range(12):
        outs = [r.logits(r.forward(r.embed(torch.tensor([t])), torch.full((3, 1), 50 + step), s))
                for r, s, t in zip((runner, dense_runner), states, tokens)]
        # float32 rounding carried through the steps' recurrent states: up to ~2e-5 on logits of ~3
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=5e-5)
        tokens = [int(o.argmax()) for o in outs]
        assert tokens[0] == tokens[1]


def test_batched_decode_step_matches_one_request_forwards(runner):
    """decode_step over ragged slots gives each slot the logits of its own one-request forward:
    routing is per token, so a token's experts do not depend on who shares its step."""
    vocab = runner.vocab_size
    lengths = [3, 40, 17, 66]
    states, singles, tokens = [], [], []
    for seed, length in enumerate(lengths):
        ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(100 + seed))
        pos, _ = positions.mrope_positions(length, [])
        state, single = runner.new_state(), runner.new_state()
        tokens.append(int(runner.logits(runner.forward(runner.embed(ids), pos, state)).argmax()))
        runner.forward(runner.embed(ids), pos, single)
        states.append(state)
        singles.append(single)
    batch = DecodeBatch(runner)
    for state in states:
        batch.add(state)
    single_tokens = list(tokens)
    for step in range(40):
        logits = runner.decode_step(batch, tokens, [n + step for n in lengths])
        for row, length in enumerate(lengths):
            reference = runner.logits(runner.forward(runner.embed(torch.tensor([single_tokens[row]])),
                                                     torch.full((3, 1), length + step), singles[row]))
            torch.testing.assert_close(logits[row], reference, rtol=1e-4, atol=1e-4)
            single_tokens[row] = int(reference.argmax())
        tokens = [int(row.argmax()) for row in logits]
        assert tokens == single_tokens


@pytest.mark.parametrize("prompt,images", [
    ("Hello! Who are you?", []),
    ("Compare the three images.", [make_image(448, 448, seed=1), make_image(640, 200, seed=2),
                                   make_image(180, 500, seed=3)]),
], ids=["text-only", "three-images"])
def test_runner_greedy_tokens_equal_transformers_generate(runner, tiny_moe_model_dir, moe_oracle, prompt, images):
    expected, first_logits, prompt_len = moe_oracle.generate(prompt, images, max_new_tokens=24)
    vision = checkpoint.build_vision_model(tiny_moe_model_dir)
    length, rope_delta, first, state = _prefill(runner, vision, moe_oracle, prompt, images)
    assert (length, first) == (prompt_len, expected[0])
    batch = DecodeBatch(runner)
    batch.add(state)
    tokens = [first]
    while len(tokens) < len(expected):
        logits = runner.decode_step(batch, [tokens[-1]], [length + rope_delta + len(tokens) - 1])
        tokens.append(int(logits[0].argmax()))
    assert tokens == expected
