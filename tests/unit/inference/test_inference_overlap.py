"""The torch engine's overlapped decode loop (engine_loop.py's module docstring), forced on on CPU: the same
tokens, log-probs, top log-probs and versions as the synchronous loop, with rows stopping at different steps,
admissions and a cancellation mid-run, a weight swap mid-generation and preemption under block pressure.

On CPU a step's compute runs inside `launch`, so what these tests check is the loop's bookkeeping: which rows a
step holds, carried input tokens (taken from the previous step's samples on the "device" side of separate
step buffers, as on a GPU), wasted steps of rows that stopped, blocks released only once no launched step
writes them. The `gpu` test runs the same workload with CUDA graphs, where the overlap is real."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time

import pytest
import torch
from gyre_inference.backend import SamplingParams
from gyre_inference.kv_cache import NULL_BLOCK
from gyre_inference.step_buffers import SLOTS, StepBuffers
from gyre_inference.torch_backend import TorchBackend, _Swap

PROMPT = [(7 * i + 3) % 900 + 5 for i in range(40)]
STOPS = frozenset(range(3, 1024, 9))  # ~1/9 of the vocabulary: rows stop after a few tokens, at different steps


@dataclasses.dataclass(frozen=True)
class Params(SamplingParams):  # top_k as the HTTP layer would pass it
    top_k: int = 0


FIRST = [  # admitted together
    (PROMPT, Params(max_tokens=30, seed=1)),
    (PROMPT, Params(max_tokens=20, seed=2)),  # shares the first's blocks (a group): copy-on-write
    (PROMPT[:9], Params(max_tokens=40, seed=3, stop_token_ids=STOPS, top_logprobs=3)),
    (PROMPT[5:], Params(max_tokens=40, seed=4, min_tokens=12, stop_token_ids=STOPS, logit_bias=((9, 4.0),))),
    (PROMPT[3:30], Params(max_tokens=25, seed=5, top_k=5)),
    (PROMPT[7:], Params(max_tokens=40, seed=6, stop_token_ids=STOPS)),
]
LATER = [  # admitted while the first ones decode
    (PROMPT[10:], Params(max_tokens=15, seed=7, stop_token_ids=STOPS)),
    (PROMPT[:20], Params(max_tokens=35, seed=8, temperature=0.7)),
]
CANCELLED = (PROMPT[2:], Params(max_tokens=40, seed=9))  # cancelled while the step computing its token 10 runs


async def _start(tiny_model, overlap: bool, **options) -> TorchBackend:
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, overlap=overlap, **options)
    await backend.start()
    runner = backend._runner  # separate host mirrors and "device" buffers, as on a GPU: carried tokens must
    runner.inputs = backend._batch.inputs = StepBuffers(8, runner.max_blocks, runner.vocab, runner.device,
                                                        mirror=True)  # fmt: skip
    _check_blocks_outlive_their_steps(backend)
    return backend


def _check_blocks_outlive_their_steps(backend):
    """Until a launched step is read, no block it writes may be free (on a GPU it could be handed to another
    sequence and written under the step): checked at every collect, for the cache slots the step was given."""
    runner, pool = backend._runner, backend._batch.pool
    launch, collect = runner.launch, runner.collect
    written = {}

    def launching(rows, *args):
        step = launch(rows, *args)
        written[id(step)] = runner.inputs.ints_np[SLOTS, :rows].copy() // pool.block_size
        return step

    def collecting(step):
        blocks = written.pop(id(step))
        assert all(pool.refs[block] > 0 for block in blocks if block != NULL_BLOCK), "a launched step's block was freed"
        return collect(step)

    runner.launch, runner.collect = launching, collecting


async def _stream(backend, prompt, params, events=None, started=None):
    events = [] if events is None else events
    async for event in backend.generate(prompt, params):
        events.append(event)
        if started is not None and len(events) == 5:
            started.set()
    return events


async def _run_workload(backend):
    """FIRST and CANCELLED in one admission, LATER once the first row has 5 tokens: every stream's events."""
    _cancel_at(backend, CANCELLED[1], 10)
    started, cancelled = asyncio.Event(), []
    with backend._cond:  # one admission for the first group
        first = [asyncio.ensure_future(_stream(backend, p, params, None, started if i == 0 else None))
                 for i, (p, params) in enumerate(FIRST)]  # fmt: skip
        # a cancelled sequence gets no final event: its reader stops when the others are done
        dropped = asyncio.ensure_future(_stream(backend, *CANCELLED, cancelled))
        await asyncio.sleep(0.1)
    await started.wait()
    later = [asyncio.ensure_future(_stream(backend, p, params)) for p, params in LATER]
    results = await asyncio.gather(*first, *later)
    dropped.cancel()
    await asyncio.gather(dropped, return_exceptions=True)
    return [*results[: len(FIRST)], cancelled, *results[len(FIRST) :]]


