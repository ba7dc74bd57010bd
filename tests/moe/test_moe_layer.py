"""The MoE block's pieces on one rank: routing semantics, the fixed-order weighted sum, grouped experts
against a per-token reference, and where each rank's expert weights come from."""
import pytest
import torch
import torch.nn.functional as F

from meshserve.distributed.parallel_state import ParallelState, set_parallel_state
from meshserve.layers.moe import (
    GroupedExperts,
    RouterSpec,
    SparseMoeBlock,
    route,
    weighted_sum,
)


@pytest.fixture(autouse=True)
def single_rank():
    set_parallel_state(ParallelState())
    yield
    set_parallel_state(ParallelState())


def test_softmax_then_top_k_renormalised_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 0.0, 2.9]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = route(logits, RouterSpec(4, 2, renormalize=False))
    assert ids.tolist() == [[0, 1], [1, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))  # Qwen-MoE default: raw probabilities
    assert (weights.sum(-1) < 1).all()
    weights, _ = route(logits, RouterSpec(4, 2, renormalize=True))  # Mixtral; Qwen with norm_topk_prob
    torch.testing.assert_close(weights, probs.gather(1, ids) / probs.gather(1, ids).sum(-1, keepdim=True))


def test_weighted_sum_adds_in_expert_order_whatever_the_batch():
    torch.manual_seed(0)
    t, k, h = 5, 4, 16
    out = torch.randn(t * k, h) * 1e3
    weights = torch.rand(t, k)
    ids = torch.stack([torch.randperm(8)[:k] for _ in range(t)])
    y = weighted_sum(out, weights, ids, float32_weights=False)
    for row in range(t):
        order = ids[row].argsort()
        expected = out.view(t, k, h)[row, order[0]] * weights[row, order[0]]
        for j in order[1:]:
            expected = expected + out.view(t, k, h)[row, j] * weights[row, j]
        assert torch.equal(y[row], expected)  # bit for bit
        alone = weighted_sum(out.view(t, k, h)[row], weights[row:row + 1], ids[row:row + 1], False)
        assert torch.equal(alone[0], y[row])


def test_router_weight_dtype_per_family_in_bf16():
    torch.manual_seed(0)
    out = torch.randn(64 * 2, 32).bfloat16()
    weights, ids = torch.rand(64, 2), torch.tensor([[0, 1]] * 64)
    qwen = weighted_sum(out, weights, ids, float32_weights=False)
    mixtral = weighted_sum(out, weights, ids, float32_weights=True)
    y = out.view(64, 2, 32)
    assert torch.equal(qwen, y[:, 0] * weights[:, :1].bfloat16() + y[:, 1] * weights[:, 1:].bfloat16())
    assert torch.equal(mixtral, (y[:, 0].float() * weights[:, :1]).bfloat16()
                       + (y[:, 1].float() * weights[:, 1:]).bfloat16())
    assert not torch.equal(qwen, mixtral)


def _reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, straight from the definition."""
    rows = []
    for token in x:
        probs = torch.softmax(F.linear(token, block.gate.weight), -1)
        w, ids = probs.topk(block.router.top_k)
        w = w / w.sum() if block.router.renormalize else w
        acc = torch.zeros_like(token)
        for wi, e in zip(w, ids):
            gate, up = F.linear(token, block.experts.w13[e]).chunk(2)
            acc += wi * F.linear(F.silu(gate) * up, block.experts.w2[e])
        rows.append(acc)
    return torch.stack(rows)


def test_grouped_experts_match_the_per_token_definition_and_the_batch_does_not_matter():
    torch.manual_seed(0)
    block = SparseMoeBlock(32, 24, RouterSpec(8, 3, renormalize=True))
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(40, 32)
    y = block(x)
    torch.testing.assert_close(y, _reference(block, x), rtol=1e-5, atol=1e-5)
    perm = torch.randperm(40)
    torch.testing.assert_close(block(x[perm]), y[perm], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(block(x[:3]), y[:3], rtol=1e-6, atol=1e-6)


def test_expert_weights_load_into_the_owning_rank_only():
    full = {(e, which): torch.full((6, 4) if which != "down" else (4, 6), float(10 * e + i))
            for e in range(4) for i, which in enumerate(("gate", "up", "down"))}
    ep_rank1 = GroupedExperts(num_local=2, first_expert=2, hidden=4, intermediate=6)  # EP=2: experts 2, 3
    tp_rank1 = GroupedExperts(num_local=4, first_expert=0, hidden=4, intermediate=6, slice_rank=1, slices=2)
    for (e, which), tensor in full.items():
        for experts in (ep_rank1, tp_rank1):
            param = experts.w2 if which == "down" else experts.w13
            experts.weight_loader(param, tensor, (e, which))
    assert ep_rank1.w13.shape == (2, 12, 4) and ep_rank1.w13[0, :6].eq(20).all() and ep_rank1.w13[1, 6:].eq(31).all()
    assert ep_rank1.w2[1].eq(32).all()
    assert tp_rank1.w13.shape == (4, 6, 4) and tp_rank1.w13[3, :3].eq(30).all() and tp_rank1.w13[3, 3:].eq(31).all()
    assert tp_rank1.w2.shape == (4, 4, 3)
