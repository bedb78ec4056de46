"""M-RoPE positions: the explicit rules, checked by hand and against transformers' get_rope_index."""

import random

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

from epd.checkpoint import config_from_name
from epd.positions import ImageSpan, decode_position, find_image_spans, mrope_positions

IMG = 7  # an arbitrary placeholder id for the hand-built prompts
MERGE = 2  # Qwen3.5's spatial merge size: patch grid = merged grid * 2


def _prompt(layout):
    """layout: list of ints (text runs) and (h, w) tuples (images); returns ids and merged grids."""
    ids, grids = [], []
    for part in layout:
        if isinstance(part, tuple):
            ids += [IMG] * (part[0] * part[1])
            grids.append(part)
        else:
            ids += [1] * part
    return ids, grids


# --------------------------------------------------------------------------- the chapter's numbers


def test_448px_image_positions_by_hand():
    # 448 px / 16 px patches = 28 patches a side, merged 2x2 -> a 14 x 14 grid = 196 tokens.
    s = 5
    ids, grids = _prompt([s, (14, 14), 6])
    spans = find_image_spans(ids, IMG, grids)
    assert spans == [ImageSpan(start=s, merged_height=14, merged_width=14)]
    assert spans[0].num_tokens == 196 and spans[0].end == s + 196

    pos, delta = mrope_positions(len(ids), spans)
    assert pos.shape == (3, len(ids)) and pos.dtype == torch.long
    col = lambda i: tuple(pos[:, i].tolist())  # noqa: E731

    for i in range(s):  # leading text: all three components equal its index
        assert col(i) == (i, i, i)
    assert col(s) == (s, s, s)
    assert col(s + 1) == (s, s, s + 1)
    assert col(s + 13) == (s, s, s + 13)  # end of the first row
    assert col(s + 14) == (s, s + 1, s)  # 15th image token: second row starts
    assert col(s + 195) == (s, s + 13, s + 13)  # last image token
    assert col(s + 196) == (s + 14, s + 14, s + 14)  # the text right after the image
    assert col(len(ids) - 1) == (s + 14 + 5,) * 3

    max_position = s + 14 + 5
    assert int(pos.max()) == max_position
    assert delta == max_position + 1 - len(ids)
    assert delta == 14 - 196  # the image occupies 196 tokens but only 14 positions


def test_text_only_prompt_has_zero_delta():
    pos, delta = mrope_positions(9, [])
    assert torch.equal(pos, torch.arange(9).expand(3, 9))
    assert delta == 0
    assert find_image_spans([1, 2, 3], IMG, []) == []


def test_non_square_image_uses_longer_side():
    ids, grids = _prompt([2, (2, 5), 1])
    pos, delta = mrope_positions(len(ids), find_image_spans(ids, IMG, grids))
    # rows advance on the height component, columns on the width component
    assert pos[:, 2:12].tolist() == [
        [2] * 10,
        [2] * 5 + [3] * 5,
        [2, 3, 4, 5, 6] * 2,
    ]
    assert pos[:, 12].tolist() == [7, 7, 7]  # 2 + max(2, 5)
    assert delta == 8 - 13


def test_image_at_very_start_and_end():
    ids, grids = _prompt([(3, 2)])
    spans = find_image_spans(ids, IMG, grids)
    pos, delta = mrope_positions(len(ids), spans)
    assert pos[:, 0].tolist() == [0, 0, 0]
    assert pos[:, -1].tolist() == [0, 2, 1]
    assert delta == 3 - 6


def test_decode_position():
    assert decode_position(10, 0, 0) == 10
    assert decode_position(201, 3, -182) == 201 + 3 - 182
    for L, i, d in [(1, 0, 0), (50, 7, -20), (1000, 999, 5)]:
        assert decode_position(L, i, d) == L + i + d


def test_decode_position_continues_prompt_positions():
    # the first decoded token sits right after the prompt's largest position
    ids, grids = _prompt([4, (3, 4), 2, (5, 2), 3])
    pos, delta = mrope_positions(len(ids), find_image_spans(ids, IMG, grids))
    assert decode_position(len(ids), 0, delta) == int(pos.max()) + 1
    assert decode_position(len(ids), 4, delta) == int(pos.max()) + 5


# --------------------------------------------------------------------------- find_image_spans errors


def test_more_placeholders_than_images():
    ids, _ = _prompt([2, (2, 2), 1, (2, 2)])
    with pytest.raises(ValueError, match="more image placeholder tokens than the 1 image"):
        find_image_spans(ids, IMG, [(2, 2)])


