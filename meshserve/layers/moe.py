"""Sparse mixture-of-experts block: a router picks k of E experts per token, the chosen experts run as
grouped matmuls, and each token's k results are summed in a fixed order.

- **Routing** (as the Mixtral and Qwen-MoE families define it): softmax over all E router logits in
  float32, then the top k; renormalised to sum to 1 when the family does (Mixtral always, Qwen-MoE
  per `norm_topk_prob`).
- **Grouped matmuls.** The (token, expert) pairs are sorted by expert (a stable sort), so each
  expert's tokens are one contiguous block: one gate/up and one down matmul per expert that has
  tokens, never a loop over tokens.
- **Fixed reduction order.** Each token's k expert outputs are scaled by their router weights and
  added in ascending expert order (the order transformers' reference accumulates in), element-wise,
  so a token's sum never depends on which other tokens share the batch or on which rank ran the expert.
- **On CUDA** (with Triton) the grouping stays on the device and one grouped Triton matmul per
  projection runs every expert (layers/triton_moe.py): no token count is read on the host, so a
  decode step through it can be captured in a CUDA graph. Expert parallelism and quantized experts
  keep the loop below, and decode steps through them run eagerly (`graph_unsafe_reason`).
- **Sharding.** Without expert parallelism every TP rank holds a 1/TP slice of every expert's
  intermediate size (like a dense MLP) and one all-reduce at the end sums the partials. With it
  (EP = TP) each rank holds E/EP whole experts and the tokens travel to them
  (distributed/expert_parallel.py). A shared expert (Qwen2-MoE) stays TP-sliced either way, its
  sigmoid-gated partial reduced together with the routed output.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshserve.distributed import expert_parallel
from meshserve.distributed.expert_load import ExpertLoadRecorder
from meshserve.distributed.parallel_state import get_parallel_state
from meshserve.layers import fused
from meshserve.layers.activation import silu_and_mul
from meshserve.layers.linear import ReplicatedLinear
from meshserve.layers.quantization.blocks import QuantizedWeight, check_block_split
from meshserve.layers.quantization.matmul import QuantizedMatmul
from meshserve.layers.weight_loader import Loaded, set_weight_loader


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    renormalize: bool  # divide the top-k probabilities by their sum
    # Mixtral scales expert outputs by float32 weights (then casts the product); Qwen-MoE casts the
    # weights to the activation dtype first. Identical in float32, not in bf16.
    float32_weights: bool = False


def route(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from router logits [T, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): `order` lists the (token, slot) pairs, flattened as token * k + slot, grouped by
    expert (stable: within an expert, token order); counts[e] pairs go to expert e."""
    flat = ids.flatten()
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def weighted_sum(pair_out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 float32_weights: bool) -> torch.Tensor:
    """sum_j w[t, j] * out[t, j] for pair_out [T * k, H] in (token, slot) order, added in ascending
    expert order, one slot at a time."""
    t, k = ids.shape
    out = pair_out.view(t, k, pair_out.shape[-1])
    by_expert = ids.argsort(dim=1, stable=True)
    out = out.gather(1, by_expert[..., None].expand(-1, -1, out.shape[-1]))
    weights = weights.gather(1, by_expert)

    def term(j: int) -> torch.Tensor:
        if float32_weights:
            return (out[:, j].float() * weights[:, j, None]).to(out.dtype)
        return out[:, j] * weights[:, j, None].to(out.dtype)

    acc = term(0)
    for j in range(1, k):
        acc = acc + term(j)
    return acc


