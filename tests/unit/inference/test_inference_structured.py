"""Structured outputs in the torch engine: the `Constraint` hook contract, the batched device mask, and
the llguidance grammar engine on the tiny model's tokenizer.

The engine tests drive a plain-Python `Constraint` (`EvenThenEnd`), so they state the hook's contract
exactly, whatever grammar engine sits behind it: one host bitmask per step for the constrained rows,
masked logits before temperature/top-p, the reported log-probs those of the masked distribution, the
matcher told each sampled token, "stop" once it is terminated, and free rows in the same decode step
untouched.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from gyre_inference.backend import SamplingParams
from gyre_inference.structured import Constraint, GrammarCompiler, Guide, GuideError, bitmask_words
from gyre_inference.torch_backend import TorchBackend

PROMPT = [1, 705, 201, 74, 75, 2, 201, 1, 739, 201]
END = 3  # the fake grammar's end-of-sequence token


def allowed_bits(allowed: set[int], vocab: int) -> torch.Tensor:
    row = torch.zeros(bitmask_words(vocab), dtype=torch.int64)
    for token in allowed:
        row[token // 32] |= 1 << (token % 32)
    return (row - (row >= 2**31).long() * 2**32).to(torch.int32)  # the words as int32 bit patterns


class EvenThenEnd:
    """A grammar in plain Python: `length` even token ids, then END (which terminates it)."""

    def __init__(self, length: int, vocab: int):
        self.length, self.vocab, self.accepted, self.masks = length, vocab, [], []

    def allowed(self) -> set[int]:
        return {END} if len(self.accepted) >= self.length else set(range(4, self.vocab, 2))

    def fill_next_token_bitmask(self, bitmask, index):
        self.masks.append(self.allowed())
        bitmask[index] = allowed_bits(self.masks[-1], self.vocab)

    def accept_token(self, token_id):
        ok = token_id in self.allowed()
        self.accepted.append(token_id)
        return ok

    def is_terminated(self):
        return bool(self.accepted) and self.accepted[-1] == END


def test_the_fake_grammar_satisfies_the_protocol():
    assert isinstance(EvenThenEnd(2, 64), Constraint)


def allowed_tokens(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    """The token ids whose bit is set in one bitmask row."""
    bits = (bitmask_row.to(torch.int64)[:, None] >> torch.arange(32)) & 1
    return bits.flatten()[:vocab].nonzero()[:, 0].tolist()


# ---- the engine ------------------------------------------------------------------------------------
async def _events(backend, prompt, params):
    return [e async for e in backend.generate(prompt, params)]


@pytest.mark.asyncio
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_a_constrained_row_samples_from_the_masked_distribution_in_a_mixed_batch(backend, reference, temperature):
    await _mixed_batch_contract(backend, reference, temperature)


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_the_mask_on_a_cuda_engine_with_graphs(tiny_model, reference):
    """The same contract where the mask is applied on the GPU, after a CUDA-graph decode step (fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    engine = TorchBackend(tiny_model, device="cuda", dtype="float32", max_batch_size=8)
    await engine.start()
    try:
        assert engine._runner.cuda_graphs
        for temperature in (1.0, 0.0):
            await _mixed_batch_contract(engine, reference.to("cuda"), temperature)
    finally:
        await engine.shutdown()
        reference.to("cpu")


async def _mixed_batch_contract(backend, reference, temperature):
    vocab = reference.config.vocab_size
    free = SamplingParams(max_tokens=12, temperature=temperature, seed=5, top_logprobs=3)
    alone = await _events(backend, PROMPT, free)

    steps, decodes = [], []
    step, decode = backend._runner.decode, backend._decode
    backend._runner.decode = lambda *a: steps.append(1) or step(*a)

    def counted_decode():
        decodes.append({seq.params.constraint is not None for seq in backend._rows})
        decode()

    backend._decode = counted_decode
    grammar = EvenThenEnd(6, vocab)
    constrained = SamplingParams(max_tokens=12, temperature=temperature, seed=9, top_logprobs=3, constraint=grammar)
    mixed, together = await asyncio.gather(_events(backend, PROMPT, constrained), _events(backend, PROMPT, free))

    # one decode step per engine iteration, also for batches mixing constrained and free rows
    assert len(steps) == len(decodes) and {True, False} in decodes
    backend._runner.decode, backend._decode = step, decode
    # the free row is what it is alone (up to the float noise of another batch shape)
    assert [(e.token_id, [t for t, _ in e.top_logprobs]) for e in together] == [
        (e.token_id, [t for t, _ in e.top_logprobs]) for e in alone
    ]
    assert torch.allclose(torch.tensor([e.logprob for e in together]), torch.tensor([e.logprob for e in alone]),
                          atol=1e-5)  # fmt: skip
    # the constrained row: allowed tokens only, the matcher saw each, "stop" when it terminated
    tokens = [e.token_id for e in mixed]
    assert len(tokens) == 7 and all(t % 2 == 0 and t >= 4 for t in tokens[:6]) and tokens[6] == END
    assert grammar.accepted == tokens and mixed[-1].finish_reason == "stop"
    # its log-probs: log_softmax(masked logits / T), as an independent forward pass computes them
    with torch.no_grad():
        ids = torch.tensor([PROMPT + tokens], device=reference.device)
        logits = reference(ids).logits[0, len(PROMPT) - 1 : -1].cpu()
    for row, allowed in enumerate(grammar.masks):
        logits[row, [t for t in range(vocab) if t not in allowed]] = float("-inf")
    scale = temperature if temperature > 0 else 1.0
    expected = torch.log_softmax(logits / scale, -1)
    got = torch.tensor([e.logprob for e in mixed])
    assert torch.allclose(got, expected.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-4)
    assert mixed[-1].logprob == pytest.approx(0.0, abs=1e-6)  # END was the only token allowed
    for event in mixed[:6]:
        assert all(t % 2 == 0 for t, _ in event.top_logprobs)  # alternatives of the same (masked) distribution
    if temperature == 0:
        assert tokens[:6] == expected[:6].argmax(-1).tolist()


# ---- the grammar engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler(model_text):
    return GrammarCompiler(model_text.tokenizer, model_text.vocab_size, model_text.eos_token_ids)


def _drive(compiler, guide, vocab, seed=0, limit=400) -> str:
    """Sample uniformly among the tokens the matcher allows until it terminates; the decoded text."""
    import random

    rng = random.Random(seed)
    matcher = compiler.matcher(guide)
    bitmask = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
    tokens = []
    for _ in range(limit):
        matcher.fill_next_token_bitmask(bitmask, 0)
        token = rng.choice(allowed_tokens(bitmask[0], vocab))
        assert matcher.accept_token(token)
        tokens.append(token)
        if matcher.is_terminated():
            break
    assert tokens[-1] in compiler.eos_token_ids, "the grammar did not end within the limit"
    return compiler._tokenizer.decode_str(tokens[:-1])


def test_each_guide_kind_yields_text_that_matches_it(compiler, model_text):
    import re

    import jsonschema

    vocab = model_text.vocab_size
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
              "s": {"type": "string", "maxLength": 4}, "b": {"type": "boolean"}},
              "required": ["n", "s", "b"], "additionalProperties": False}  # fmt: skip
    for seed in range(5):
        value = json.loads(_drive(compiler, Guide("json", schema), vocab, seed))
        jsonschema.validate(value, schema)
        assert re.fullmatch(r"[a-c]{2}\d", _drive(compiler, Guide("regex", r"[a-c]{2}\d"), vocab, seed))
        assert _drive(compiler, Guide("choice", ("yes", "no")), vocab, seed) in ("yes", "no")
        assert _drive(compiler, Guide("grammar", 'start: "x" ("y" | "z")'), vocab, seed) in ("xy", "xz")
        assert _drive(compiler, Guide("grammar", 'root ::= "a" [0-9]'), vocab, seed)[0] == "a"  # GBNF
    assert _drive(compiler, Guide("json", schema), vocab, 1) != _drive(compiler, Guide("json", schema), vocab, 2)