def test_leftover_placeholders_in_a_run():
    ids = [1] + [IMG] * 5 + [1]  # one 2x2 image but five placeholders
    with pytest.raises(ValueError, match="more image placeholder tokens"):
        find_image_spans(ids, IMG, [(2, 2)])


def test_fewer_placeholders_than_images():
    ids, _ = _prompt([2, (2, 2), 1])
    with pytest.raises(ValueError, match=r"placeholders for 1 image\(s\) but 2 were sent"):
        find_image_spans(ids, IMG, [(2, 2), (1, 1)])


def test_no_placeholders_but_an_image():
    with pytest.raises(ValueError, match=r"placeholders for 0 image\(s\) but 1 were sent"):
        find_image_spans([1, 2, 3], IMG, [(1, 1)])


def test_run_too_short():
    ids = [1, 1] + [IMG] * 5 + [1]
    with pytest.raises(ValueError, match="image 0 needs 6 placeholder tokens but its run has only 5"):
        find_image_spans(ids, IMG, [(2, 3)])


def test_second_run_too_short_names_second_image():
    ids = [1] + [IMG] * 4 + [2, 3] + [IMG] * 3
    with pytest.raises(ValueError, match="image 1 needs 4 placeholder tokens but its run has only 3"):
        find_image_spans(ids, IMG, [(2, 2), (2, 2)])


def test_touching_runs_are_split_grid_by_grid():
    ids = [1] + [IMG] * (4 + 6) + [1]
    spans = find_image_spans(ids, IMG, [(2, 2), (3, 2)])
    assert spans == [ImageSpan(1, 2, 2), ImageSpan(5, 3, 2)]


# --------------------------------------------------------------------------- against transformers


@pytest.fixture(scope="module")
def hf_model():
    config = config_from_name("tiny")
    assert config.vision_config.spatial_merge_size == MERGE
    return Qwen3_5Model(config).eval(), config


def _random_layout(rng: random.Random, config, num_images: int):
    """Token ids shaped like the chat template: text, <vision_start><image_pad>*n<vision_end>, text."""
    vs, ve, img = config.vision_start_token_id, config.vision_end_token_id, config.image_token_id
    ids, grids = [], []

    def text(n):
        ids.extend(rng.randrange(0, 500) for _ in range(n))

    text(rng.randint(0, 6))
    for k in range(num_images):
        h, w = rng.randint(1, 9), rng.randint(1, 9)
        if k and rng.random() < 0.5:
            pass  # adjacent images: vision_end directly followed by vision_start
        else:
            text(rng.randint(0 if k == 0 else 1, 5))
        ids.append(vs)
        ids.extend([img] * (h * w))
        ids.append(ve)
        grids.append((h, w))
    text(rng.randint(0, 6))
    return ids, grids


FIXED_LAYOUTS = [
    [],  # text only
    [(14, 14)],
    [(1, 1)],
    [(3, 8), (8, 3)],  # non-square both ways
    [(2, 2), (5, 1), (1, 7)],
]


def _reference(model, config, ids, grids):
    input_ids = torch.tensor([ids], dtype=torch.long)
    mm = (input_ids == config.image_token_id).int()
    grid_thw = torch.tensor([[1, h * MERGE, w * MERGE] for h, w in grids], dtype=torch.long) if grids else None
    with torch.no_grad():
        pos, deltas = model.get_rope_index(input_ids, mm, image_grid_thw=grid_thw)
    return pos[:, 0, :], int(deltas.reshape(-1)[0])


@pytest.mark.parametrize("case", range(len(FIXED_LAYOUTS) + 24))
def test_matches_transformers_get_rope_index(hf_model, case):
    model, config = hf_model
    rng = random.Random(1234 + case)
    if case < len(FIXED_LAYOUTS):
        ids, grids = [], []
        vs, ve, img = config.vision_start_token_id, config.vision_end_token_id, config.image_token_id
        ids += [3, 4, 5]
        for h, w in FIXED_LAYOUTS[case]:
            ids += [vs] + [img] * (h * w) + [ve]
            grids.append((h, w))
        ids += [6, 7]
    else:
        ids, grids = _random_layout(rng, config, num_images=case % 4)

    spans = find_image_spans(ids, config.image_token_id, grids)
    assert [(s.merged_height, s.merged_width) for s in spans] == grids
    ours, delta = mrope_positions(len(ids), spans)
    theirs, their_delta = _reference(model, config, ids, grids)
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs.to(ours.dtype)), (grids, ids)
    assert delta == their_delta