class GroupedExperts(nn.Module):
    """The SwiGLU experts of one layer held by this rank, stacked: w13 [experts, 2 x I, H] (gate rows,
    then up rows) and w2 [experts, H, I]. `first_expert` is the global id of local expert 0;
    `slice_rank` / `slices` cut each expert's intermediate size (TP without EP)."""

    def __init__(self, num_local: int, first_expert: int, hidden: int, intermediate: int, slice_rank: int = 0,
                 slices: int = 1):
        super().__init__()
        if intermediate % slices:
            raise ValueError(f"expert intermediate size {intermediate} is not divisible by tensor_parallel_size "
                             f"{slices}")
        self.num_local, self.first_expert = num_local, first_expert
        self.slice_rank, self.inter = slice_rank, intermediate // slices
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * self.inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, self.inter), requires_grad=False)
        self.hidden = hidden
        self.quantized_pieces: dict[tuple[int, str], QuantizedWeight] = {}
        self.quant: list[tuple[QuantizedMatmul, QuantizedMatmul]] | None = None  # (gate_up, down) per expert
        set_weight_loader(self.w13, self.weight_loader)
        set_weight_loader(self.w2, self.weight_loader)

    def owns(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard: tuple[int, str]) -> None:
        """`shard` = (global expert id, "gate" | "up" | "down"); experts of other EP ranks are skipped.
        Quantized blocks are kept per (local expert, projection) until assemble_quantized joins them."""
        expert, which = shard
        if not self.owns(expert):
            return
        local, n, off = expert - self.first_expert, self.inter, self.slice_rank * self.inter
        if which == "down" and isinstance(loaded, QuantizedWeight):  # each slice must be whole blocks
            check_block_split(f"expert {expert} down projection", loaded.shape[1], loaded.shape[1] // n,
                              loaded.block_type)
        piece = loaded.narrow(1, off, n) if which == "down" else loaded.narrow(0, off, n)
        if isinstance(piece, QuantizedWeight):
            self.quantized_pieces[(local, which)] = piece
            return
        dest = param.data[local]
        if which == "down":
            dest.copy_(piece)
        else:
            dest.narrow(0, 0 if which == "gate" else n, n).copy_(piece)

    def quantize(self, make: Callable[[torch.Tensor], QuantizedWeight] | None, device: torch.device,
                 dense: bool = False) -> bool:
        """Each expert's weights as quantized matmuls: the blocks loaded, or made by `make` from the
        float weights; with `dense`, loaded blocks are dequantized into the float weights instead.
        True when the experts run quantized."""
        pieces, self.quantized_pieces = self.quantized_pieces, {}
        if pieces:
            w13 = [[pieces[(e, "gate")], pieces[(e, "up")]] for e in range(self.num_local)]
            w2 = [[pieces[(e, "down")]] for e in range(self.num_local)]
        elif make is not None and not dense:
            w13 = [[make(self.w13[e])] for e in range(self.num_local)]
            w2 = [[make(self.w2[e])] for e in range(self.num_local)]
        else:
            return False
        if dense:
            for e in range(self.num_local):
                self.w13.data[e] = torch.cat([w.dequantize() for w in w13[e]])
                self.w2.data[e] = w2[e][0].dequantize()
            return False
        self.quant = [(QuantizedMatmul(a, device), QuantizedMatmul(b, device)) for a, b in zip(w13, w2)]
        return True

    def forward(self, rows: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        """rows grouped by local expert (rows_per_expert[e] consecutive rows for expert e)."""
        out = rows.new_empty(rows.shape[0], self.hidden)
        start = 0
        for e, n in enumerate(rows_per_expert):
            if n:
                block = slice(start, start + n)
                if self.quant is not None:
                    gate_up, down = self.quant[e]
                    out[block] = down(silu_and_mul(gate_up(rows[block])))
                else:
                    out[block] = F.linear(silu_and_mul(F.linear(rows[block], self.w13[e])), self.w2[e])
                start += n
        return out


class SparseMoeBlock(nn.Module):
    """Router + experts (+ an optional shared expert, given as a module that returns its TP partial,
    with its sigmoid gate). Takes and returns the whole batch [T, H] on every TP rank."""

    def __init__(self, hidden: int, intermediate: int, router: RouterSpec, shared_expert: nn.Module | None = None):
        super().__init__()
        ps = get_parallel_state()
        e, self.ep_size = router.num_experts, ps.ep_size
        if e % self.ep_size:
            raise ValueError(f"num_experts {e} is not divisible by the expert-parallel size {self.ep_size}")
        self.router = router
        self.gate = ReplicatedLinear(hidden, e)
        if self.ep_size > 1:  # whole experts, E / EP per rank
            per = e // self.ep_size
            self.experts = GroupedExperts(per, ps.ep_rank * per, hidden, intermediate)
        else:  # every expert, a 1/TP slice of each
            self.experts = GroupedExperts(e, 0, hidden, intermediate, ps.tp_rank, ps.tp_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = ReplicatedLinear(hidden, 1) if shared_expert is not None else None
        self.layer: int | None = None  # set with the recorder by the model
        self.recorder: ExpertLoadRecorder | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ps = get_parallel_state()
        if self.ep_size > 1:
            return self._forward_expert_parallel(ps, x)
        weights, ids = route(self.gate(x), self.router)
        if self.experts.quant is None and fused.triton_path(x):
            y = self._grouped_on_device(x, weights, ids)
        else:
            order, counts = sort_by_expert(ids, self.router.num_experts)
            self._record(counts)
            sorted_out = self.experts(x[order // self.router.top_k], counts.tolist())
            y = self._unsort_and_sum(sorted_out, order, weights, ids)
        if self.shared_expert is not None:
            y = y + self._shared(x)
        return ps.all_reduce(y)

    def graph_unsafe_reason(self) -> str | None:
        """Why a forward through this block cannot be captured in a CUDA graph, or None."""
        if self.ep_size > 1:
            return "expert parallelism: the all-to-all splits are token counts read on the host"
        if self.experts.quant is not None:
            return "quantized experts: their loop reads each expert's token count on the host"
        return None

    def _grouped_on_device(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The Triton path (layers/triton_moe.py): grouped on the device, no host reads, so that
        a decode step can be captured; the same fixed-order weighted sum as the eager path."""
        kernels, pairs_total = fused.moe_kernels(), ids.numel()
        pairs, tile_expert, counts = kernels.group_pairs(ids, self.router.num_experts)
        if self.recorder is not None:  # captured in decode graphs, whose padding rows are routed too
            assert self.layer is not None, "the model sets the layer with the recorder"
            self.recorder.add_routed(self.layer, ids, counts)
        gate_up = kernels.expert_matmul(x, self.experts.w13, pairs, tile_expert, pairs_total, self.router.top_k)
        out = kernels.expert_matmul(silu_and_mul(gate_up), self.experts.w2, pairs, tile_expert, pairs_total, 1)
        return weighted_sum(out, weights, ids, self.router.float32_weights)

    def _forward_expert_parallel(self, ps, x: torch.Tensor) -> torch.Tensor:
        start, end = expert_parallel.token_slice(x.shape[0], ps.ep_size, ps.ep_rank)
        local = x[start:end]
        weights, ids = route(self.gate(local), self.router)
        order, counts = sort_by_expert(ids, self.router.num_experts)
        d = expert_parallel.dispatch(ps, local[order // self.router.top_k], counts)
        self._record(d.global_counts)
        returned = expert_parallel.combine(ps, self.experts(d.rows, d.rows_per_expert), d)
        y = self._unsort_and_sum(returned, order, weights, ids)
        if self.shared_expert is None:
            return expert_parallel.gather_slices(ps, y, x.shape[0])
        # The shared expert is TP-sliced over the whole batch: place this rank's routed rows into the
        # batch and let one all-reduce sum routed rows and shared partials together.
        full = self._shared(x)
        full[start:end] += y
        return ps.all_reduce(full, kind=expert_parallel.COMBINE)

    def _unsort_and_sum(self, sorted_out: torch.Tensor, order: torch.Tensor, weights, ids) -> torch.Tensor:
        pair_out = torch.empty_like(sorted_out)
        pair_out[order] = sorted_out
        return weighted_sum(pair_out, weights, ids, self.router.float32_weights)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """Only for a block with a shared expert (its gate is made with it)."""
        assert self.shared_expert is not None and self.shared_expert_gate is not None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _record(self, counts: torch.Tensor) -> None:
        if self.recorder is not None:
            assert self.layer is not None, "the model sets the layer with the recorder"
            self.recorder.add(self.layer, counts)
