"""vLLM's presence, frequency and repetition penalties in the torch engine (CPU): per row, checked token by token
against plain torch over an independent transformers forward pass; the reported log-probs are those of the penalised
distribution; rows without penalties are bit for bit as beside unpenalised rows; a preempted row's recompute counts
its tokens again; a penalised step never runs as a CUDA graph. The last test runs on CUDA too (`gpu`): bf16, CUDA
graphs and the overlapped loop on, the penalised rows checked against plain torch over the engine's own logits."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from gyre_inference.backend import SamplingParams
from gyre_inference.torch_backend import TorchBackend
from test_inference_engine import PROMPT, _run_params, idle, together

pytestmark = pytest.mark.asyncio


def _penalise(logits: torch.Tensor, prompt, output, params: SamplingParams) -> torch.Tensor:
    """vLLM's penalties in plain torch, token by token, on one row's logits."""
    x = logits.clone()
    for token in set(prompt) | set(output):
        factor = params.repetition_penalty
        x[token] = x[token] / factor if x[token] > 0 else x[token] * factor
    for token in set(output):
        x[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return x


def penalised_logprobs(model, prompt, tokens, params: SamplingParams):
    """Per generated token: log_softmax of the penalised logits at the temperature, and the penalised argmax."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    rows, best = [], []
    for t in range(len(tokens)):
        x = _penalise(logits[t], prompt, tokens[:t], params)
        scale = params.temperature if params.temperature > 0 else 1.0
        rows.append(torch.log_softmax(x / scale, -1))
        best.append(int(x.argmax()))
    return torch.stack(rows).gather(1, torch.tensor(tokens)[:, None])[:, 0], best


PENALISED = [
    (PROMPT, SamplingParams(max_tokens=30, seed=1, temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.4)),
    (PROMPT[:9], SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.5)),
    (PROMPT[4:], SamplingParams(max_tokens=30, seed=3, presence_penalty=-1.0, frequency_penalty=1.5)),
]  # fmt: skip
PLAIN = (PROMPT[2:], SamplingParams(max_tokens=30, seed=4, top_logprobs=3))
# the same rows with their penalties off: a plain row must be bit for bit the same beside these as beside PENALISED
OFF = [(p, dataclasses.replace(params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0))
       for p, params in PENALISED]  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True])
async def test_penalised_rows_sample_the_penalised_distribution_and_plain_rows_are_untouched(tiny_model, reference,
                                                                                             overlap):  # fmt: skip
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, overlap=overlap)
    await backend.start()
    try:
        *penalised, plain = await together(backend, [_run_params(backend, p, params) for p, params in
                                                     [*PENALISED, PLAIN]])  # fmt: skip
        *unpenalised, alone = await together(backend, [_run_params(backend, p, params) for p, params in [*OFF, PLAIN]])
    finally:
        await backend.shutdown()
    for (prompt, params), (tokens, logprobs, _) in zip(PENALISED, penalised, strict=True):
        expected, best = penalised_logprobs(reference, prompt, tokens, params)
        assert torch.allclose(logprobs, expected, atol=1e-4), params
        if params.temperature == 0:
            assert tokens == best
    for with_penalties, without in zip(penalised, unpenalised, strict=True):
        assert with_penalties[0] != without[0]  # the penalties changed what was sampled
    assert plain[0] == alone[0] and torch.equal(plain[1], alone[1])
    assert [e.top_logprobs for e in plain[2]] == [e.top_logprobs for e in alone[2]]


async def test_a_preempted_penalised_row_counts_its_tokens_again_on_recompute(tiny_model):
    async def tokens(kv_cache_gb):
        backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, kv_cache_gb=kv_cache_gb)
        await backend.start()
        try:
            params = [SamplingParams(max_tokens=60, seed=i, temperature=0.8, repetition_penalty=1.2,
                                     frequency_penalty=0.3) for i in range(6)]  # fmt: skip
            results = await together(backend, [_run_params(backend, PROMPT[i:], p) for i, p in enumerate(params)])
            return [r[0] for r in results], backend._batch.preempted
        finally:
            await backend.shutdown()

    roomy, none_preempted = await tokens(None)
    tight, preempted = await tokens(30 * 16 * 4096 / 2**30)  # as test_inference_engine's block-pressure test
    assert none_preempted == 0 and preempted > 0
    assert tight == roomy


async def test_a_penalised_step_runs_eagerly_even_where_the_runner_captures_graphs(tiny_model):
    """A CUDA graph's capture fails on CPU, so a step that reached one fails here: a penalised batch must not."""
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, overlap=False)
    await backend.start()
    try:
        backend._runner.cuda_graphs = True
        tokens, _, events = await _run_params(backend, PROMPT, SamplingParams(max_tokens=5, presence_penalty=0.5))
        assert len(tokens) == 5 and events[-1].finish_reason == "length"
    finally:
        await backend.shutdown()


