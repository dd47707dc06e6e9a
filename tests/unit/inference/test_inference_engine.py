"""The torch engine's paged KV cache on CPU: prefix sharing, block pressure, admission and retirement,
cancellation mid-step, swaps mid-generation, sampling parameters, hooks for structured outputs and
prompt log-probs. Log-probs are checked against an independent transformers forward pass."""

from __future__ import annotations

import asyncio
import dataclasses
import warnings

import pytest
import pytest_asyncio
import torch
from gyre.transport import FetchedWeights
from gyre_inference.backend import SamplingParams
from gyre_inference.torch_backend import TorchBackend

pytestmark = pytest.mark.asyncio
PROMPT = [(7 * i + 3) % 900 + 5 for i in range(40)]  # 2 full blocks of 16 and a partial one


def expected_logprobs(model, prompt, tokens, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest_asyncio.fixture
async def engine(tiny_model):
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=16)
    await backend.start()
    yield backend
    await backend.shutdown()


async def run(backend, prompt, **params):
    events = [e async for e in backend.generate(prompt, SamplingParams(**params))]
    return [e.token_id for e in events], torch.tensor([e.logprob for e in events]), events


async def together(backend, runs):
    """Queue `runs` so the engine admits them in one prefill (it waits on its condition while we hold it)."""
    with backend._cond:
        tasks = [asyncio.ensure_future(r) for r in runs]
        await asyncio.sleep(0.1)
    return await asyncio.gather(*tasks)


async def idle(backend):
    """Until the engine retired every row (it frees a row right after handing over its last token)."""
    for _ in range(500):
        if backend.load_stats() == (0, 0):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still busy: {backend.load_stats()}")


def check(reference, prompt, result, temperature=1.0):
    tokens, logprobs, _ = result
    assert torch.allclose(logprobs, expected_logprobs(reference, prompt, tokens, temperature), atol=1e-4)


async def test_a_group_of_rollouts_is_prefilled_once_and_copies_the_shared_block_on_write(engine, reference):
    stats, batch = engine.stats, engine._batch
    group = await together(engine, [run(engine, PROMPT, max_tokens=20, seed=s) for s in range(8)])
    assert stats.prefilled == len(PROMPT)  # the prompt was computed once for the 8
    assert batch.copied == 7  # the partial last block, copied by 7 of the 8 at their first write
    for result in group:
        check(reference, PROMPT, result)
    assert len({tuple(r[0]) for r in group}) == 8  # own random streams
    alone = await run(engine, PROMPT, max_tokens=20, seed=3)
    assert alone[0] == group[3][0]  # the same seed gives the same tokens shared or not
    await idle(engine)
    assert engine._batch.pool.free_blocks == engine._runner.num_blocks - 1  # nothing leaked (block 0: the null block)


async def test_a_prompt_seen_before_reuses_its_cached_full_blocks(engine, reference):
    first = await run(engine, PROMPT, max_tokens=30, seed=1)
    before = engine.stats.prefilled
    second = await run(engine, PROMPT, max_tokens=5, seed=2)
    assert engine.stats.prefilled - before == len(PROMPT) - 32  # 2 full blocks came from the cache
    check(reference, PROMPT, second)
    # a multi-turn history: the last turn's prompt + completion + more, reusing the blocks decoding filled
    history = PROMPT + first[0] + [11, 12, 13]
    before = engine.stats.prefilled
    third = await run(engine, history, max_tokens=5, seed=3)
    assert engine.stats.prefilled - before == len(history) - 64  # 4 full blocks, 2 of them filled by decoding
    check(reference, history, third)


async def test_a_weight_swap_keeps_rows_running_and_stops_reuse_of_old_blocks(engine, reference, tiny_model, tmp_path):
    from test_inference_torch_backend import _save_perturbed

    new_model = _save_perturbed(tiny_model, tmp_path / "v1")
    await run(engine, PROMPT, max_tokens=4, seed=1)  # PROMPT's full blocks are cached under version 0
    stream = engine.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0))
    events = [await stream.__anext__() for _ in range(3)]
    await engine.update_weights(FetchedWeights.local(tmp_path / "v1", 1))
    events += [e async for e in stream]
    versions = [e.version for e in events]
    assert len(events) == 40 and versions[:3] == [0, 0, 0] and versions[-1] == 1 and versions == sorted(versions)
    before = engine.stats.prefilled
    fresh = await run(engine, PROMPT, max_tokens=8, seed=5)
    assert engine.stats.prefilled - before == len(PROMPT)  # nothing reused from version 0
    assert {e.version for e in fresh[2]} == {1}
    check(new_model, PROMPT, fresh)