CONST_SCHEMA = {"type": "object", "properties": {"t": {"const": "q</tool_call>z"}}, "required": ["t"],
                "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize(
    ("guide", "text"),
    [
        # the tiny tokenizer has <tool_call> as an added token and <|im_end|> / <|endoftext|> as special ones
        (Guide("regex", r"ab<tool_call>cd"), "ab<tool_call>cd"),
        (Guide("regex", r"x<\|im_end\|>y"), "x<|im_end|>y"),
        (Guide("choice", ("<tool_call>", "<|endoftext|>!")), None),
        (Guide("json", CONST_SCHEMA), '{"t": "q</tool_call>z"}'),
    ],
)
def test_a_literal_holding_an_added_tokens_text_is_generated_in_full(compiler, model_text, guide, text):
    """The literal is text: spelled with ordinary tokens, never the added token (which the grammar would
    refuse), and never cut short by an end of sequence."""
    for seed in range(3):
        out = _drive(compiler, guide, model_text.vocab_size, seed)
        assert out == text if text is not None else out in guide.value, out


@pytest.mark.parametrize(
    "guide",
    [Guide("json", {"type": "frobnicate"}), Guide("regex", "a(b"), Guide("grammar", "start: undefined_rule")],
)
def test_invalid_guides_are_refused_with_the_engine_reason(compiler, guide):
    with pytest.raises(GuideError) as error:
        compiler.check(guide)
    assert str(error.value)


@pytest.mark.parametrize("parallel", [False, True])
def test_the_forced_call_grammar_yields_only_calls_of_the_allowed_tools(compiler, model_text, parallel):
    import jsonschema
    from gyre_inference.tools import TOOL_CALL_END, TOOL_CALL_START, forced_call_grammar, parse_tool_calls

    schemas = {"add": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": ["a"], "additionalProperties": False},
               "echo": {"type": "object", "properties": {"s": {"enum": ["x", "y"]}}, "required": ["s"],
                        "additionalProperties": False}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()]
    added = model_text.tokenizer.get_added_vocab()
    assert TOOL_CALL_START in added and TOOL_CALL_END in added  # the tiny tokenizer has them as tokens, as Qwen's
    grammar = forced_call_grammar(tools, parallel=parallel, tags_are_tokens=True)
    counts = set()
    for seed in range(8):
        text = _drive(compiler, Guide("grammar", grammar, "tool_choice"), model_text.vocab_size, seed)
        content, calls = parse_tool_calls(text)
        assert content is None and calls, text
        counts.add(len(calls))
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert counts == {1} if not parallel else max(counts) > 1


def test_the_inference_bench_times_constrained_next_to_free_decoding(tiny_model):
    from gyre_inference.bench import InferenceBenchConfig, _constrained_vs_free

    config = InferenceBenchConfig(clients=4, max_tokens=6, repeats=1, http=False)
    rates = _constrained_vs_free(tiny_model, [5, 6, 7, 8], config)
    assert len(rates) == 3 and all(row.rate > 0 and cpu > 0 for row, cpu in rates)
