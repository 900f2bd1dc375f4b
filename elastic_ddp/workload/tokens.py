"""`--dataset tokens`: windows of a flat token file, memory-mapped, for language modelling.

The file is a flat array of token ids, little-endian uint16 (nanoGPT's `train.bin`; write one
with `numpy.array(ids, dtype="<u2").tofile(path)`, or bytes for a byte-level model). Sample `i` is
the window of `block_size` tokens at `i * block_size` as input, and the same window one token later
as target: the windows do not overlap, so the elastic sampler's exactly-once over sample indices is
exactly once over windows, whatever the world size. The file is mapped, not read: memory grows
with what is touched, and every rank of a machine shares the page cache.

The file's contents are untrusted: a token id at or above `vocab_size` raises ValueError naming the
file and the window when that window is read (the model's embedding would otherwise fail without
saying why). A file shorter than one window, or of an odd number of bytes, is refused when opened.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch
from torch.utils.data import Dataset

TOKEN_BYTES = 2  # uint16


class TokenWindows(Dataset):
    """Map-style: `(inputs, targets)`, each `block_size` int64 token ids (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, block_size: int, vocab_size: int):
        self.path, self.block_size, self.vocab_size = str(path), block_size, vocab_size
        try:
            size = os.path.getsize(self.path)
        except OSError as exc:
            raise ValueError(f"--token_file: cannot read {self.path}: {exc.strerror}") from None
        if size % TOKEN_BYTES or size // TOKEN_BYTES < block_size + 1:
            raise ValueError(f"--token_file: {self.path} holds {size} bytes; expected little-endian uint16 token ids "
                             f"(an even number of bytes), at least --block_size + 1 = {block_size + 1} of them")
        self.windows = (size // TOKEN_BYTES - 1) // block_size
        self._tokens: torch.Tensor | None = None  # mapped on first use: in each loader worker of its own

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.windows:
            raise IndexError(f"window {index} of {self.windows}")
        start = index * self.block_size
        window = self._mapped()[start:start + self.block_size + 1].to(torch.int64)
        if int(window.max()) >= self.vocab_size:
            raise ValueError(f"--token_file: {self.path} holds token id {int(window.max())} in window {index} "
                             f"(tokens {start}-{start + self.block_size}); expected ids below --vocab_size "
                             f"{self.vocab_size}")
        return window[:-1], window[1:]

    def collated(self, indices: list[int]) -> list[torch.Tensor]:
        """The windows `indices` as one batch, `[inputs, targets]` each `(len(indices), block_size)`:
        what the default collate makes of them one by one, from one gather and one check."""
        starts = np.asarray(indices, dtype=np.int64)
        if starts.size and not (0 <= starts.min() and starts.max() < self.windows):
            bad = starts[(starts < 0) | (starts >= self.windows)][0]
            raise IndexError(f"window {bad} of {self.windows}")
        starts *= self.block_size
        windows = self._mapped().numpy()[starts[:, None] + np.arange(self.block_size + 1)].astype(np.int64)
        if windows.size and int(windows.max()) >= self.vocab_size:
            row = int(np.argmax(windows.max(axis=1) >= self.vocab_size))
            self[indices[row]]  # raises the ValueError that names the window
        batch = torch.from_numpy(windows)
        return [batch[:, :-1].contiguous(), batch[:, 1:].contiguous()]

    def _mapped(self) -> torch.Tensor:
        if self._tokens is None:
            with open(self.path, "rb") as handle:
                # Copy-on-write: torch wants a writable buffer; nothing is ever written back to the file.
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            self._tokens = torch.frombuffer(mapped, dtype=torch.uint16)
        return self._tokens

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}  # a loader worker maps the file again
