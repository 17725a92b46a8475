"""Tensor parallelism beyond attention, as Megatron-LM runs it and the cost model prices it
(cost_models.params: the vocabulary and the dense FFNs split by tp; cost_models.pipeline:
embedding_cost's reduce-scatter, head_cost's all-gather; cost_models.layer_graph._dense_ffn).
Between these regions every rank holds its sequence shard (Megatron-LM's sequence
parallelism), as around TP attention (runtime.parallel.attention):

- the embedding and the LM head split by vocabulary rows over the tp group (runtime.loss.
  VocabShard). The embedding looks every token of the micro-batch up in its rows (the token
  ids gathered along the sequence), zeros the tokens outside them, and reduce-scatters the
  partial sums back to its shard. The head's input is gathered along the sequence and the
  loss runs over the vocabulary shards (runtime.loss.sharded_cross_entropy);
- the dense FFNs: w1 and w3 column parallel, w2 row parallel, the sequence gathered before and
  the partial sums reduce-scattered after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plans import MeshAxis
from runtime.loss import VocabShard
from runtime.model import Shard, Transformer
from runtime.parallel.comm import gather_sequence, scatter_sequence
from runtime.parallel.mesh import Mesh


class VocabShardedEmbedding(nn.Embedding):
    """nn.Embedding over this rank's rows of the vocabulary (``weight`` [V / n, h]), taking and
    returning this rank's sequence shard."""

    def __init__(self, vocab: VocabShard, hidden: int, device: torch.device):
        super().__init__(vocab.rows, hidden, device=device)
        self.vocab = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        every = gather_sequence(ids, self.vocab.group)
        local = every - self.vocab.first
        inside = (local >= 0) & (local < self.vocab.rows)
        rows = F.embedding(local.clamp(0, self.vocab.rows - 1), self.weight)
        return scatter_sequence(rows * inside[..., None].to(rows.dtype), self.vocab.group)


def _split_rows(linear: nn.Module, name: str, dim: int, i: int, n: int,
                shards: dict[str, Shard]) -> None:
    shard = Shard(dim, i, n)
    linear.weight = nn.Parameter(shard.take(linear.weight.detach()))
    shards[name] = shard


def apply_tensor_parallel_rest(model: Transformer, mesh: Mesh,
                               shards: dict[str, Shard]) -> VocabShard | None:
    """Split the vocabulary and the dense FFNs over the attention group (TP attention; None
    with one rank there). Returns this rank's vocabulary shard for the loss."""
    group, n, i = mesh.groups[MeshAxis.attn], mesh.size(MeshAxis.attn), mesh.index(MeshAxis.attn)
    if group is None:
        return None
    spec = model.cfg.spec  # the plan checks that tp divides the vocabulary and dense FFNs
    vocab = VocabShard(group, i, n, spec.vocab // n)
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabShardedEmbedding(vocab, spec.hidden,
                                                     model.tok_embeddings.weight.device)
        shards["tok_embeddings.weight"] = Shard(0, i, n)
    if model.output is not None:
        _split_rows(model.output, "output.weight", 0, i, n, shards)
        # the materialized loss's logits: every token of the micro-batch over this rank's rows
        model.output.register_forward_pre_hook(
            lambda _module, args: (gather_sequence(args[0], group),))
    model.tie_weights()  # a tied head (one stage) is the new embedding's weight again
    for lid, block in model.layers.items():
        ffn = block.feed_forward
        if ffn is None:
            continue
        for proj, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            _split_rows(getattr(ffn, proj), f"layers.{lid}.feed_forward.{proj}.weight", dim, i,
                        n, shards)
        ffn.register_forward_pre_hook(lambda _module, args: (gather_sequence(args[0], group),))
        ffn.register_forward_hook(lambda _module, _args, out: scatter_sequence(out, group))
    return vocab
