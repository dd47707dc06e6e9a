"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, and an LRU prefix cache.

The cache itself is one tensor per layer for keys and one for values, `[num_blocks, block_size,
kv_heads, head_dim]` (model_runner.py); a sequence owns a list of block ids (its block table) and its
token at position p lives in slot `p % block_size` of block `table[p // block_size]`. Block 0 is never
handed out: idle batch rows read and write there, so a CUDA graph's fixed batch needs no branches.

Prefix sharing. A block whose `block_size` tokens are all computed is registered under a key that
chains its parent's key, its tokens and a salt (the weights version and adapter that computed it, see
`TorchBackend`), so a later sequence starting with the same tokens under the same weights reuses the
block instead of computing it (a group's n rollouts, a multi-turn episode's growing history). Shared
blocks are reference-counted; a block written while shared is copied first (copy-on-write, done by the
caller). A released block keeps its content and its key on the free list until it is reused, least
recently released first; `clear_keys` (a weight swap) forgets every key at once.

Allocation order: a released block holding no cached prefix first, then a block never used yet, then the
least recently released cached block (its key is forgotten): cached prefixes survive as long as the pool
allows. Blocks never used are zeroed when first handed out (`on_fresh`; on CPU the pool is not touched at
load, so only what is used is ever mapped): attention masks unwritten slots, but a NaN there would still
poison a product with a zero weight.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

NULL_BLOCK = 0


class OutOfBlocksError(RuntimeError):
    """No free block: the caller waits or preempts."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, on_fresh: Callable[[int], None] | None = None):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks, self.block_size, self._on_fresh = num_blocks, block_size, on_fresh
        self.refs = [0] * num_blocks
        self._fresh = 1  # blocks >= this one were never handed out
        self._plain: OrderedDict[int, None] = OrderedDict()  # released blocks holding no cached prefix
        self._cached: OrderedDict[int, None] = OrderedDict()  # released cached blocks, least recently released first
        self._key_of: dict[int, int] = {}  # block -> its prefix key
        self._block_of: dict[int, int] = {}  # prefix key -> block
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # block -> its tokens (a key collision is checked)
        self.hits = 0  # blocks reused through the prefix cache (for benchmarks and tests)

    @property
    def free_blocks(self) -> int:
        return len(self._plain) + len(self._cached) + self.num_blocks - self._fresh

    def allocate(self) -> int:
        """A block for new content (reference count 1); its old prefix key, if any, is forgotten."""
        if self._plain:
            block, _ = self._plain.popitem(last=False)
        elif self._fresh < self.num_blocks:
            block = self._fresh
            self._fresh += 1
            if self._on_fresh is not None:
                self._on_fresh(block)
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            self._forget(block)
        else:
            raise OutOfBlocksError("no free KV cache block")
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of `block` (a cached block on the free list comes back into use)."""
        if self.refs[block] == 0:
            del self._cached[block]  # only a cached block is found again while free
        self.refs[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                (self._cached if block in self._key_of else self._plain)[block] = None

    # ---- prefix cache ---------------------------------------------------------------------------
    @staticmethod
    def key(parent: int | None, salt: object, tokens: tuple[int, ...]) -> int:
        return hash((parent, salt, tokens))

    def lookup(self, key: int, tokens: tuple[int, ...]) -> int | None:
        """The block cached under `key` holding exactly `tokens`, or None."""
        block = self._block_of.get(key)
        if block is None or self._tokens_of.get(block) != tokens:
            return None
        return block

    def register(self, block: int, key: int, tokens: tuple[int, ...]) -> None:
        """`block` now holds `tokens` (computed) under `key`; the first block registered under a key wins."""
        if key in self._block_of or block in self._key_of:
            return
        self._block_of[key], self._key_of[block], self._tokens_of[block] = block, key, tokens

    def clear_keys(self) -> None:
        """Forget every prefix key (a weight swap: no cached block may be reused by new sequences)."""
        self._block_of.clear()
        self._key_of.clear()
        self._tokens_of.clear()
        self._plain.update(self._cached)
        self._cached.clear()

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            del self._tokens_of[block]
