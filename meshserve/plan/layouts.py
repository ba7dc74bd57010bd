"""TP x PP x DP layouts of a GPU count (with or without expert parallelism for an MoE model), and
the structural rules a layout must obey.

Expert parallelism adds no dimension to the GPU count: the MoE layers of a replica use the same TP
ranks as its attention, split by expert instead of by width (EP = TP; vLLM's EP = TP x DP of one
data-parallel group). A layout needs TP x PP x DP GPUs with or without EP; counting
TP x PP x DP x EP would count the same GPUs twice.

Rejected: what the engine refuses (`models/sharding.tp_size_problem`, the same rule: TP must divide
the attention heads and every MLP width, and divide or be a multiple of the KV heads; for quantized
weights `block_formats.check_block_split`, the engine's rule too: a row-parallel layer's inputs,
o_proj's and down_proj's, split over the TP ranks only at the format's block boundaries), and PP
deeper than the layers.
Flagged (runs, but costs): KV-head replication, an uneven pipeline split (the fullest stage
governs), a TP group that spans nodes (all-reduce over the inter-node network), a replica that
spans nodes (stage sends over the network).
"""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.block_formats import BLOCK_FORMATS, check_block_split
from meshserve.models.sharding import tp_size_problem

from .specs import ModelSpec
from .units import WEIGHT_BLOCK_TYPES


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: bool = False  # MoE layers split whole experts over the TP ranks

    @property
    def ep_size(self) -> int:
        """Ranks the experts of one MoE layer are split over: the TP ranks of a stage, or 1."""
        return self.tp if self.ep else 1

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        return f"TP{self.tp} PP{self.pp} DP{self.dp}" + (f" EP{self.ep_size}" if self.ep else "")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp  # EP reuses the TP ranks: never a fourth factor

    def tp_spans_nodes(self, gpus_per_node: int) -> bool:
        return crosses_nodes(self.tp, self.num_gpus, gpus_per_node)

    def replica_spans_nodes(self, gpus_per_node: int) -> bool:
        return crosses_nodes(self.gpus_per_replica, self.num_gpus, gpus_per_node)


def crosses_nodes(group: int, total: int, gpus_per_node: int) -> bool:
    """Whether some group of `group` consecutive ranks (of `total`, packed node by node) has its
    first and last rank on different nodes."""
    return any(i * group // gpus_per_node != ((i + 1) * group - 1) // gpus_per_node
               for i in range(total // group))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(num_gpus: int, tp: int | None = None, pp: int | None = None, moe: bool = False,
                      expert_parallel: bool | None = None) -> list[Layout]:
    """Every TP x PP x DP = num_gpus, optionally pinned to a given TP and/or PP. For an MoE model
    (`moe`) each layout with TP > 1 comes with and without EP, or only one way when
    `expert_parallel` pins it."""
    if num_gpus < 1:
        raise ValueError(f"--num-gpus must be >= 1, got {num_gpus}")
    for flag, value in (("--tensor-parallel-size", tp), ("--pipeline-parallel-size", pp)):
        if value is not None and (value < 1 or num_gpus % value):
            raise ValueError(f"{flag} {value} must divide --num-gpus {num_gpus} "
                             f"(valid: {', '.join(map(str, divisors(num_gpus)))})")
    if tp and pp and num_gpus % (tp * pp):
        raise ValueError(f"TP {tp} x PP {pp} = {tp * pp} does not divide --num-gpus {num_gpus}")
    def ep_options(t: int) -> list[bool]:
        if not moe or t == 1:
            return [False]  # EP over one rank is no EP
        return [e for e in (False, True) if expert_parallel in (None, e)]

    return [Layout(t, p, num_gpus // (t * p), e)
            for t in divisors(num_gpus) if tp in (None, t)
            for p in divisors(num_gpus // t) if pp in (None, p)
            for e in ep_options(t)]


def block_split_problems(spec: ModelSpec, tp: int, weight_dtype: str, ep: bool = False,
                         embedding: bool = False) -> list[str]:
    """Where a quantized weight dtype's blocks do not fit the layers at `tp`, in the words of the
    engine's rule (`check_block_split`): the inputs of row-parallel layers (o_proj, down_proj) are cut
    into TP runs, each of whole blocks; column-parallel layers (q/k/v, gate/up, the vocabulary) split
    their rows, which is always fine, but their rows must hold whole blocks at any TP. `embedding`:
    the dtype of the embedding and LM head only, whose rows are hidden_size long."""
    block = WEIGHT_BLOCK_TYPES.get(weight_dtype)
    if block is None:
        return []
    heads = spec.num_attention_heads
    split = [("o_proj", heads * (spec.v_head_dim if spec.is_mla else spec.head_dim))]
    split += [("down_proj", width) for width in spec.sharded_dims_for(ep).mlp_sizes]
    whole = [("hidden_size", spec.hidden_size)]  # the inputs of q/k/v, gate/up and the embedding rows
    whole += [(name, size) for name, size in (("q_lora_rank", spec.q_lora_rank), ("kv_lora_rank", spec.kv_lora_rank))
              if size]
    if ep and spec.is_moe:
        whole.append(("experts' down_proj", spec.moe_intermediate_size))
    if embedding:
        whole, split = whole[:1], []
    problems = []
    for what, values in whole:
        try:
            check_block_split(what, values, 1, block)
        except ValueError:
            problems.append(f"{what}: rows of {values} values are not whole {block.name} blocks of "
                            f"{BLOCK_FORMATS[block].values} values")
    for what, values in split:
        try:
            check_block_split(what, values, tp, block)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def structural_check(spec: ModelSpec, layout: Layout, gpus_per_node: int,
                     weight_dtype: str = "bf16") -> tuple[list[str], list[str]]:
    """(reasons to reject, flags) that follow from the geometry, the weights' format and the topology."""
    errors, flags = [], []
    tp, pp, kv = layout.tp, layout.pp, spec.num_kv_heads
    problem = tp_size_problem(spec.sharded_dims_for(layout.ep), tp)
    blocks = block_split_problems(spec, tp, weight_dtype, layout.ep) if problem is None else []
    if problem is not None:
        errors.append(f"fractional sharding at TP={tp}: {problem}")
    elif blocks:
        errors += [f"{weight_dtype} blocks cut at TP={tp}: {b}" for b in blocks]
    elif spec.is_mla and tp > 1:
        flags.append(f"MLA latent cache replicated on all {tp} TP ranks")
    elif tp > kv:
        flags.append(f"KV heads replicated x{tp // kv} (TP={tp} > {kv} KV heads): "
                     f"the cache stops shrinking")
    if pp > spec.num_layers:
        errors.append(f"PP={pp} exceeds the {spec.num_layers} layers")
    elif spec.num_layers % pp:
        base = spec.num_layers // pp
        flags.append(f"uneven pipeline split: stages of {base + 1} and {base} layers "
                     f"(the fullest stage governs)")
    if layout.tp_spans_nodes(gpus_per_node):
        flags.append(f"TP={tp} spans nodes of {gpus_per_node} GPUs: all-reduce over the "
                     f"inter-node network")
    elif layout.replica_spans_nodes(gpus_per_node):
        flags.append(f"replica spans {-(-layout.gpus_per_replica // gpus_per_node)} nodes: "
                     f"pipeline sends over the inter-node network")
    return errors, flags
