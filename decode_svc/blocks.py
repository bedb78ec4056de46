"""The K/V block allocator: plain Python, no tensors.

Decode's full-attention K/V lives in one pool of fixed-size blocks allocated once at start
(``decode_svc.batch.DecodeBatch`` owns the tensors); a request holds a list of block ids, its block
table, and block ``i`` of the table holds its tokens ``i * block_size .. (i + 1) * block_size - 1``.
``BlockPool`` only hands ids out and takes them back: the scheduler decides who gets them.

Placement keeps a request's blocks in one run of consecutive ids where it can, because attention
then reads the request's K/V as one view of the pool (no copy; ``DecodeBatch.attend``): a request
that grows takes the block right after its last one when that is free, and a new request goes
into the largest free run, at its start when nothing before it can grow into it, else halfway
along, leaving the request before it room to grow. A table that cannot stay in one run (a pool
too full or too fragmented) is still valid: attention then joins its runs, a copy for that
request only.
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
        self._used = bytearray(num_blocks)  # 1: handed out
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-max(0, num_tokens) // self.block_size)

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """``count`` free blocks. ``after``: the last block of the table they extend; the blocks
        right after it are taken first, so the table stays one run where it can."""
        if count > self._num_free:
            raise NoFreeBlocks(f"asked for {count} K/V blocks, {self._num_free} of {self.num_blocks} are free")
        blocks: list[int] = []
        if after is not None:
            block = after + 1
            while len(blocks) < count and block < self.num_blocks and not self._used[block]:
                self._used[block] = 1
                blocks.append(block)
                block += 1
        while len(blocks) < count:
            start, stop = self._largest_free_run()
            need = count - len(blocks)
            if stop - start > need and start > 0:
                start += (stop - start - need) // 2  # room for the request before it to grow
            for block in range(start, min(stop, start + need)):
                self._used[block] = 1
                blocks.append(block)
        self._num_free -= len(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if not self._used[block]:
                raise ValueError(f"K/V block {block} freed twice")
            self._used[block] = 0
        self._num_free += len(blocks)
        blocks.clear()

    def runs(self) -> list[tuple[int, int]]:
        """The free runs ``(start, stop)``, in id order."""
        used, runs = self._used, []
        start = used.find(0)
        while start != -1:
            stop = used.find(1, start)
            stop = self.num_blocks if stop == -1 else stop
            runs.append((start, stop))
            start = used.find(0, stop)
        return runs

    def _largest_free_run(self) -> tuple[int, int]:
        return max(self.runs(), key=lambda run: run[1] - run[0])
