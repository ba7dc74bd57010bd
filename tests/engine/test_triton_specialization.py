"""Serving never recompiles a Triton kernel: over randomized steps (batch sizes, prompt lengths,
cached prefixes, block-table widths) through one Triton attention backend, and over varying row
counts through the quantized matmul, every kernel launch has the specialization key of the first
launch with the same constexprs. The key is computed by Triton's own argument binder
(`create_function_from_signature`, the one JITFunction.run keys its cache on): integers
specialize on == 1 and % 16 == 0, pointers on 16-byte alignment, unless marked
do_not_specialize. The kernels run in the interpreter on CPU tensors."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

import random
from collections import defaultdict

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from meshserve.layers import host_to_device
from meshserve.layers.attention import AttentionSpec, create_backend
from meshserve.layers.host_to_device import HostStaging, aligned_offsets
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

CPU = torch.device("cpu")
BLOCK = 16
NUM_BLOCKS = 160


class KeyRecorder:
    """Wraps kernels' `run` to record, per (kernel, constexpr values), the set of keys of the
    other arguments that the launches would compile for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kernels: dict):
        self.keys: dict[tuple, set] = defaultdict(set)
        for name, kernel in kernels.items():
            jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
            bind = create_function_from_signature(jit.signature, jit.params, BaseBackend)
            monkeypatch.setattr(kernel, "run", self._recording(name, jit.params, bind, kernel.run))

    def _recording(self, name, params, bind, run):
        def recorded(*args, grid, warmup, **kwargs):
            _, specialization, _ = bind(*args, **kwargs)
            constexprs = tuple(s for p, s in zip(params, specialization) if p.is_constexpr)
            runtime = tuple(s for p, s in zip(params, specialization) if not p.is_constexpr)
            self.keys[(name, constexprs)].add(runtime)
            return run(*args, grid=grid, warmup=warmup, **kwargs)
        return recorded

    def recompiles(self) -> dict:
        return {k: v for k, v in self.keys.items() if len(v) > 1}


def _random_step(rng: random.Random, first: bool) -> StepInput:
    """Prefills (fresh or after a cached prefix) and decodes of random lengths on random blocks
    (shared ones too: only the launches matter here); the first step is one short prompt (a
    block-table width of 1, which an integer would be specialized on)."""
    shapes = [(rng.randint(2, 9), 0)] if first else []
    if not first:
        shapes += [(rng.randint(2, 40), rng.choice([0, rng.randint(1, 240)])) for _ in range(rng.randint(0, 2))]
        shapes += [(1, rng.randint(0, 600)) for _ in range(rng.randint(0 if shapes else 1, 9))]
    seqs = []
    for i, (new, cached) in enumerate(shapes):
        blocks = -(-(new + cached) // BLOCK)
        seqs.append(SeqStep(i, [1] * new, cached, [rng.randrange(NUM_BLOCKS) for _ in range(blocks)], sample=True))
    return StepInput(seqs)


def test_attention_keys_stay_fixed_over_randomized_steps(monkeypatch):
    from meshserve.layers import triton_attention

    assert type(triton_attention._paged_attention_kernel).__name__ == "InterpretedFunction"
    recorder = KeyRecorder(monkeypatch, {"attention": triton_attention._paged_attention_kernel,
                                         "combine": triton_attention._combine_splits_kernel})
    heads, kv_heads, head_dim = 4, 2, 16
    backend = create_backend("triton", AttentionSpec(heads, kv_heads, BLOCK), CPU)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, kv_heads, head_dim, generator=gen)
    rng = random.Random(0)
    token_parities, prefill_widths, splits = set(), set(), set()
    for i in range(14):
        packed = pack_step(_random_step(rng, first=i == 0), BLOCK)
        t = packed.num_tokens
        q, k, v = (torch.randn(t, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
        _, _, meta = backend.build_inputs(packed)
        backend.forward(q, k, v, cache[0], cache[1], meta)
        token_parities.add(t % 2)
        if packed.prefills:
            prefill_widths.add(max(len(p.block_table) for p in packed.prefills))
        splits.add(meta.decode_splits)
    # The steps cross what a key would otherwise change on: array offsets in the flat buffer,
    # and table widths of 1, of a multiple of 16 and of others.
    assert token_parities == {0, 1} and 1 in prefill_widths and len(prefill_widths) > 2 and len(splits) > 1
    assert any(name == "combine" for name, _ in recorder.keys)
    assert recorder.recompiles() == {}


def test_quantized_matmul_keys_stay_fixed_over_row_counts(monkeypatch):
    from meshserve.layers.quantization import reference, triton_matmul

    recorder = KeyRecorder(monkeypatch, {"matmul": triton_matmul._quant_matmul_kernel})
    w = triton_matmul.prepare_cuda_weight(reference.int8_rows(torch.randn(32, 256) * 0.05), CPU)
    x = torch.randn(40, 256)
    for rows in (1, 3, 16, 5, 2, 17, 32, 33):  # decode tiles with split-K, then prefill tiles
        triton_matmul.cuda_quantized_matmul(x[:rows], w)
    assert len(recorder.keys) == 3  # one per tile shape: decode with split-K, two prefill shapes
    assert recorder.recompiles() == {}


def test_every_staged_array_starts_16_byte_aligned():
    assert aligned_offsets([3, 0, 1, 2, 5], 8) == ([0, 4, 4, 6, 8], 14)
    assert aligned_offsets([3, 5], 4) == ([0, 4], 12)
    staging = HostStaging(CPU)
    for lengths in ([1, 3, 2], [7, 0, 5, 1], [2, 2]):
        arrays = [list(range(n)) for n in lengths]
        out = staging.to_device(arrays)
        assert [t.tolist() for t in out] == arrays
        assert all(t.data_ptr() % host_to_device.ALIGN_BYTES == 0 for t in out)
    first = staging.to_device([[1, 2]])[0]
    staging.to_device([[3, 4]])
    staging.to_device([[5, 6]])  # the same buffer as `first` came from
    assert first.tolist() == [1, 2]  # a step's tensors never alias the reused buffers on CPU