async def test_under_block_pressure_rows_wait_or_are_preempted_and_finish_with_the_same_tokens(tiny_model, reference):
    async def tokens(kv_cache_gb):
        backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, kv_cache_gb=kv_cache_gb)
        await backend.start()
        try:
            prompts = [PROMPT[i:] for i in range(6)]
            results = await together(backend, [run(backend, p, max_tokens=60, seed=i, temperature=0.8)
                                               for i, p in enumerate(prompts)])  # fmt: skip
            for prompt, result in zip(prompts, results, strict=True):
                check(reference, prompt, result, 0.8)
            return [r[0] for r in results], backend._batch.preempted
        finally:
            await backend.shutdown()

    roomy, none_preempted = await tokens(None)
    # 30 blocks of 16: six rows of ~100 tokens need 42; admission waits and decoding preempts
    tight, preempted = await tokens(30 * 16 * 4096 / 2**30)
    assert none_preempted == 0 and preempted > 0
    assert tight == roomy


async def test_a_backlog_is_admitted_by_priority_then_arrival(tiny_model):
    # vLLM's request priority (lower first): the orchestrator sends the RL step, so an older batch's rollouts
    # take the rows before a newer batch's, whatever order they arrived in
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=1)
    await backend.start()
    finished = []

    async def one(name, priority):
        await run(backend, PROMPT[: 10 + len(finished)], max_tokens=4, seed=1, priority=priority)
        finished.append(name)

    try:
        await together(backend, [one(name, p) for name, p in [("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", 3)]])
    finally:
        await backend.shutdown()
    assert finished == ["b", "d", "c", "a", "e"]


async def test_under_block_pressure_the_lowest_priority_row_is_preempted_first(tiny_model, reference):
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, kv_cache_gb=30 * 16 * 4096 / 2**30)
    await backend.start()
    victims, requeue = [], backend._requeue
    backend._requeue = lambda seqs: (victims.extend(seq.params.priority for seq in seqs), requeue(seqs))
    try:
        params = {"max_tokens": 60, "temperature": 0.8}
        # three rows of the newer batch (priority 5) run first; three of the older one (0) come after them
        newer = [asyncio.ensure_future(run(backend, PROMPT[i:], seed=i, priority=5, **params)) for i in range(3)]
        for _ in range(500):
            if backend.load_stats()[0] == 3:
                break
            await asyncio.sleep(0.01)
        older = [run(backend, PROMPT[i:], seed=i, priority=0, **params) for i in range(3, 6)]
        results = await asyncio.gather(*newer, *older)
    finally:
        await backend.shutdown()
    # 30 blocks of 16 hold three rows of ~100 tokens, not six: rows are preempted, and never one of the older
    # batch while a newer one is running (the newest admitted, the old rule, would have been the older batch's)
    assert victims and set(victims) == {5}
    for i, result in enumerate(results):
        check(reference, PROMPT[i:], result, 0.8)
        assert len(result[0]) == 60


@pytest.mark.parametrize("overlap", [False, True])
async def test_a_row_cancelled_during_a_step_leaves_the_next_one_and_returns_its_blocks(engine, overlap):
    engine.overlap = overlap  # True: the step after it may be launched already (the overlapped loop)
    pool, runner = engine._batch.pool, engine._runner
    free = pool.free_blocks
    launch, cancel = runner.launch, []

    def cancelling(*args):
        if cancel:  # the asyncio side closes a stream while the step runs
            cancel.pop().cancelled = True
        return launch(*args)

    runner.launch = cancelling
    keep = engine.generate(PROMPT, SamplingParams(max_tokens=30, seed=1))
    drop = engine.generate(PROMPT[:20], SamplingParams(max_tokens=30, seed=2))
    await keep.__anext__()
    await drop.__anext__()
    cancel.append(next(seq for seq in engine._rows if len(seq.prompt) == 20))
    rest = [e async for e in keep]
    assert len(rest) == 29 and rest[-1].finish_reason == "length"
    await idle(engine)
    assert pool.free_blocks == free