def _cancel_at(backend, params: SamplingParams, index: int):
    """Mark the sequence of `params` cancelled (as a client going away does) when the step computing its token
    `index` is launched: it is cancelled while that step runs."""
    runner, launch = backend._runner, backend._runner.launch

    def cancelling(*args):
        seqs = [seq for seq in backend._rows if seq.params is params]
        if seqs and backend._batch.counters[seqs[0].row] == index:
            seqs[0].cancelled = True
        return launch(*args)

    runner.launch = cancelling


async def _workload(tiny_model, overlap: bool, **options):
    backend = await _start(tiny_model, overlap, **options)
    try:
        results = await _run_workload(backend)
        for _ in range(500):  # the engine retires the last rows right after handing over their tokens
            if backend.load_stats() == (0, 0):
                break
            await asyncio.sleep(0.01)
        assert backend._batch.pool.free_blocks == backend._runner.num_blocks - 1  # no block leaked
        return results, dataclasses.replace(backend.stats)
    finally:
        await backend.shutdown()


def _same(a, b):
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert [e.finish_reason for e in a] == [e.finish_reason for e in b]
    assert [e.version for e in a] == [e.version for e in b]
    assert [[t for t, _ in e.top_logprobs] for e in a] == [[t for t, _ in e.top_logprobs] for e in b]
    assert torch.allclose(torch.tensor([e.logprob for e in a]), torch.tensor([e.logprob for e in b]), atol=1e-5)


@pytest.mark.asyncio
@pytest.mark.parametrize("attention", ["torch", "fused-torch"])
async def test_the_overlapped_loop_gives_the_tokens_of_the_synchronous_one(tiny_model, reference, attention):
    plain, plain_stats = await _workload(tiny_model, False, attention=attention)
    ahead, stats = await _workload(tiny_model, True, attention=attention)
    assert plain_stats.overlapped_steps == 0 and stats.overlapped_steps > 20  # the loop really overlapped
    assert stats.wasted_rows > 0  # some row stopped by a stop token while its next step was in flight
    assert stats.prefilled == plain_stats.prefilled  # the same prefix-cache hits (a group, a cached block)
    reasons = [events[-1].finish_reason for events in plain]
    assert "stop" in reasons and "length" in reasons  # rows end at different steps, both ways
    cancelled = len(FIRST)
    for i, (a, b) in enumerate(zip(plain, ahead, strict=True)):
        if i == cancelled:  # its stream ends where the cancellation caught it: a prefix of the same tokens
            assert 10 <= len(a) < 40 and 10 <= len(b) < 40 and a[-1].finish_reason is None
            n = min(len(a), len(b))
            _same(a[:n], b[:n])
        else:
            _same(a, b)
    # and the log-probs are the model's: an independent forward over prompt + tokens
    for (prompt, params), events in zip([*FIRST, CANCELLED, *LATER], ahead, strict=True):
        if params.logit_bias or params.min_tokens:
            continue  # biased rows report the biased distribution (test_inference_torch_backend checks those)
        tokens = [e.token_id for e in events]
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / params.temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([e.logprob for e in events]), expected, atol=1e-4)


@pytest.mark.asyncio
async def test_blocks_filled_by_overlapped_decoding_are_registered_in_the_prefix_cache(tiny_model):
    backend = await _start(tiny_model, True)
    try:
        first = await _stream(backend, PROMPT, Params(max_tokens=30, seed=1))
        assert backend.stats.overlapped_steps > 20
        # a multi-turn history: the last turn's prompt + completion + more, reusing the blocks decoding filled
        history = PROMPT + [e.token_id for e in first] + [11, 12, 13]
        before = backend.stats.prefilled
        await _stream(backend, history, Params(max_tokens=5, seed=3))
        assert backend.stats.prefilled - before == len(history) - 64  # 4 full blocks, 2 of them filled by decoding
    finally:
        await backend.shutdown()


@pytest.mark.asyncio
async def test_a_weight_swap_mid_generation_drains_the_step_in_flight(tiny_model, tmp_path):
    """The swap lands between the same two tokens in both loops (injected when the step computing token 12 is
    launched): every token reports the version that computed it, and the tokens after it are the new weights'."""
    from test_inference_torch_backend import _save_perturbed

    _save_perturbed(tiny_model, tmp_path / "v1")

    async def run(overlap: bool):
        backend = await _start(tiny_model, overlap)
        tensors = backend._read_weights(tmp_path / "v1")
        runner, launch, swaps = backend._runner, backend._runner.launch, []

        def swapping(*args):
            if not swaps and any(backend._batch.counters[seq.row] == 12 for seq in backend._rows):
                swaps.append(_Swap(tensors, 1))
                with backend._cond:
                    backend._swap = swaps[0]
            return launch(*args)

        runner.launch = swapping
        try:
            with backend._cond:
                runs = [asyncio.ensure_future(_stream(backend, PROMPT[i:], Params(max_tokens=30, seed=i)))
                        for i in range(3)]  # fmt: skip
                await asyncio.sleep(0.1)
            results = await asyncio.gather(*runs)
            assert swaps[0].done.result() is None
            return results, backend.stats.overlapped_steps
        finally:
            await backend.shutdown()

    (plain, _), (ahead, overlapped) = await run(False), await run(True)
    assert overlapped > 0
    for a, b in zip(plain, ahead, strict=True):
        _same(a, b)
        assert [e.version for e in a] == [0] * 13 + [1] * 17  # tokens 0..12 by the old weights


