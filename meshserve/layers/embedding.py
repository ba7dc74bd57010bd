"""Vocabulary-parallel embedding and LM head: each TP rank owns a contiguous slice of the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.distributed.parallel_state import get_parallel_state
from meshserve.layers.cpu_gemm import PACKED_MIN_ROWS_LM_HEAD, PrepackedMatmul
from meshserve.layers.quantization.matmul import QuantizedMatmul
from meshserve.layers.weight_loader import Loaded, set_weight_loader, store_rows


class VocabParallelEmbedding(nn.Module):
    quant: QuantizedMatmul | None = None  # the table as quantized blocks (quantization/assemble.py)

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        ps = get_parallel_state()
        self.tp_rank, self.tp_size = ps.tp_rank, ps.tp_size
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp_size)  # padded so every rank has the same rows
        self.start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        rows = max(0, min(self.per_rank, self.vocab_size - self.start))
        store_rows(param, loaded.narrow(0, self.start, rows))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:  # a quantized table: the rows asked for, dequantized
            return self.quant.rows(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        y = self.lookup(local.masked_fill(outside, 0))
        y.masked_fill_(outside.unsqueeze(-1), 0.0)
        return get_parallel_state().all_reduce(y)


class ParallelLMHead(PrepackedMatmul, VocabParallelEmbedding):
    """Logits for the rows given; each rank computes its vocabulary slice, then one all-gather."""

    packed_min_rows = PACKED_MIN_ROWS_LM_HEAD
    rows_are_sequences = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden)
        if self.tp_size > 1:
            logits = get_parallel_state().all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax(forward(hidden), -1) where the CPU panels take it without the logits (one rank
        only: the vocab-parallel head gathers logits across ranks); None elsewhere."""
        return self.argmax(hidden, self.vocab_size) if self.tp_size == 1 else None