async def test_sampling_parameters_reach_the_device_sampler(engine, reference):
    @dataclasses.dataclass(frozen=True)
    class Params(SamplingParams):  # top_k / min_p as the HTTP layer would pass them
        top_k: int = 0
        min_p: float = 0.0

    async def go(**params):
        events = [e async for e in engine.generate(PROMPT, Params(**params))]
        return [e.token_id for e in events], torch.tensor([e.logprob for e in events])

    for params, keep in [({"top_k": 3}, lambda p: p >= p.topk(3).values[-1]),
                         ({"min_p": 0.3}, lambda p: p >= 0.3 * p.max())]:  # fmt: skip
        tokens, logprobs = await go(max_tokens=24, seed=7, **params)
        with torch.no_grad():
            logits = reference(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
        probs = torch.softmax(logits, -1)
        for row, token in enumerate(tokens):
            assert keep(probs[row])[token], params
        assert torch.allclose(logprobs, probs.log().gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-4)


async def test_a_structured_output_constraint_masks_its_row_only(engine, reference):
    class Matcher:
        """A stand-in with the xgrammar-style interface: allows only tokens 10..19, ends after 5 tokens."""

        def __init__(self):
            self.accepted = []

        def fill_next_token_bitmask(self, bitmask, row):
            bitmask[row] = 0
            bitmask[row, 0] = sum(1 << t for t in range(10, 20))

        def accept_token(self, token):
            self.accepted.append(token)

        def is_terminated(self):
            return len(self.accepted) >= 5

    Params = SamplingParams
    matcher = Matcher()
    free, constrained = await together(engine, [run(engine, PROMPT, max_tokens=12, seed=1),
                                                run(engine, PROMPT, max_tokens=12, seed=2)])  # fmt: skip
    alone_free = free
    free, constrained = await together(engine, [
        run(engine, PROMPT, max_tokens=12, seed=1),
        (lambda: _run_params(engine, PROMPT, Params(max_tokens=12, seed=2, constraint=matcher)))(),
    ])  # fmt: skip
    assert free[0] == alone_free[0]  # the unconstrained row of the mixed batch is untouched
    tokens, logprobs, events = constrained
    assert len(tokens) == 5 and events[-1].finish_reason == "stop" and matcher.accepted == tokens
    assert all(10 <= t < 20 for t in tokens)
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    masked = torch.full_like(logits, float("-inf"))
    masked[:, 10:20] = logits[:, 10:20]
    expected = torch.log_softmax(masked, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(logprobs, expected, atol=1e-4)  # the log-probs of the distribution sampled


async def _run_params(backend, prompt, params):
    events = [e async for e in backend.generate(prompt, params)]
    return [e.token_id for e in events], torch.tensor([e.logprob for e in events]), events


async def test_prompt_logprobs_rows_compute_every_position_even_when_the_prefix_is_cached(engine, reference):
    await run(engine, PROMPT, max_tokens=2)  # PROMPT's full blocks are cached now
    before = engine.stats.prefilled
    _, _, events = await run(engine, PROMPT, max_tokens=3, prompt_logprobs=3)
    assert engine.stats.prefilled - before == len(PROMPT)  # no prefix hit: each position's logits are needed
    entries = events[0].prompt_logprobs
    assert [e.prompt_logprobs for e in events[1:]] == [None, None]  # on the first event only
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([PROMPT])).logits[0, :-1], -1)
    assert len(entries) == len(PROMPT) and entries[0] is None
    chosen = expected.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e.logprob for e in entries[1:]]), chosen, atol=1e-4)
    assert [t for t, _ in entries[6].top] == expected[5].topk(3).indices.tolist()


