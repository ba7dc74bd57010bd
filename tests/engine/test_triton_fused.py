"""The CUDA path's fused Triton kernels (layers/triton_fused.py, layers/triton_moe.py), run by the
interpreter on CPU tensors, against the PyTorch formulas they replace, on ragged shapes: widths
that are not powers of two, odd token counts, scattered cache slots, uneven expert routing."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

import pytest
import torch
import torch.nn.functional as F

from meshserve.distributed.parallel_state import ParallelState, set_parallel_state
from meshserve.layers import fused, triton_fused, triton_moe
from meshserve.layers.attention.base import write_kv
from meshserve.layers.moe import RouterSpec, SparseMoeBlock
from meshserve.layers.norm import RMSNorm
from meshserve.layers.rotary import RotaryEmbedding

# bfloat16 within about one rounding step: the interpreter casts float32 to bfloat16 toward zero
# where a GPU rounds to nearest, so bf16 results cannot be compared bit for bit here.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    assert type(triton_fused._add_rms_norm_kernel).__name__ == "InterpretedFunction", \
        "TRITON_INTERPRET=1 must be set before the kernels are imported"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,width", [(1, 64), (5, 96), (33, 130)])
def test_add_rms_norm(dtype, tokens, width):
    g = _gen(tokens)
    norm = RMSNorm(width, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
    x = torch.randn(tokens, width, generator=g).to(dtype)
    residual = torch.randn(tokens, width, generator=g).to(dtype)
    expected_sum = x + residual
    expected = norm._norm(expected_sum)
    stream = residual.clone()
    got = triton_fused.add_rms_norm(x, norm.weight, norm.eps, stream)
    torch.testing.assert_close(stream, expected_sum, **TOL[dtype])  # the residual stream, updated in place
    torch.testing.assert_close(got, expected, **TOL[dtype])
    torch.testing.assert_close(triton_fused.add_rms_norm(x, norm.weight, norm.eps), norm._norm(x), **TOL[dtype])
    with fused.force_triton():  # the module takes the kernel on the forced path, same contract
        out, res = norm(x, residual.clone())
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(res, expected_sum, **TOL[dtype])
    if dtype == torch.float32:
        assert torch.equal(res, expected_sum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,width", [(1, 8), (7, 40), (3, 1100)])
def test_silu_and_mul(dtype, tokens, width):
    gate_up = torch.randn(tokens, 2 * width, generator=_gen(width)).to(dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = triton_fused.silu_and_mul(gate_up)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,tokens", [(4, 2, 16, 5), (8, 8, 8, 1), (6, 2, 80, 9)])
def test_rope_and_cache_write(dtype, heads, kv_heads, head_dim, tokens):
    g = _gen(heads * head_dim + tokens)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    blocks, block_size = 6, 4
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    q_ref, k_ref, v_ref = (t.view(tokens, -1, head_dim) for t in
                           qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    q_ref, k_ref = rotary(positions, q_ref, k_ref)
    caches_ref = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    caches = caches_ref.clone()
    write_kv(caches_ref[0], slots, k_ref)
    write_kv(caches_ref[1], slots, v_ref.contiguous())

    rows = rotary.at(positions)
    cos, sin = rows.cos_sin(dtype)
    fused_qkv = qkv.clone()
    triton_fused.rope_and_cache(fused_qkv, cos, sin, heads, kv_heads, slots, caches[0], caches[1])
    q, k, v = fused_qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    torch.testing.assert_close(q.view(tokens, heads, head_dim), q_ref, **TOL[dtype])
    torch.testing.assert_close(k.view(tokens, kv_heads, head_dim), k_ref, **TOL[dtype])
    assert torch.equal(v.view(tokens, kv_heads, head_dim), v_ref)
    torch.testing.assert_close(caches, caches_ref, **TOL[dtype])  # only the slots written changed
    if dtype == torch.float32:
        torch.testing.assert_close(caches, caches_ref, rtol=1e-6, atol=1e-6)

    rotated_only = qkv.clone()  # without caches: the rotation alone, in place
    triton_fused.rope_and_cache(rotated_only, cos, sin, heads, kv_heads)
    assert torch.equal(rotated_only, fused_qkv)
    assert rows.cos_sin(dtype)[0] is cos  # gathered once, shared by every later layer


def test_group_pairs_tiles_every_expert_run():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]] + [[3, 2]] * 15)  # expert 3 fills two tiles
    pairs, tile_expert, counts = triton_moe.group_pairs(ids, num_experts=6)
    p = ids.numel()
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=6).tolist()
    assert pairs.numel() == triton_moe.max_tiles(p, 6) * triton_moe.BLOCK_M
    seen = []
    for tile, expert in enumerate(tile_expert.tolist()):
        rows = pairs[tile * triton_moe.BLOCK_M:(tile + 1) * triton_moe.BLOCK_M]
        real = rows[rows < p].tolist()
        if expert == 6:  # the unused tail
            assert real == []
            continue
        assert all(ids.flatten()[r] == expert for r in real) and real == sorted(real)
        seen += real
    assert sorted(seen) == list(range(p))  # every pair in exactly one tile row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,top_k,tokens", [(8, 2, 1), (4, 2, 37), (16, 4, 3), (8, 8, 20)])
def test_expert_matmul_against_per_expert_linear(dtype, experts, top_k, tokens):
    g = _gen(experts * tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    x = torch.randn(tokens, 40, generator=g).to(dtype)
    w = torch.randn(experts, 24, 40, generator=g).to(dtype)
    pairs, tile_expert, _ = triton_moe.group_pairs(ids, experts)
    got = triton_moe.expert_matmul(x, w, pairs, tile_expert, ids.numel(), top_k)
    flat = ids.flatten()
    expected = torch.stack([F.linear(x[p // top_k], w[flat[p]]) for p in range(flat.numel())])
    torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize("float32_weights,shared", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_moe_block_on_the_triton_path_matches_the_expert_loop(float32_weights, shared, tokens):
    """The capturable path against the eager one (the path the transformers comparisons check)."""
    set_parallel_state(ParallelState())
    torch.manual_seed(tokens)
    from meshserve.models.llama import LlamaMLP

    block = SparseMoeBlock(24, 40, RouterSpec(8, 2, renormalize=not shared, float32_weights=float32_weights),
                           LlamaMLP(24, 16, reduce_results=False) if shared else None)
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(tokens, 24)
    with torch.inference_mode():
        expected = block(x)
        with fused.force_triton():
            got = block(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
