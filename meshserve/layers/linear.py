"""Linear layers that shard themselves across tensor-parallel ranks at load time (Megatron style).

Each parameter carries a `weight_loader(param, full_tensor, shard_id=None)` (layers/weight_loader.py)
that copies this rank's slice of the full checkpoint tensor, so checkpoints are read whole and never
pre-split.
"""
from __future__ import annotations

import torch
from torch import nn

from meshserve.distributed.parallel_state import get_parallel_state
from meshserve.layers.cpu_gemm import PrepackedMatmul
from meshserve.layers.quantization.blocks import QuantizedWeight, check_block_split
from meshserve.layers.weight_loader import Loaded, plain_loader, set_weight_loader, store_rows


class ColumnParallelLinear(PrepackedMatmul, nn.Module):
    """y = x W^T with W's output rows split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        ps = get_parallel_state()
        self.tp_rank, self.tp_size = ps.tp_rank, ps.tp_size
        if out_features % self.tp_size:
            raise ValueError(f"output size {out_features} is not divisible by tensor_parallel_size {self.tp_size}")
        self.out_per_rank = out_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        n = param.shape[0]
        store_rows(param, loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int = 0) -> None:
        size = self.out_sizes[shard_id] // self.tp_size
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        store_rows(param, loaded.narrow(0, self.tp_rank * size, size), offset)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. Query heads split across ranks; KV heads split too, or
    replicated when there are fewer KV heads than ranks (each rank then holds one KV head)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        ps = get_parallel_state()
        tp = ps.tp_size
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)  # ranks sharing one KV head
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str = "q") -> None:
        hd = self.head_dim
        q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (self.tp_rank // self.kv_replicas) * kv_size
        store_rows(param, loaded.narrow(0, start, size), offset)


class RowParallelLinear(PrepackedMatmul, nn.Module):
    """y = x W^T with W's input columns split across ranks; one all-reduce sums the partial outputs.
    `reduce_results=False` returns the partial sum, for a caller that adds more partials first
    (an MoE block reduces its shared expert together with the routed experts)."""

    bias_in_matmul = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        ps = get_parallel_state()
        self.tp_rank, self.tp_size = ps.tp_rank, ps.tp_size
        self.reduce_results = reduce_results
        if bias and not reduce_results:
            raise ValueError("a row-parallel bias is added after the reduction, so it needs reduce_results=True")
        if in_features % self.tp_size:
            raise ValueError(f"input size {in_features} is not divisible by tensor_parallel_size {self.tp_size}")
        self.in_per_rank = in_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:  # added once, after the reduction
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_weight_loader(self.bias, plain_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        n = param.shape[1]
        if isinstance(loaded, QuantizedWeight):  # each rank's columns must be whole blocks
            check_block_split(f"{loaded.shape[0]}x{loaded.shape[1]} row-parallel weight", loaded.shape[1],
                              self.tp_size, loaded.block_type)
        store_rows(param, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if not self.reduce_results:
            return y
        y = get_parallel_state().all_reduce(y)
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(PrepackedMatmul, nn.Module):
    """y = x W^T with the whole W on every rank: for small projections whose full output every rank
    needs (an MoE router, a shared expert's gate)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        set_weight_loader(self.weight, plain_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)