async def test_generation_raises_no_deprecation_warning(engine):
    """transformers deprecates `past_key_values=` (gone in 5.40): the engine calls no transformers forward."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await together(engine, [run(engine, p, max_tokens=8, seed=i) for i, p in enumerate([PROMPT, PROMPT[:9]])])
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)] == []


@pytest.mark.parametrize("attention", ["fused-torch"])
async def test_the_gpu_input_path_and_the_fused_step_give_the_tokens_of_the_plain_cpu_step(tiny_model, attention):
    """What only a GPU runs, run on CPU: separate host mirrors and device buffers (the per-step upload of rows,
    block tables and biases), and the fused step's wiring (residual adds folded into the norms, q/k norm +
    rotary + cache write in one op, attention over each row's own table) with torch ops in place of the
    Triton kernels. Rows with biases, min_tokens, top log-probs and top-k share the batch with plain ones."""
    from gyre_inference.step_buffers import StepBuffers

    @dataclasses.dataclass(frozen=True)
    class Params(SamplingParams):
        top_k: int = 0

    requests = [(PROMPT, Params(max_tokens=40, seed=1)),
                (PROMPT[:9], Params(max_tokens=40, seed=2, logit_bias=((7, 3.0),), top_logprobs=3)),
                (PROMPT[5:], Params(max_tokens=40, seed=3, min_tokens=30, stop_token_ids=frozenset({9, 10}),
                                    logit_bias=((9, 4.0),))),
                (PROMPT[3:30], Params(max_tokens=40, seed=4, top_k=5))]  # fmt: skip

    async def outputs(**options):
        backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, **options.get("engine", {}))
        await backend.start()
        if options.get("mirror"):
            runner = backend._runner
            runner.inputs = backend._batch.inputs = StepBuffers(8, runner.max_blocks, runner.vocab, runner.device,
                                                                mirror=True)  # fmt: skip
        try:
            results = await together(backend, [_run_params(backend, p, params) for p, params in requests])
            return [(r[0], r[1], [e.top_logprobs for e in r[2]]) for r in results]
        finally:
            await backend.shutdown()

    plain = await outputs()
    for options in ({"mirror": True}, {"engine": {"attention": attention}}):
        other = await outputs(**options)
        for (tokens, logprobs, top), (tokens2, logprobs2, top2) in zip(plain, other, strict=True):
            assert tokens == tokens2, options
            assert torch.allclose(logprobs, logprobs2, atol=1e-5)
            assert [[t for t, _ in row] for row in top] == [[t for t, _ in row] for row in top2]
    assert len(plain[2][0]) >= 30 and 9 not in plain[2][0][:30]


async def test_the_engine_keys_reach_the_torch_backend():
    from gyre.config.inference import InferenceConfig
    from gyre_inference.service import make_backend

    config = InferenceConfig.model_validate(
        {"model": {"name": "m"}, "engine": {"kv_cache_gb": 2.5, "prefix_caching": False}}
    )
    backend = make_backend(config)
    assert (backend._kv_cache_gb, backend.prefix_caching) == (2.5, False)
    assert make_backend(InferenceConfig.model_validate({"model": {"name": "m"}})).prefix_caching is True


async def test_a_final_only_sequence_is_handed_over_in_one_piece_with_the_same_tokens(engine):
    """SamplingParams.final_only (a non-streaming choice without stop strings): one hand-off to the event loop
    when the sequence ends instead of one per token; the same events, and the first one says when it was sampled
    (the time to first token)."""
    import time

    handed = []
    deliver = engine._deliver

    def recording(items):
        handed.extend(item for _, item in items)
        deliver(items)

    engine._deliver = recording  # the engine thread looks it up on the instance
    params = SamplingParams(max_tokens=12, seed=5, top_logprobs=2)
    streamed = [e async for e in engine.generate(PROMPT, params)]
    assert len(handed) == 12  # one hand-off per token
    handed.clear()
    started = time.monotonic()
    final = [e async for e in engine.generate(PROMPT, dataclasses.replace(params, final_only=True))]
    arrived = time.monotonic()
    assert len(handed) == 1 and isinstance(handed[0], list) and len(handed[0]) == 12  # one hand-off in all

    def key(e):
        return e.token_id, e.version, e.finish_reason, [t for t, _ in e.top_logprobs]

    assert [key(e) for e in final] == [key(e) for e in streamed]
    assert torch.allclose(torch.tensor([e.logprob for e in final]), torch.tensor([e.logprob for e in streamed]))
    assert started <= final[0].sampled_at <= arrived and all(e.sampled_at is None for e in final[1:])
    assert all(e.sampled_at is None for e in streamed)


async def test_cache_salt_shares_cached_blocks_only_within_one_salt(engine):
    """vLLM's cache_salt: a prompt cached under one salt (or none) is computed again under another, and hit under its
    own; the tokens are the same whatever the salt."""
    prompt = [(5 * i + 11) % 900 + 5 for i in range(40)]  # 2 full blocks of 16: 32 positions to hit
    runs = []
    for salt in (None, None, "tenant-a", "tenant-a", "tenant-b", None):
        before = engine.stats.prefilled
        tokens, _, _ = await run(engine, prompt, max_tokens=3, seed=1, cache_salt=salt)
        runs.append((salt, engine.stats.prefilled - before, tokens))
    computed = [prefilled for _, prefilled, _ in runs]
    assert computed == [40, 8, 40, 8, 40, 8]  # the unsalted blocks are still cached at the end
    assert len({tuple(tokens) for *_, tokens in runs}) == 1
