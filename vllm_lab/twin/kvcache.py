"""The paged KV cache: a pool of fixed-size blocks, with prefix caching on full prompt blocks.

Blocks are counted, not numbered: a request holds ``anon`` plain blocks and a list of hashed
(cacheable) blocks. A hashed block whose last holder finishes stays cached and joins an LRU list
of evictable blocks; allocation takes never-cached free blocks first, then evicts the least
recently freed cached block (vLLM's free queue mixes both; this keeps cached blocks a little
longer, a small optimism about hit rates).
"""

from __future__ import annotations

from collections import OrderedDict


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (each hash covers the whole prefix)."""
    out: list[int] = []
    prev = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[start:start + block_size])))
        out.append(prev)
    return out


class KVCache:
    """Block accounting with reference-counted cached blocks and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.anon_used = 0
        self.refs: dict[int, int] = {}          # hash -> holders; every entry occupies a block
        self.lru: OrderedDict[int, None] = OrderedDict()   # cached blocks nobody holds
        # Holds of a cached block beyond its first (a block three requests share counts two): the
        # KV reads a step repeats of what another running request reads too (a shared system
        # prompt), which the GPU's L2 cache serves (twin/steptime.py).
        self.extra_holds = 0

    # -- accounting --------------------------------------------------------------------------
    @property
    def num_free_uncached(self) -> int:
        """Blocks holding nothing."""
        return self.num_blocks - self.anon_used - len(self.refs)

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (free plus evictable cached ones), as vLLM counts free."""
        return self.num_free_uncached + len(self.lru)

    @property
    def shared_tokens(self) -> int:
        """KV tokens a step reads again of blocks another running request holds too."""
        return self.extra_holds * self.block_size

    @property
    def num_used(self) -> int:
        """Blocks held by requests."""
        return self.anon_used + len(self.refs) - len(self.lru)

    @property
    def usage(self) -> float:
        """Share of blocks in use, vLLM's kv_cache_usage_perc."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    # -- allocation --------------------------------------------------------------------------
    def take(self, n: int) -> bool:
        """Allocate ``n`` plain blocks, evicting cached ones if needed; False when too few."""
        if n <= 0:
            return True
        free = self.num_free_uncached
        if n > free + len(self.lru):
            return False
        for _ in range(n - free if n > free else 0):
            h, _none = self.lru.popitem(last=False)
            del self.refs[h]
        self.anon_used += n
        return True

    def release(self, anon: int, hashed: list[int]) -> None:
        """Give back a request's blocks; hashed ones stay cached, the tail evicted first."""
        self.anon_used -= anon
        for h in reversed(hashed):
            left = self.refs[h] - 1
            self.refs[h] = left
            if left:
                self.extra_holds -= 1
            else:
                self.lru[h] = None

    # -- prefix caching ----------------------------------------------------------------------
    def lookup(self, hashes: list[int], max_blocks: int) -> tuple[int, int]:
        """Leading blocks of ``hashes`` that are cached, and how many of them are evictable."""
        hits = evictable = 0
        refs = self.refs
        for h in hashes[:max_blocks]:
            ref = refs.get(h)
            if ref is None:
                break
            hits += 1
            if ref == 0:
                evictable += 1
        return hits, evictable

    def acquire(self, hashes: list[int]) -> None:
        """Hold cached blocks found by ``lookup``."""
        for h in hashes:
            ref = self.refs[h]
            if ref == 0:
                del self.lru[h]
            else:
                self.extra_holds += 1
            self.refs[h] = ref + 1

    def promote(self, h: int) -> bool:
        """Turn one of a request's plain blocks into the cached block ``h``; False if already cached."""
        if h in self.refs:
            return False
        self.anon_used -= 1
        self.refs[h] = 1
        return True

    def reset(self) -> bool:
        """Drop every cached block; False (and nothing dropped) while any block is in use, as vLLM."""
        if self.num_used:
            return False
        self.refs.clear()
        self.lru.clear()
        return True


class HostTier:
    """vLLM's KV offloading to host memory (--kv-offloading-size, the native connector): every
    full prompt block a request computes is stored in host memory too, an LRU of ``capacity``
    blocks; a prompt whose next blocks miss the GPU's cache but are held here loads them over the
    host link instead of computing them."""

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self.lru: OrderedDict[int, None] = OrderedDict()

    def store(self, h: int) -> None:
        """Keep block ``h`` (the most recently used); the least recently used goes when full."""
        if not self.capacity:
            return
        self.lru[h] = None
        self.lru.move_to_end(h)
        if len(self.lru) > self.capacity:
            self.lru.popitem(last=False)

    def lookup(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` held here, each made the most recently used."""
        n = 0
        for h in hashes:
            if h not in self.lru:
                break
            self.lru.move_to_end(h)
            n += 1
        return n
