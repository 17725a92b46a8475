"""Training data: deterministic per step, so a resumed run sees the same batches.

Every rank builds the step's global batch [global_batch, seq_len + 1] and keeps its part:
micro-batch j of data replica d holds sequences (j x dp + d) x mbs ... + mbs, and attention
rank a keeps sequence shard a of each.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from plans import MeshAxis, Plan, SpecError
from plans.layout import tokens_per_rank
from plans.run_options import TokenDtype
from runtime.parallel.mesh import Mesh
from runtime.parallel.pipeline import MicroBatch

NUMPY_DTYPE = {TokenDtype.u16: np.uint16, TokenDtype.u32: np.uint32}


class TokenSource(Protocol):
    def batch(self, step: int) -> torch.Tensor:
        """[global_batch, seq_len + 1] int64 tokens of ``step``."""
        ...


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class SyntheticTokens:
    """Learnable synthetic text: each sequence is an arithmetic progression modulo the
    vocabulary with a random start and stride."""

    def __init__(self, global_batch: int, seq_len: int, vocab: int, seed: int):
        self.shape = (global_batch, seq_len + 1)
        self.vocab, self.seed = vocab, seed

    def batch(self, step: int) -> torch.Tensor:
        g = _generator(self.seed, step)
        start = torch.randint(0, self.vocab, (self.shape[0], 1), generator=g)
        stride = torch.randint(1, 8, (self.shape[0], 1), generator=g)
        return (start + stride * torch.arange(self.shape[1])) % self.vocab


SCAN_TOKENS = 1 << 24
"""Tokens read per chunk when checking a token file's ids (64 MiB of uint32)."""


def check_token_file(path: Path, dtype: type, vocab: int, window: int) -> int:
    """Refuse a token file no step could read correctly; returns its token count. A regular,
    non-empty file of whole tokens, at least one window (seq_len + 1) long, every id below the
    vocabulary (an id out of range would index past the embedding, or on CPU train on garbage)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SpecError(f"--data: {path}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise SpecError(f"--data: {path} is not a regular file")
    width = np.dtype(dtype).itemsize
    if st.st_size == 0:
        raise SpecError(f"--data: {path} is empty")
    if st.st_size % width:
        raise SpecError(f"--data: {path} has {st.st_size} bytes, not a whole number of "
                        f"{width}-byte {np.dtype(dtype).name} tokens")
    count = st.st_size // width
    if count < window:
        raise SpecError(f"--data: {path} holds {count} tokens, fewer than seq_len + 1 ({window})")
    if vocab < np.iinfo(dtype).max + 1 or np.iinfo(dtype).min < 0:
        tokens = np.memmap(path, dtype=dtype, mode="r")
        for start in range(0, count, SCAN_TOKENS):
            chunk = tokens[start : start + SCAN_TOKENS]
            if int(chunk.max()) >= vocab or int(chunk.min()) < 0:
                at = start + int(np.argmax((chunk >= vocab) | (chunk < 0)))
                raise SpecError(f"--data: {path}: token {at} is id {int(tokens[at])}, outside "
                                f"the vocabulary (model.vocab = {vocab})")
    return count


class TokenFile:
    """Raw little-endian integer tokens (``dtype``, a numpy integer type); each sequence is a
    window at a position drawn from (seed, step). A Megatron indexed dataset's ``.bin`` is such
    a file: its documents back to back (runtime.indexed)."""

    def __init__(self, path: Path, dtype: type, global_batch: int, seq_len: int, seed: int,
                 vocab: int):
        self.global_batch, self.window, self.seed = global_batch, seq_len + 1, seed
        check_token_file(path, dtype, vocab, self.window)
        self.tokens = np.memmap(path, dtype=dtype, mode="r")

    def batch(self, step: int) -> torch.Tensor:
        g = _generator(self.seed, step)
        starts = torch.randint(0, len(self.tokens) - self.window + 1, (self.global_batch,),
                               generator=g)
        rows = [np.asarray(self.tokens[s : s + self.window], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))


def write_byte_corpus(text: str, path: Path) -> int:
    """Tokenise ``text`` as UTF-8 bytes (vocabulary 256) into a uint16 token file; returns the
    token count."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    data.tofile(path)
    return len(data)


def rank_micro_batches(
    batch: torch.Tensor, plan: Plan, mesh: Mesh, device: torch.device
) -> list[MicroBatch]:
    d, mbs = plan.degrees, plan.micro_batch_size
    a, dp = mesh.coord(MeshAxis.attn), mesh.coord(MeshAxis.dp)
    shard = int(tokens_per_rank(1, plan.training.seq_len, d.attention_group))
    # one host-to-device copy of the step's batch (a few hundred KiB), then views: a copy per
    # micro-batch from pageable memory would wait for the stream each time
    batch = batch.to(device)
    out = []
    for j in range(plan.num_micro_batches):
        first = (j * d.dp + dp) * mbs
        seqs = batch[first : first + mbs]
        inputs = seqs[:, :-1][:, a * shard : (a + 1) * shard]
        labels = seqs[:, 1:][:, a * shard : (a + 1) * shard]
        out.append(MicroBatch(inputs.contiguous(), labels.contiguous()))
    return out
