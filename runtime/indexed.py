"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read without Megatron.

The ``.idx`` file, as megatron.core.datasets.indexed_dataset's _IndexWriter writes it (all
little-endian): the header ``b"MMIDIDX\\x00\\x00"``, the version (uint64, 1), the token dtype
code (uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the
sequence count S and the document count D (uint64 each), then S sequence lengths (int32, in
tokens), S sequence pointers (int64, byte offsets into ``.bin``) and D document indices
(int64: the first sequence of each document, then S), and for multimodal datasets S sequence
modes (int8). The ``.bin`` file holds the sequences' tokens back to back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plans import SpecError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                           6: np.float64, 7: np.float32, 8: np.uint16}
"""Megatron's DType codes (megatron.core.datasets.indexed_dataset.DType)."""


def indexed_prefix(path: Path) -> Path | None:
    """The dataset prefix ``path`` names: PREFIX.bin, PREFIX.idx, or PREFIX itself when
    PREFIX.idx exists; None for anything else (a raw token file)."""
    if path.suffix in (".bin", ".idx"):
        return path.with_suffix("")
    if Path(f"{path}.idx").exists():
        return path
    return None


@dataclass(frozen=True)
class IndexedDataset:
    bin: Path
    dtype: type
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.sequence_lengths.sum())


def read_index(prefix: Path, what: str = "--data") -> IndexedDataset:
    """The index of the dataset at ``prefix``, checked against its ``.bin`` (contiguous
    sequences filling it exactly); SpecError naming the file and the problem."""
    idx, binary = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for f in (idx, binary):
        if not f.is_file():
            raise SpecError(f"{what}: {f} is missing (an indexed dataset is PREFIX.bin + "
                            "PREFIX.idx)")
    raw = idx.read_bytes()
    fixed = len(HEADER) + 8 + 1 + 8 + 8
    if len(raw) < fixed or raw[:len(HEADER)] != HEADER:
        raise SpecError(f"{what}: {idx} is not a Megatron index (no MMIDIDX header)")
    at = len(HEADER)
    version, code, sequences, documents = struct.unpack_from("<QBQQ", raw, at)
    if version != VERSION:
        raise SpecError(f"{what}: {idx} is index version {version}; version {VERSION} is read")
    dtype = DTYPES.get(code)
    if dtype is None or not np.issubdtype(dtype, np.integer):
        raise SpecError(f"{what}: {idx} holds dtype code {code}, not integer token ids")
    at = fixed
    need = at + 4 * sequences + 8 * sequences + 8 * documents
    if len(raw) < need:
        raise SpecError(f"{what}: {idx} is truncated ({len(raw)} bytes, its counts need {need})")
    lengths = np.frombuffer(raw, np.int32, sequences, at)
    pointers = np.frombuffer(raw, np.int64, sequences, at + 4 * sequences)
    docs = np.frombuffer(raw, np.int64, documents, at + 12 * sequences)
    width = np.dtype(dtype).itemsize
    expected = np.concatenate(([0], np.cumsum(lengths.astype(np.int64))[:-1])) * width
    if sequences and (lengths.min() < 0 or not np.array_equal(pointers, expected)):
        raise SpecError(f"{what}: {idx}: the sequence pointers are not its sequences back to "
                        "back")
    if documents and (docs[0] != 0 or docs[-1] != sequences or np.any(np.diff(docs) < 0)):
        raise SpecError(f"{what}: {idx}: the document indices do not run from 0 to the "
                        f"sequence count ({sequences})")
    size = binary.stat().st_size
    if size != int(lengths.sum()) * width:
        raise SpecError(f"{what}: {binary} has {size} bytes, its index describes "
                        f"{int(lengths.sum()) * width}")
    return IndexedDataset(binary, dtype, lengths, pointers, docs)
