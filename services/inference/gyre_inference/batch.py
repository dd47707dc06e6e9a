"""The torch engine's running batch: batch rows, block tables, admission with prefix sharing, growth with
copy-on-write and preemption, and recording each step's samples (engine_loop.py turns them into token events).

Rows. Every running sequence holds a row of the decode step's buffers (step_buffers.StepBuffers) from its
admission to its end; a new sequence takes the lowest free row, so live rows stay packed and a step runs
on the smallest bucket covering the highest live row. Admission and retirement only write rows of those
buffers: nothing is recaptured, no cache is copied.

Blocks. A sequence's block table covers positions [0, computed]; before each step every live row gets the
block its next position falls in. Out of blocks, the most recently admitted row of the lowest priority (the
highest `priority` value) is preempted: its blocks are released (they stay in the prefix cache, keyed) and it
goes back to the queue at the place it first got (waiting_queue.py), with the tokens it generated;
readmitted, its prompt plus those tokens are prefilled again (recompute, mostly prefix-cache hits) and it
continues where it was, with the same random stream (the uniform of its n-th token is a function of its
seed and n). Admission waits while the pool cannot hold a sequence's prompt
plus one block for every live row (so admitting never forces an immediate preemption).

Prefix sharing (kv_cache.BlockPool). At admission a prompt's full blocks are looked up under keys salted
with the weights version and adapter that would compute them; hits are shared, not computed. Sequences of
one admission with the same tokens and salt (a group's n rollouts) are computed once: the followers share
every block of the first, the partial last block included, and sample their first token from its logits
with their own random streams; the first write into a shared block copies it (copy-on-write). Full blocks
are registered as they are completed, in prefill and in decode (a multi-turn history reuses the blocks of
the turns before), while the sequence's salt is still current.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from gyre_inference.backend import SamplingParams
from gyre_inference.kv_cache import NULL_BLOCK, BlockPool, OutOfBlocksError
from gyre_inference.model_runner import LaunchedStep, ModelRunner, Variant
from gyre_inference.paged_attention import PrefillLayout
from gyre_inference.prompt_logprobs import prompt_logprobs
from gyre_inference.sampling import TOP_LOGPROBS, allowed_bitmask, bias_entries, sample, uniforms
from gyre_inference.step_buffers import (  # the step buffers' rows
    CARRY,
    CONTEXT,
    IDS,
    MIN_P,
    POSITIONS,
    SLOTS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    UNIFORM,
)  # fmt: skip

_order = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    seed: int  # of its random stream: the uniform of its n-th token is uniforms(seed, n)
    adapter: int = 0  # its named adapter's slot (gyre_inference.adapters; 0 = the served model itself)
    tokens: list[int] = field(default_factory=list)  # generated so far
    blocks: list[int] = field(default_factory=list)  # block table
    computed: int = 0  # positions whose key/value are in the cache
    keys: list[int] = field(default_factory=list)  # prefix keys of its leading full blocks
    salt: object = None  # the cache salt its blocks were computed under
    row: int = -1
    admitted: int = 0  # admission order (the newest of the lowest priority is preempted first)
    place: tuple[int, int] | None = None  # (priority, arrival) in the waiting queue, kept when sent back
    # SamplingParams.prompt_logprobs: computed by the prefill, handed out on the first token's event
    prompt_logprobs: tuple | None = None
    prompt_scored: bool = False  # they were computed (a preempted sequence's recompute does not repeat them)
    finished: bool = False  # its last token has been emitted
    cancelled: bool = False  # set by the asyncio side; the engine drops the row before its next step
    queued: bool = False  # in the engine's waiting queue (waiting_queue.py)
    held: list = field(default_factory=list)  # a final-only sequence's events, handed over when it ends
    allowed: np.ndarray | None = None  # its allowed_token_ids as bitmask words (made once, at its first step)
    bias_now: list | None = None  # the sparse biases its row holds (set_bias skips an unchanged row)

    @property
    def constraint(self):
        return self.params.constraint

    @property
    def filtered(self) -> bool:
        p = self.params
        return p.temperature > 0 and (p.top_p < 1 or p.top_k > 0 or p.min_p > 0)

    @property
    def suppressing_stops(self) -> bool:
        return len(self.tokens) < self.params.min_tokens and bool(self.params.stop_token_ids)

    @property
    def penalised(self) -> bool:
        return self.params.penalised

    @property
    def biased(self) -> bool:
        return bool(self.params.logit_bias) or self.suppressing_stops or bool(self.params.bad_word_ids)

    @property
    def masked(self) -> bool:
        """Its row has a token bitmask: a structured output's, or its allowed_token_ids."""
        return self.constraint is not None or self.params.allowed_token_ids is not None

    @property
    def watches_words(self) -> bool:
        """A bad word of several tokens: its biases follow its last tokens, which the host must know each step."""
        return any(len(word) > 1 for word in self.params.bad_word_ids)

    def bias_entries(self) -> list[tuple[int, float]]:
        p = self.params
        return bias_entries(p.logit_bias, p.stop_token_ids, self.suppressing_stops, p.bad_word_ids, self.tokens)

    def fill_mask(self, host: torch.Tensor, words: np.ndarray, row: int, vocab: int) -> None:
        """Write the tokens it may sample next into row `row` of a bitmask (`host`, and `words` its numpy view): its
        grammar's, and of those only its allowed_token_ids (both are vLLM's masks, applied together)."""
        if self.params.allowed_token_ids is not None and self.allowed is None:
            self.allowed = allowed_bitmask(self.params.allowed_token_ids, vocab)
        if self.constraint is None:
            words[row] = self.allowed if self.allowed is not None else -1
            return
        words[row] = 0
        self.constraint.fill_next_token_bitmask(host, row)
        if self.allowed is not None:
            words[row] &= self.allowed