@pytest.mark.asyncio
async def test_under_block_pressure_the_overlapped_loop_preempts_through_the_synchronous_path(tiny_model):
    async def tokens(kv_cache_gb, overlap):
        backend = await _start(tiny_model, overlap, kv_cache_gb=kv_cache_gb)
        try:
            with backend._cond:
                runs = [asyncio.ensure_future(_stream(backend, PROMPT[i:], Params(max_tokens=60, seed=i,
                                                                                   temperature=0.8)))
                        for i in range(6)]  # fmt: skip
                await asyncio.sleep(0.1)
            results = await asyncio.gather(*runs)
            return [[e.token_id for e in r] for r in results], backend._batch.preempted, backend.stats
        finally:
            await backend.shutdown()

    roomy, _, _ = await tokens(None, False)
    # 30 blocks of 16: six rows of ~100 tokens need 42; admission waits and decoding preempts
    tight, preempted, stats = await tokens(30 * 16 * 4096 / 2**30, True)
    assert preempted > 0 and stats.overlapped_steps > 0
    assert tight == roomy


def test_engine_overlap_reaches_the_torch_backend():
    from gyre.config.inference import InferenceConfig
    from gyre_inference.service import make_backend

    def backend(**engine):
        return make_backend(InferenceConfig.model_validate({"model": {"name": "m"}, "engine": engine}))

    assert backend().overlap is False  # CPU: nothing to overlap
    assert backend(overlap=True).overlap is True
    assert backend(device="cpu", overlap=False).overlap is False


@pytest.mark.asyncio
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_the_overlapped_loop_gives_the_same_tokens_with_cuda_graphs(tiny_model):
    """The same workload on the GPU, CUDA graphs on, where step n+1 really runs while the host reads step n.
    float32: the two loops may run a step on different batch buckets (a stopped row stays one step longer), and
    in bfloat16 another bucket's matmul rounds differently enough to flip a token."""

    async def run(overlap: bool):
        backend = TorchBackend(tiny_model, device="cuda", dtype="float32", max_batch_size=8, overlap=overlap)
        await backend.start()
        try:
            assert backend._runner.cuda_graphs
            _check_blocks_outlive_their_steps(backend)
            return await _run_workload(backend), backend.stats.overlapped_steps
        finally:
            await backend.shutdown()

    (plain, none), (ahead, overlapped) = await run(False), await run(True)
    assert none == 0 and overlapped > 20
    for i, (a, b) in enumerate(zip(plain, ahead, strict=True)):
        n = min(len(a), len(b)) if i == len(FIRST) else len(a)
        assert [e.token_id for e in a[:n]] == [e.token_id for e in b[:n]]
        assert [e.finish_reason for e in a[:n]] == [e.finish_reason for e in b[:n]]
        assert torch.allclose(torch.tensor([e.logprob for e in a[:n]]), torch.tensor([e.logprob for e in b[:n]]),
                              atol=1e-4)  # fmt: skip


def test_the_inference_bench_runs_the_engine_with_overlap_on_and_off_side_by_side(tiny_model, capsys):
    from gyre_inference.bench import main

    args = ["--model", str(tiny_model), "--http", "false", "--batch-sizes", "4", "--max-tokens", "6", "--repeats", "1",
            "--grpo", "false", "--constrained", "false", "--transformers-max-batch", "0", "--serving-clients", "4",
            "--http-repeats", "1"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    # the serving cost: a real server's event-loop CPU per token of 4 concurrent chat requests
    serving = re.search(r"serving, 4 concurrent chat requests: (\d+) tokens/s; event loop ([\d.]+) us CPU per token "
                        r"\(alone it could carry (\d+) tokens/s\)", out)  # fmt: skip
    assert serving, out
    rate, cost, ceiling = float(serving[1]), float(serving[2]), float(serving[3])
    assert rate > 0 and cost > 0 and abs(ceiling - 1e6 / cost) <= 1e6 / cost * 0.01 + 1
    assert "overlapped decode loop off by default" in out  # CPU
    lines = {line.split("  ")[0]: line for line in out.splitlines()}
    assert "torch engine, batch 4" in lines and "torch engine, batch 4, overlap on" in lines
    assert "transformers.generate, batch 4" not in lines  # --transformers-max-batch 0: none
    assert "overlap on / off, batch 4:" in out


def test_the_serving_cost_reads_the_cpu_time_of_the_main_thread_only():
    import os
    import threading

    from gyre_inference.bench_serving import main_thread_cpu_s

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    start = main_thread_cpu_s(os.getpid())
    worker = threading.Thread(target=spin, args=(0.3,))
    worker.start()
    worker.join()
    after_worker = main_thread_cpu_s(os.getpid())
    spin(0.3)
    after_main = main_thread_cpu_s(os.getpid())
    assert after_worker - start < 0.15  # another thread's work is not the main thread's
    assert after_main - after_worker >= 0.25
