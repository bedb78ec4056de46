"""The K/V block allocator: plain Python, no tensors.

Decode's full-attention K/V lives in one pool of fixed-size blocks allocated once at start
(``decode_svc.batch.DecodeBatch`` owns the tensors); a request holds a list of block ids, its block
table, and block ``i`` of the table holds its tokens ``i * block_size .. (i + 1) * block_size - 1``.
``BlockPool`` only hands ids out and takes them back: the scheduler decides who gets them.
"""

from __future__ import annotations


class NoFreeBlocks(RuntimeError):
    """Asked for more blocks than the pool has free."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs at least one block of at least one token, got "
                             f"{num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids go out first
        self._used = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-max(0, num_tokens) // self.block_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise NoFreeBlocks(f"asked for {count} K/V blocks, {len(self._free)} of {self.num_blocks} are free")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._used[block] = True
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if not self._used[block]:
                raise ValueError(f"K/V block {block} freed twice")
            self._used[block] = False
            self._free.append(block)
        blocks.clear()