def _record_penalised_decode_samples(backend, monkeypatch, records: list) -> None:
    """Wrap the decode step's sampler: for each penalised row of an eager step, keep (prompt, tokens so far, the
    row's logits as the sampler read them, the token it sampled, its reported log-prob). A step replayed as a CUDA
    graph never calls it: a record per token also shows every penalised step ran eagerly."""
    from gyre_inference import model_runner

    original = model_runner.sample

    def sample(logits, temperature, uniform, **kwargs):
        out = original(logits, temperature, uniform, **kwargs)
        if kwargs.get("penalties") is not None:  # never inside a capture (penalised steps are eager)
            rows = backend._batch.rows[: len(logits)]
            # a copy: on CPU in float32 `logits` is the runner's buffer itself, which the next step overwrites
            values, tokens, chosen = logits.float().cpu().clone(), out[0].tolist(), out[1].tolist()
            for row, seq in enumerate(rows):
                if seq is not None and seq.penalised:
                    records.append((tuple(seq.prompt), list(seq.tokens), values[row], tokens[row], chosen[row]))
        return out

    monkeypatch.setattr(model_runner, "sample", sample)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])  # fmt: skip
async def test_with_cuda_graphs_and_the_overlapped_loop_penalised_steps_run_eagerly_and_the_rest_is_as_before(
    tiny_model, device, monkeypatch
):
    """On CUDA (bf16, CUDA graphs and the overlapped loop on, as served): the penalised rows' log-probs are plain
    torch's over the very logits the sampler read (the reference cannot be a separate forward: bf16 kernels differ),
    the plain row beside them gets bit for bit what it gets beside the same rows with penalties off, and afterwards
    the unpenalised workload runs as before the penalised request: every step a graph replay, no new capture, as
    many overlapped steps, the same tokens, and no added device sync (torch's sync debug mode counts them). On CPU
    (no graphs, the overlapped loop forced on) the same test checks everything but graphs and syncs."""
    cuda = device == "cuda"
    options = {"device": "cuda", "dtype": "bfloat16"} if cuda else {"threads": 1, "overlap": True}
    backend = TorchBackend(tiny_model, max_batch_size=8, **options)
    await backend.start()
    runner, stats = backend._runner, backend.stats

    async def run(workload):
        """Generate `workload` as one batch: its results and what it did (steps, replays, captures, overlapped
        steps, device syncs)."""
        counters = runner.steps, runner.replays, runner.captures, stats.overlapped_steps
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the engine thread's warnings too (the filters are the process's)
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                results = await together(backend, [_run_params(backend, p, params) for p, params in workload])
                await idle(backend)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchronizing CUDA operation" in str(w.message) for w in caught)
        now = runner.steps, runner.replays, runner.captures, stats.overlapped_steps
        return results, (*(b - a for a, b in zip(counters, now, strict=True)), syncs)

    try:
        assert backend.overlap and runner.cuda_graphs == cuda
        await run([*OFF, PLAIN])  # the unpenalised workload's graphs are captured and its prompts' blocks cached
        before, (steps, replays, captures, overlapped, syncs) = await run([*OFF, PLAIN])
        records = []
        with monkeypatch.context() as patch:
            _record_penalised_decode_samples(backend, patch, records)
            mixed, (mixed_steps, mixed_replays, *_) = await run([*PENALISED, PLAIN])
        after, after_counters = await run([*OFF, PLAIN])
    finally:
        await backend.shutdown()

    # the penalised rows: every decode step ran eagerly and sampled plain torch's penalised distribution
    assert mixed_steps >= 29 and mixed_replays == 0
    for (prompt, params), (tokens, logprobs, _) in zip(PENALISED, mixed[:-1], strict=True):
        mine = [r for r in records if r[0] == tuple(prompt)]
        assert sorted(len(r[1]) for r in mine) == list(range(1, 30))  # tokens 2..30 (the first is the prefill's)
        for _, output, logits, token, chosen in mine:
            assert output == tokens[: len(output)] and token == tokens[len(output)]
            assert chosen == pytest.approx(float(logprobs[len(output)]), abs=1e-6)  # what the request was told
            x = _penalise(logits, list(prompt), output, params)
            scale = params.temperature if params.temperature > 0 else 1.0
            assert float(torch.log_softmax(x / scale, -1)[token]) == pytest.approx(chosen, abs=1e-3), params
            if params.temperature == 0:
                assert x[token] == x.max()  # greedy: the penalised argmax (a tie in bf16 logits is either)
    for with_penalties, without in zip(mixed[:-1], after[:-1], strict=True):
        assert with_penalties[0] != without[0]  # the penalties changed what was sampled
    # the plain row beside penalised rows: bit for bit as beside the same rows unpenalised
    plain, alone = mixed[-1], after[-1]
    assert plain[0] == alone[0] and torch.equal(plain[1], alone[1])
    assert [e.top_logprobs for e in plain[2]] == [e.top_logprobs for e in alone[2]]
    # afterwards the engine is back where it was: graph replays, overlapped steps, no added sync, the same tokens
    for a, b in zip(before, after, strict=True):
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    after_steps, after_replays, after_captures, after_overlapped, after_syncs = after_counters
    assert after_steps == steps and after_captures == captures == 0
    assert after_overlapped == overlapped > 20
    assert after_replays == replays == (steps if cuda else 0)
    # a sync per token would add ~29; equal counts before and after in practice, a little slack for timing
    assert after_syncs <= syncs + 2, (syncs, after_syncs)