class Batch:
    """The rows, blocks and per-step inputs of the torch engine (engine thread only)."""

    def __init__(self, runner: ModelRunner, pool: BlockPool, *, prefix_caching: bool, max_prefill_tokens: int):
        self.runner, self.pool, self.inputs = runner, pool, runner.inputs
        self.block_size = pool.block_size
        self.prefix_caching, self.max_prefill_tokens = prefix_caching, max_prefill_tokens
        self.rows: list[Sequence | None] = [None] * runner.rows
        self.seeds = np.zeros(runner.rows, dtype=np.uint64)
        self.counters = np.zeros(runner.rows, dtype=np.int64)
        self.salts: dict[int, object] = {}  # adapter slot -> the salt of blocks computed now
        self.epoch = 0  # bumped by a weight swap of the model (every salt changes)
        self.preempted = 0  # sequences preempted so far (tests, benchmarks)
        self.copied = 0  # blocks copied on write

    # ---- membership ----------------------------------------------------------------------------
    @property
    def live(self) -> list[Sequence]:
        return [seq for seq in self.rows if seq is not None]

    def salt(self, adapter: int, cache_salt: str | None = None) -> object:
        """What a block's key is salted with: the weights that computed it, and the request's cache_salt (vLLM's)."""
        return (self.epoch, adapter, self.salts.get(adapter, 0), cache_salt)

    def new_weights(self, adapter: int | None = None) -> None:
        """A swap: blocks computed from now on differ from the cached ones (adapter None = the model's)."""
        if adapter is None:
            self.epoch += 1
            self.pool.clear_keys()
        else:
            self.salts[adapter] = self.salts.get(adapter, 0) + 1

    def free(self, done) -> None:
        """Retire the rows whose sequence `done(seq)` says is over: release their blocks and row."""
        for row, seq in enumerate(self.rows):
            if seq is not None and done(seq):
                self._vacate(row)

    def reset(self) -> None:
        for row, seq in enumerate(self.rows):
            if seq is not None:
                self._vacate(row)
        self.pool.clear_keys()  # a failed step may have registered blocks it never computed

    def _vacate(self, row: int) -> None:
        seq = self.rows[row]
        self.pool.release(seq.blocks)
        seq.blocks, seq.keys, seq.computed, seq.row = [], [], 0, -1
        self.rows[row] = None
        ints, floats = self.inputs.ints_np, self.inputs.floats_np
        ints[:, row] = 0
        ints[CONTEXT, row] = 1  # reads one key of the null block
        floats[:, row] = 0.0
        self.inputs.set_block(row, 0, NULL_BLOCK)
        if seq.biased:
            self.inputs.set_bias(row, [])
        if self.inputs.penalties is not None:
            self.inputs.penalties.vacate(row)

    # ---- admission ------------------------------------------------------------------------------
    def plan_prefill(self, candidates: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Give rows and blocks to the candidates that fit, in order: (admitted, back to the queue)."""
        admitted, owners, budget = [], {}, self.max_prefill_tokens
        free_rows = [row for row, seq in enumerate(self.rows) if seq is None]
        reserve = len(self.live)  # one block per live row for its next step
        for index, seq in enumerate(candidates):
            if not free_rows:
                return admitted, candidates[index:]
            tokens = seq.prompt + seq.tokens
            seq.salt = self.salt(seq.adapter, seq.params.cache_salt)
            group = (tuple(tokens), seq.salt)
            owner = owners.get(group) if self._shareable(seq) else None
            if owner is not None:  # a group's rollout: every block of the first, nothing to compute
                for block in owner.blocks:
                    self.pool.share(block)
                seq.blocks, seq.keys, seq.computed = list(owner.blocks), list(owner.keys), len(tokens)
            else:
                hits = self._cached_prefix(seq, tokens)
                fresh = -(-len(tokens) // self.block_size) - len(hits)
                needed = fresh + sum(1 for _, block in hits if self.pool.refs[block] == 0)
                new_tokens = len(tokens) - len(hits) * self.block_size
                if needed > self.pool.free_blocks - reserve or (admitted and new_tokens > budget):
                    return admitted, candidates[index:]
                budget -= new_tokens
                for _, block in hits:
                    self.pool.share(block)
                seq.blocks = [block for _, block in hits] + [self.pool.allocate() for _ in range(fresh)]
                seq.keys = [key for key, _ in hits]
                seq.computed = len(hits) * self.block_size
                self.pool.hits += len(hits)
                self._register_full_blocks(seq, tokens, len(tokens))
                if self._shareable(seq):
                    owners[group] = seq
            reserve += 1
            self._take_row(seq, free_rows.pop(0))
            admitted.append(seq)
        return admitted, []

    def _shareable(self, seq: Sequence) -> bool:
        return self.prefix_caching and seq.constraint is None and seq.params.prompt_logprobs is None

    def _cached_prefix(self, seq: Sequence, tokens: list[int]) -> list[tuple[int, int]]:
        """(key, block) of the leading full blocks cached; at least one token is left to compute (its logits)."""
        if not self._shareable(seq):
            return []
        hits, parent = [], None
        for index in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            key = self.pool.key(parent, seq.salt, chunk)
            block = self.pool.lookup(key, chunk)
            if block is None:
                break
            hits.append((key, block))
            parent = key
        return hits

    def _register_full_blocks(self, seq: Sequence, tokens: list[int], upto: int) -> None:
        """Key the sequence's full blocks below position `upto` (computed in this step or the one being run)."""
        if not self.prefix_caching or seq.salt != self.salt(seq.adapter, seq.params.cache_salt):
            return
        size = self.block_size
        while (len(seq.keys) + 1) * size <= upto:
            index = len(seq.keys)
            chunk = tuple(tokens[index * size : (index + 1) * size])
            key = self.pool.key(seq.keys[-1] if seq.keys else None, seq.salt, chunk)
            self.pool.register(seq.blocks[index], key, chunk)
            seq.keys.append(key)

    def _take_row(self, seq: Sequence, row: int) -> None:
        seq.row, seq.admitted = row, next(_order)
        self.rows[row] = seq
        p, ints, floats = seq.params, self.inputs.ints_np, self.inputs.floats_np
        floats[TEMPERATURE, row], floats[TOP_P, row] = p.temperature, p.top_p
        floats[MIN_P, row], ints[TOP_K, row] = p.min_p, p.top_k
        self.seeds[row] = seq.seed
        self.inputs.set_table(row, seq.blocks)
        seq.bias_now = None
        if seq.biased:
            self.set_bias(seq)
        if seq.penalised:
            self.inputs.penalty_rows().take(row, p, seq.prompt, seq.tokens)

    def set_bias(self, seq: Sequence) -> bool:
        """Write the row's sparse biases (True: the bias buffers grew, so graphs were dropped)."""
        entries = seq.bias_entries()
        if entries == seq.bias_now:
            return False
        seq.bias_now = entries
        grew = self.inputs.grow_bias(len(entries))
        if grew:
            self.runner.clear_graphs()
        self.inputs.set_bias(seq.row, entries)
        return grew

    # ---- prefill --------------------------------------------------------------------------------
    def prefill(self, seqs: list[Sequence]) -> tuple[np.ndarray, ...]:
        """Compute the admitted sequences' missing positions and sample each one's next token: (tokens,
        log-probs, top values, top ids) per sequence, as host arrays."""
        size = self.block_size
        computing = [seq for seq in seqs if seq.computed < len(seq.prompt) + len(seq.tokens)]
        ids, positions, slots, starts, counts, at, last, scored = [], [], [], [], [], [], {}, []
        for seq in computing:
            tokens = seq.prompt + seq.tokens
            span = range(seq.computed, len(tokens))
            if seq.params.prompt_logprobs is not None and not seq.prompt_scored:
                # not shareable, so no prefix hits: every position is computed here
                scored.append((seq, len(at)))
                at += range(len(ids), len(ids) + len(span) - 1)
            ids += tokens[seq.computed :]
            positions += span
            slots += [seq.blocks[p // size] * size + p % size for p in span]
            starts.append(seq.computed)
            counts.append(len(span))
            last[id(seq)] = len(at)
            at.append(len(ids) - 1)
            seq.computed = len(tokens)
        layout = PrefillLayout.build(starts, counts, [seq.blocks for seq in computing], size, self.runner.device)
        hidden = self.runner.prefill(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), layout,
                                     torch.tensor(at))  # fmt: skip
        head = self.runner.model.lm_head
        for seq, first in scored:  # from the same hidden states: no second pass over their prompts
            seq.prompt_logprobs = prompt_logprobs(hidden[first : first + len(seq.prompt) - 1], head, seq.prompt,
                                                  seq.params.prompt_logprobs)  # fmt: skip
            seq.prompt_scored = True
        owner_of = {(tuple(seq.blocks), seq.salt): last[id(seq)] for seq in computing}
        rows = [owner_of[(tuple(seq.blocks), seq.salt)] for seq in seqs]
        return self._sample_rows(seqs, head(hidden[torch.tensor(rows, device=hidden.device)]).float())

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[np.ndarray, ...]:
        """The eager sampler over the prefill's logits, with each sequence's own parameters and stream."""
        device = logits.device
        params = [seq.params for seq in seqs]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        u = uniforms(np.array([seq.seed for seq in seqs], dtype=np.uint64), np.array([len(s.tokens) for s in seqs]))
        kwargs = {}
        if any(seq.filtered for seq in seqs):
            kwargs.update(top_p=torch.tensor([p.top_p for p in params], device=device),
                          top_k=torch.tensor([p.top_k for p in params], device=device),
                          min_p=torch.tensor([p.min_p for p in params], device=device))  # fmt: skip
        entries = [seq.bias_entries() for seq in seqs]
        width = max(map(len, entries))
        if width:
            ids, values = torch.zeros(len(seqs), width, dtype=torch.long), torch.zeros(len(seqs), width)
            for row, row_entries in enumerate(entries):
                for column, (token, bias) in enumerate(row_entries):
                    ids[row, column], values[row, column] = token, bias
            kwargs.update(bias_ids=ids.to(device), bias_values=values.to(device))
        if any(seq.masked for seq in seqs):
            kwargs["bitmask"] = self._bitmask(seqs).to(device)
        if any(seq.penalised for seq in seqs):
            kwargs["penalties"] = self.inputs.penalty_rows().select(torch.tensor([seq.row for seq in seqs]))
        top_n = TOP_LOGPROBS if any(p.top_logprobs for p in params) else 0
        out = sample(logits, temperature, torch.from_numpy(u).to(device), top_n=top_n, **kwargs)
        return tuple(t.cpu().numpy() for t in out if t is not None)

    def _bitmask(self, seqs: list[Sequence]) -> torch.Tensor:
        vocab = self.runner.vocab
        mask = torch.full((len(seqs), (vocab + 31) // 32), -1, dtype=torch.int32)
        words = mask.numpy()
        for row, seq in enumerate(seqs):
            if seq.masked:
                seq.fill_mask(mask, words, row, vocab)
        return mask

    # ---- decode ---------------------------------------------------------------------------------
    def prepare_decode(self, step: list[Sequence] | None = None, carried: Collection[Sequence] = ()) -> list[Sequence]:
        """Give every row of the step (default: every live row) the block its next position falls in (copy-on-write,
        preemption), and fill the step's inputs; live rows outside the step get idle inputs (the overlapped loop:
        rows that are over but in the step in flight). Sequences in `carried` are in the step in flight: their
        next position is one further than their host state says, and their input token is that step's sample,
        taken on the device (CARRY). Returns the sequences preempted (back to the waiting queue)."""
        preempted, copies = [], []
        for seq in sorted(self.live if step is None else step, key=lambda s: s.row):
            if seq.row < 0:  # preempted meanwhile
                continue
            while True:
                try:
                    self._grow(seq, copies, seq.computed + (seq in carried))
                    break
                except OutOfBlocksError:
                    if carried:  # never preempt a row a launched step writes: the engine checks blocks_needed first
                        raise
                    victim = max(self.live, key=lambda s: (s.params.priority, s.admitted))
                    released = set(victim.blocks)
                    copies[:] = [(src, dst) for src, dst in copies if dst not in released]
                    self._vacate(victim.row)
                    preempted.append(victim)
                    self.preempted += 1
                    if victim is seq:
                        break
        if copies:
            self.runner.copy_blocks(copies)
            self.copied += len(copies)
        ints, size = self.inputs.ints_np, self.block_size
        stepping = None if step is None else set(step)
        for seq in self.live:
            row = seq.row
            if stepping is not None and seq not in stepping:
                ints[[IDS, POSITIONS, SLOTS, CARRY], row] = 0
                ints[CONTEXT, row] = 1  # as an idle row: one key of the null block, its write to the null block
                continue
            ahead = int(seq in carried)
            p = seq.computed + ahead
            ints[IDS, row] = (seq.tokens or seq.prompt)[-1]  # a carried row's is not read
            ints[CARRY, row] = ahead
            ints[POSITIONS, row] = p
            ints[SLOTS, row] = seq.blocks[p // size] * size + p % size
            ints[CONTEXT, row] = p + 1
            self.counters[row] = len(seq.tokens) + ahead
        return preempted

    def blocks_needed(self, step: list[Sequence], carried: Collection[Sequence]) -> int:
        """Free blocks `prepare_decode(step, carried)` takes: a row whose next position starts a block, or falls
        in a shared one (copy-on-write), needs one."""
        size, needed = self.block_size, 0
        for seq in step:
            index = (seq.computed + (seq in carried)) // size
            needed += index == len(seq.blocks) or self.pool.refs[seq.blocks[index]] > 1
        return needed

    def _grow(self, seq: Sequence, copies: list[tuple[int, int]], position: int) -> None:
        index = position // self.block_size
        if index == len(seq.blocks):
            seq.blocks.append(self.pool.allocate())
            self.inputs.set_block(seq.row, index, seq.blocks[index])
        elif self.pool.refs[seq.blocks[index]] > 1:  # shared: copy before writing
            new = self.pool.allocate()
            copies.append((seq.blocks[index], new))
            self.pool.release([seq.blocks[index]])
            seq.blocks[index] = new
            self.inputs.set_block(seq.row, index, new)

    def variant(self, live: list[Sequence]) -> Variant:
        return Variant(
            filtered=any(seq.filtered for seq in live),
            masked=any(seq.masked for seq in live),
            top_n=TOP_LOGPROBS if any(seq.params.top_logprobs for seq in live) else 0,
            bias_width=self.inputs.bias_width if any(seq.biased for seq in live) else 0,
            penalised=any(seq.penalised for seq in live),
        )

    def _step_inputs(self, step: list[Sequence]) -> tuple[int, int, Variant]:
        """The last inputs of a prepared step (uniforms, the bitmask): its (bucket, width, sampler variant)."""
        rows = self.runner.bucket(max(seq.row for seq in step) + 1)
        variant = self.variant(step)
        if variant.masked:
            self.inputs.bitmask_np[:rows] = -1
            for seq in step:
                if seq.masked:
                    seq.fill_mask(self.inputs.bitmask_host, self.inputs.bitmask_np, seq.row, self.runner.vocab)
        self.inputs.floats_np[UNIFORM, :rows] = uniforms(self.seeds[:rows], self.counters[:rows])
        return rows, self.runner.width(int(self.inputs.ints_np[CONTEXT, :rows].max())), variant

    def decode(self) -> tuple[list[Sequence], tuple[np.ndarray, ...]]:
        """One decode step for every live row, waited for: (the rows' sequences, their samples indexed by row)."""
        live = self.live
        return live, self.runner.decode(*self._step_inputs(live))

    def launch(self, step: list[Sequence]) -> LaunchedStep:
        """Enqueue one decode step for the rows of `step` (prepared), without waiting for it (the overlapped loop);
        `runner.collect` gives its samples, indexed by row."""
        return self.runner.launch(*self._step_inputs(step))

    def advance(self, seq: Sequence, token: int, *, computed: bool) -> None:
        """A step sampled `token` for `seq`; a decode step (`computed`) also computed its position `computed`."""
        seq.tokens.append(token)
        if seq.penalised and seq.row >= 0:
            self.inputs.penalties.count(seq.row, token)
        if computed:
            seq.computed += 1
            if seq.computed % self.block_size == 0:
                self._register_full_blocks(seq, seq.prompt + seq.tokens, seq.computed)
        boundary = seq.params.min_tokens and len(seq.tokens) == seq.params.min_tokens  # stop ids allowed from now on
        if (boundary or seq.watches_words) and seq.row >= 0:  # a bad word's last token is banned after its others
            self.set_bias(seq)
