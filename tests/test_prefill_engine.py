"""The prefill engine in-process (tiny model, a real redis-server, transformers as the oracle):
chunked prefill, the prefix cache and the embedding LRU must all leave greedy output unchanged."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch

from bench.synthetic import make_image
from control.redis_server import EmbeddedRedis
from epd import positions
from epd.config import PrefillConfig
from epd.lm import TextModelRunner
from epd.modelinfo import ModelInfo
from epd.sampling import SamplingConfig
from epd.store import Embedding, EmbeddingStore, store_key
from epd.v1 import epd_pb2
from prefill_svc.engine import PrefillEngine

SQUARE = make_image(448, 448, seed=1)
WIDE = make_image(640, 200, seed=2)
OTHER = make_image(448, 448, seed=3)  # same size as SQUARE: the same placeholder tokens
GREEDY = SamplingConfig(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=0, ignore_eos=True, logprobs=20)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return TextModelRunner.load(tiny_model_dir)


@pytest.fixture(scope="module")
def info(tiny_model_dir):
    return ModelInfo.load(tiny_model_dir)


@pytest.fixture
def make_engine(runner, info, redis_url):
    engines = []

    def make(**config) -> PrefillEngine:
        engine = PrefillEngine(runner, info, EmbeddingStore(redis_url), PrefillConfig(**config))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


class Case:
    """A prompt as prefill sees it, with its embeddings put in the store and transformers' answer."""

    def __init__(self, oracle, info, redis_url, messages, max_new_tokens=16):
        inputs = oracle.chat_inputs(messages)
        self.token_ids = inputs["input_ids"][0].tolist()
        self.refs = []
        store = EmbeddingStore(redis_url)
        if "pixel_values" in inputs:
            with torch.no_grad():
                out = oracle.model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
            rows = out.pooler_output
            images = [part["image"] for m in messages if not isinstance(m["content"], str)
                      for part in m["content"] if part["type"] == "image"]
            for data, grid in zip(images, inputs["image_grid_thw"].tolist()):
                n = grid[0] * grid[1] * grid[2] // 4
                key = store_key(info.fingerprint, hashlib.sha256(data).hexdigest())
                store.put(key, Embedding(tensor=rows[:n].contiguous(), grid_thw=tuple(grid)))
                rows = rows[n:]
                self.refs.append(epd_pb2.ImageRef(store_key=key, merged_height=grid[1] // 2, merged_width=grid[2] // 2))
        store.close()
        self.expected, self.logits, _ = oracle.generate_chat(messages, max_new_tokens=max_new_tokens)

    def request(self) -> epd_pb2.PrefillRequest:
        return epd_pb2.PrefillRequest(request_id="t", token_ids=self.token_ids, images=self.refs)


def user(text, *images):
    return [{"role": "user", "content": [*({"type": "image", "image": d} for d in images), {"type": "text", "text": text}]}]


def greedy(runner, case, result, num_tokens) -> list[int]:
    """Continue a prefill result the way decode does: last token at L + i + rope_delta."""
    tokens, state = [result.first_token], result.state
    for step in range(num_tokens - 1):
        pos = positions.decode_position(len(case.token_ids), step, result.rope_delta)
        hidden = runner.forward(runner.embed(torch.tensor([tokens[-1]])), torch.full((3, 1), pos), state)
        tokens.append(int(torch.argmax(runner.logits(hidden))))
    return tokens


def assert_matches_oracle(runner, case, result):
    reference = torch.log_softmax(case.logits, dim=-1)
    ids = [token for token, _ in result.logprobs.top]
    assert ids == torch.topk(reference, 20).indices.tolist()
    assert torch.allclose(torch.tensor([lp for _, lp in result.logprobs.top]), reference[ids], atol=1e-4, rtol=0)
    assert greedy(runner, case, result, len(case.expected)) == case.expected


@pytest.mark.parametrize("chunk_tokens", [16, 7, 4096])
def test_chunked_prefill_across_images_matches_transformers(oracle, info, redis_url, runner, make_engine, chunk_tokens):
    case = Case(oracle, info, redis_url, user("Compare the two pictures.", SQUARE, WIDE))
    engine = make_engine(chunk_tokens=chunk_tokens, prefix_cache_mb=0)
    result = engine.run(case.request(), GREEDY)
    assert result.cached_tokens == 0
    assert_matches_oracle(runner, case, result)


def _next_turn(oracle, info, redis_url, engine, first, question, follow_up):
    """The second turn of the conversation ``first`` began (``question`` about SQUARE; the answer
    "A square."), prefilled by ``engine``: its case, its result, and how many tokens it shares
    with the first turn's prompt."""
    history = user(question, SQUARE) + [{"role": "assistant", "content": "A square."},
                                        {"role": "user", "content": follow_up}]
    second = Case(oracle, info, redis_url, history)
    result = engine.run(second.request(), GREEDY)
    shared = next(i for i, (a, b) in enumerate(zip(first.token_ids, second.token_ids)) if a != b)
    return second, result, shared


def test_prefix_hit_computes_only_the_suffix_and_matches_transformers(oracle, info, redis_url, runner, make_engine):
    engine = make_engine(chunk_tokens=64, prefix_block_size=16, snapshot_every_blocks=4)
    first = Case(oracle, info, redis_url, user("What is in this picture?", SQUARE))
    engine.run(first.request(), GREEDY)
    assert engine.work()["computed_tokens"] == len(first.token_ids) and engine.work()["busy_s"] > 0
    second, result, shared = _next_turn(oracle, info, redis_url, engine, first, "What is in this picture?",
                                        "And its colour?")
    # The snapshot at the last block edge before the first turn's generation prompt is the one to hit.
    assert result.cached_tokens == shared // 16 * 16
    # the work counted: every prompt token not served from the cache, once
    assert engine.work()["computed_tokens"] == len(first.token_ids) + len(second.token_ids) - result.cached_tokens
    assert result.cached_tokens >= first.token_ids.index(info.image_token_id) + 196
    assert_matches_oracle(runner, second, result)


def test_snapshot_points_inside_a_chunk_cost_no_extra_forward(oracle, info, redis_url, runner, make_engine,
                                                             monkeypatch):
    """A prompt that fits one chunk runs in one forward even though its snapshot points (every 4
    blocks of 16, its last full block, its turn start) fall inside it: the forward cuts its mixing
    cores there and hands out the state at each (a scheduler that ended chunks at them took a
    forward per point). The snapshots are the real ones: the next turn starts from the last one
    and matches transformers."""
    engine = make_engine(chunk_tokens=4096, prefix_block_size=16, snapshot_every_blocks=4)
    forwards = []
    mixed_step = runner.mixed_step
    monkeypatch.setattr(runner, "mixed_step", lambda chunks, *args, **kw: forwards.append(
        [c[0].shape[0] for c in chunks]) or mixed_step(chunks, *args, **kw))
    first = Case(oracle, info, redis_url, user("Which shapes are in this picture?", SQUARE))
    engine.run(first.request(), GREEDY)
    assert forwards == [[len(first.token_ids)]]
    stops = len(first.token_ids) // 16 // 4  # snapshots every 4 blocks, at least
    assert engine.prefix.stats().num_entries > stops >= 3, engine.prefix.stats()
    second, result, shared = _next_turn(oracle, info, redis_url, engine, first, "Which shapes are in this picture?",
                                        "How big?")
    assert result.cached_tokens == shared // 16 * 16
    assert forwards[1:] == [[len(second.token_ids) - result.cached_tokens]]
    assert_matches_oracle(runner, second, result)


def test_a_snapshot_is_never_changed_by_the_requests_that_use_it(oracle, info, redis_url, runner, make_engine):
    engine = make_engine(chunk_tokens=512, prefix_block_size=16, snapshot_every_blocks=0)
    case = Case(oracle, info, redis_url, user("Describe it.", SQUARE), max_new_tokens=8)
    engine.run(case.request(), GREEDY)
    for _ in range(3):
        result = engine.run(case.request(), GREEDY)
        assert result.cached_tokens > 0
        assert_matches_oracle(runner, case, result)  # runs decode steps on the state it was given
        with torch.inference_mode():
            for tensor in (*result.state.keys, *result.state.values, *result.state.conv, *result.state.recurrent):
                if tensor is not None:
                    tensor.mul_(-3.0)  # decode owns this state now: the cache's copy must not move


def test_same_text_with_another_image_never_hits_the_prefix_cache(oracle, info, redis_url, runner, make_engine):
    for order in ((SQUARE, OTHER), (OTHER, SQUARE)):
        engine = make_engine(chunk_tokens=512, prefix_block_size=16, snapshot_every_blocks=1)
        cases = [Case(oracle, info, redis_url, user("Which is it?", image)) for image in order]
        assert cases[0].token_ids == cases[1].token_ids  # only the image differs
        first_image = cases[0].token_ids.index(info.image_token_id)
        for case in cases:
            result = engine.run(case.request(), GREEDY)
            assert result.cached_tokens <= first_image // 16 * 16  # only blocks before the image are shared
            assert_matches_oracle(runner, case, result)
        again = engine.run(cases[0].request(), GREEDY)  # its own entries are still there
        assert again.cached_tokens > first_image + 196
        assert_matches_oracle(runner, cases[0], again)


def test_embedding_lru_serves_repeats_and_stays_within_its_cap(oracle, info, redis_url, make_engine):
    engine = make_engine(embedding_cache_mb=1, prefix_cache_mb=0)
    case = Case(oracle, info, redis_url, user("Once.", SQUARE), max_new_tokens=1)
    engine.run(case.request(), GREEDY)
    EmbeddingStore(redis_url).delete([case.refs[0].store_key])  # now only the LRU has it
    engine.run(case.request(), GREEDY)
    stats = engine.embeddings.stats()
    assert (stats.hits, stats.misses, stats.num_entries) == (1, 1, 1)
    assert 0 < stats.num_bytes <= stats.capacity_bytes == 1 << 20


def test_missing_embedding_is_failed_precondition(oracle, info, redis_url, make_engine):
    import grpc

    from epd import errors, rpc

    engine = make_engine(embedding_cache_mb=0)
    case = Case(oracle, info, redis_url, user("Gone.", WIDE), max_new_tokens=1)
    EmbeddingStore(redis_url).delete([case.refs[0].store_key])
    with pytest.raises(errors.FailedPrecondition) as raised:
        engine.run(case.request(), GREEDY)
    assert rpc.status_of(raised.value)[0] is grpc.StatusCode.FAILED_PRECONDITION  # the router re-encodes on it


def test_a_short_prompt_is_not_stuck_behind_a_long_one(oracle, info, redis_url, make_engine):
    engine = make_engine(chunk_tokens=32, prefix_cache_mb=0)
    long_case = Case(oracle, info, redis_url, user("word " * 1500), max_new_tokens=1)
    short_case = Case(oracle, info, redis_url, user("Hi"), max_new_tokens=1)
    finished: dict[str, float] = {}

    def run(name, case):
        engine.run(case.request(), GREEDY)
        finished[name] = time.perf_counter()

    long_thread = threading.Thread(target=run, args=("long", long_case))
    long_thread.start()
    while not engine.num_waiting():  # the long prompt is running
        time.sleep(0.001)
    run("short", short_case)
    long_thread.join()
    assert finished["short"] < finished["long"]


@pytest.mark.parametrize("messages", [user("What is in this picture?", SQUARE), user("Hello! Who are you?"),
                                      user("Compare the two pictures.", SQUARE, WIDE)], ids=["image", "text", "two"])
def test_a_resumed_request_continues_exactly_where_it_stopped(oracle, info, redis_url, runner, make_engine, messages):
    """A decode worker died after ``k`` tokens: prefill runs the prompt plus those tokens (the
    prefix cache holds the prompt) and samples token ``k`` as decode would have; decode then goes
    on. Token for token what transformers' generate gives without any interruption."""
    engine = make_engine(chunk_tokens=64, prefix_block_size=16, snapshot_every_blocks=4)
    case = Case(oracle, info, redis_url, messages, max_new_tokens=24)
    engine.run(case.request(), GREEDY)  # the original request: its prompt is now in the prefix cache
    for k in (1, 5, 17):
        request = case.request()
        request.token_ids.extend(case.expected[:k])
        request.num_generated = k
        result = engine.run(request, GREEDY)
        assert result.first_token == case.expected[k]
        assert result.cached_tokens > 0  # the prompt was not computed again
        tokens, state = [result.first_token], result.state
        for step in range(len(case.expected) - k - 1):
            pos = positions.decode_position(len(request.token_ids), step, result.rope_delta)
            hidden = runner.forward(runner.embed(torch.tensor([tokens[-1]])), torch.full((3, 1), pos), state)
            tokens.append(int(torch.argmax(runner.logits(hidden))))
        assert case.expected[:k] + tokens == case.expected


def test_a_resumed_request_that_reaches_max_tokens_finishes_in_prefill(oracle, info, redis_url, make_engine):
    engine = make_engine()
    case = Case(oracle, info, redis_url, user("Hi"), max_new_tokens=6)
    request = case.request()
    request.token_ids.extend(case.expected[:5])
    request.num_generated = 5
    result = engine.run(request, SamplingConfig(max_tokens=6, ignore_eos=True))
    assert result.first_token == case.expected[5] and result.finish_reason.value == "length"


def test_inline_embeddings_need_no_store_and_an_unreachable_store_asks_for_them(oracle, info, tiny_model_dir,
                                                                               runner, make_engine, tmp_path):
    """With the store down, prefill fails fast with FAILED_PRECONDITION (the router then sends the
    embeddings inline); with them inline it needs no store at all and matches transformers."""
    from epd import errors
    from epd.store import encode_value

    down = EmbeddedRedis(max_memory_mb=16, directory=str(tmp_path))
    case = Case(oracle, info, down.url, user("Inline?", WIDE))
    values = {ref.store_key: EmbeddingStore(down.url).get_many([ref.store_key])[0] for ref in case.refs}
    down.stop()
    engine = PrefillEngine(runner, info, EmbeddingStore(down.url), PrefillConfig(embedding_cache_mb=0, prefix_cache_mb=0))
    try:
        with pytest.raises(errors.FailedPrecondition, match="out of reach"):
            engine.run(case.request(), GREEDY)
        request = case.request()
        for ref in request.images:
            ref.embedding = encode_value(ref.store_key, values[ref.store_key])
        assert_matches_oracle(runner, case, engine.run(request, GREEDY))
        bad = case.request()
        bad.images[0].embedding = b"EPDE not really"
        with pytest.raises(errors.FailedPrecondition):  # a miss: the router encodes again
            engine.run(bad, GREEDY)
    finally:
        engine.stop()


def test_an_inline_embedding_that_fails_its_checks_is_a_miss_and_never_cached(oracle, info, redis_url, runner,
                                                                             make_engine):
    """An inline value of the wrong shape (or one that fails its header check) is passed over for
    the LRU and the store, and never enters the LRU, so it cannot fail a later request."""
    from epd import errors
    from epd.store import encode_value

    engine = make_engine(embedding_cache_mb=8, prefix_cache_mb=0)
    case = Case(oracle, info, redis_url, user("Which shape?", SQUARE), max_new_tokens=16)
    key = case.refs[0].store_key
    store = EmbeddingStore(redis_url)
    (good,) = store.get_many([key])
    store.delete([key])
    forged_request = case.request()
    forged_request.images[0].embedding = encode_value(key, Embedding(tensor=good.tensor[:-4].clone(),
                                                                     grid_thw=good.grid_thw))
    with pytest.raises(errors.FailedPrecondition):  # nowhere else to get it: the router encodes again
        engine.run(forged_request, GREEDY)
    assert engine.embeddings.get(key) is None and engine.embeddings.stats().num_entries == 0
    store.put(key, good)
    store.close()
    for forged in (Embedding(tensor=good.tensor[:-4].clone(), grid_thw=good.grid_thw),  # a short value
                   Embedding(tensor=torch.zeros(good.tensor.shape[0], good.tensor.shape[1] + 1), grid_thw=good.grid_thw)):
        request = case.request()
        request.images[0].embedding = encode_value(key, forged)
        assert_matches_oracle(runner, case, engine.run(request, GREEDY))  # served from the store instead
        assert tuple(engine.embeddings.get(key).shape) == tuple(good.tensor.shape)
    stats = engine.embeddings.stats()
    assert stats.num_entries == 1


def test_a_cancelled_prompt_leaves_the_queue_and_stop_fails_what_waits(oracle, info, redis_url, make_engine):
    from concurrent.futures import ThreadPoolExecutor

    from epd import errors

    engine = make_engine(chunk_tokens=32, prefix_cache_mb=0)
    long_case = Case(oracle, info, redis_url, user("word " * 1500), max_new_tokens=1)
    short_case = Case(oracle, info, redis_url, user("Hi"), max_new_tokens=1)
    running = engine.submit(engine.prepare(long_case.request()))
    while running.started_at is None:
        time.sleep(0.001)
    queued = engine.submit(engine.prepare(short_case.request()))
    waiting = engine.submit(engine.prepare(short_case.request()))
    engine.cancel(queued)
    with pytest.raises(errors.Cancelled):
        queued.done.result(timeout=5)
    engine.cancel(running)  # stops at its next chunk edge, long before its ~1500 tokens are done
    with pytest.raises(errors.Cancelled):
        running.done.result(timeout=30)
    assert engine.num_cancelled == {"queued": 1, "running": 1, "handoff": 0}
    waiting.done.result(timeout=30)  # the others are unaffected
    with ThreadPoolExecutor(1) as pool:
        first = engine.submit(engine.prepare(long_case.request()))
        while first.started_at is None:
            time.sleep(0.001)
        blocked = pool.submit(engine.run, long_case.request(), GREEDY)  # waits: the first one has less left
        time.sleep(0.2)
        engine.stop()
        with pytest.raises(errors.Unavailable, match="shutting down"):
            blocked.result(timeout=15)  # failed, not left waiting for ever


def test_a_replayed_answer_holding_an_image_pad_token_is_text(oracle, info, redis_url, runner, make_engine):
    """A random model may sample <|image_pad|>: decode feeds it as a text token (transformers too:
    image features are spliced only into the prompt). A resume replays it, and prefill must not
    take it for an image placeholder: the next token equals the one an uninterrupted decode gives."""
    engine = make_engine()
    case = Case(oracle, info, redis_url, user("What is in this picture?", SQUARE), max_new_tokens=4)
    answer = [case.expected[0], info.image_token_id, case.expected[1]]
    original = engine.run(case.request(), GREEDY)
    state, prompt_len = original.state, len(case.request().token_ids)
    for step, token in enumerate(answer):
        pos = positions.decode_position(prompt_len, step, original.rope_delta)
        hidden = runner.forward(runner.embed(torch.tensor([token])), torch.full((3, 1), pos), state)
    uninterrupted = int(torch.argmax(runner.logits(hidden)))
    request = case.request()
    request.token_ids.extend(answer)
    request.num_generated = len(answer)
    assert engine.run(request, GREEDY).first_token == uninterrupted


def assert_prompt_logprobs_match(oracle, messages, token_ids, entries, num_top):
    """vLLM's prompt logprobs against transformers' one forward over the same prompt (float32):
    every token after the first, its logprob within 1e-4, its rank, the same top ids."""
    reference = oracle.prompt_logprobs(oracle.chat_inputs(messages))[:-1]  # row p: token p + 1
    targets = torch.tensor(token_ids[1:])
    assert [entry.token_id for entry in entries] == token_ids[1:]
    got = torch.tensor([entry.logprob for entry in entries])
    want = reference.gather(1, targets.view(-1, 1))[:, 0]
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    ranks = torch.tensor([entry.rank for entry in entries])
    assert ((reference > (want + 1e-4).view(-1, 1)).sum(1) + 1 <= ranks).all()  # ties within the tolerance
    assert (ranks <= (reference > (want - 1e-4).view(-1, 1)).sum(1) + 1).all()
    values, ids = torch.topk(reference, num_top, dim=1)
    assert [[t for t, _ in entry.top] for entry in entries] == ids.tolist()
    assert torch.allclose(torch.tensor([[lp for _, lp in entry.top] for entry in entries]), values, atol=1e-4, rtol=0)


def test_prompt_logprobs_through_chunks_across_images_match_transformers(oracle, info, redis_url, runner,
                                                                         make_engine):
    """Chunks of 16 tokens cut through both images; the prefix cache holds the whole prompt, and a
    request for its logprobs computes it from token 0 anyway (a cached prefix has no logits) while
    a request beside it in the same forward keeps its cache hit and its exact answer."""
    messages = user("Compare the two pictures.", SQUARE, WIDE)
    case = Case(oracle, info, redis_url, messages)
    engine = make_engine(chunk_tokens=16, batch_tokens=64, prefix_block_size=16, snapshot_every_blocks=1)
    assert engine.run(case.request(), GREEDY).cached_tokens == 0
    asked = case.request()
    asked.prompt_logprobs = 5
    jobs = [engine.submit(engine.prepare(asked)), engine.submit(engine.prepare(case.request()))]
    for job in jobs:
        job.done.result(timeout=120)
    with_logprobs, beside = (engine._result(job, request, GREEDY) for job, request in zip(jobs, (asked, case.request())))
    assert with_logprobs.cached_tokens == 0 and beside.cached_tokens > 0
    assert beside.prompt_logprobs == []
    assert_prompt_logprobs_match(oracle, messages, case.token_ids, with_logprobs.prompt_logprobs, 5)
    assert_matches_oracle(runner, case, with_logprobs)
    assert_matches_oracle(runner, case, beside)
    none_top = engine.run(_with(case.request(), prompt_logprobs=0), GREEDY).prompt_logprobs
    assert [entry.top for entry in none_top] == [[]] * (len(case.token_ids) - 1)
    assert torch.allclose(torch.tensor([entry.logprob for entry in none_top]),  # alone in its forward now
                          torch.tensor([entry.logprob for entry in with_logprobs.prompt_logprobs]), atol=1e-5, rtol=0)


def _with(request: epd_pb2.PrefillRequest, **fields) -> epd_pb2.PrefillRequest:
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def test_prompt_logprobs_bounds_name_the_limit(make_engine):
    from epd import limits

    engine = make_engine(prefix_cache_mb=0)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        engine.prepare(epd_pb2.PrefillRequest(token_ids=[1, 2, 3], prompt_logprobs=21))
    longest = limits.MAX_PROMPT_LOGPROB_ENTRIES // 21 + 1  # (tokens - 1) x 21 entries at most
    engine.prepare(epd_pb2.PrefillRequest(token_ids=[7] * longest, prompt_logprobs=20))
    with pytest.raises(ValueError, match=f"more than the {limits.MAX_PROMPT_LOGPROB_ENTRIES} one answer may hold"):
        engine.prepare(epd_pb2.PrefillRequest(token_ids=[7] * (longest + 1), prompt_logprobs=20))
    with pytest.raises(ValueError, match="a resumed one"):
        engine.prepare(epd_pb2.PrefillRequest(token_ids=[1, 2, 3], num_generated=1, prompt_logprobs=0))
