"""Decode attention per layer on CPU: the PyTorch gather + SDPA path against the paged C++ kernel.

SmolLM2-135M geometry (9 query heads, 3 KV heads, head_dim 64, 16-token blocks), float32, a batch
of decoding sequences whose blocks are scattered through a larger cache as after some serving.
The machine may be shared, so each figure is the minimum over many interleaved repeats.

    python3 benchmarks/decode_attention.py [--batch 64] [--context 320] [--threads 1 2] [--repeats 50]
"""
from __future__ import annotations

import argparse
import time

import torch

from meshserve.layers import cpu_kernels
from meshserve.layers.attention.torch_ref import gathered_decode


def make_inputs(batch: int, context: int, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = -(-context // block_size)
    num_blocks = 2 * batch * width
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)
    # Lengths spread just below `context`, as in a batch of requests that started at different steps.
    lens = context - torch.randint(0, block_size, (batch,), generator=g)
    mask = (torch.arange(width * block_size)[None, :] < lens[:, None])[:, None, None, :]
    q = torch.randn(batch, heads, head_dim, generator=g)
    return q, k_cache, v_cache, tables, mask, lens


def best_ms(fns, repeats: int) -> list[float]:
    """Minimum wall time of each function, the functions interleaved so load spikes hit all alike."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()  # warm-up
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [b * 1e3 for b in best]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU attention kernel did not build; nothing to compare")
    q, k_cache, v_cache, tables, mask, lens = make_inputs(args.batch, args.context)
    old = lambda: gathered_decode(q, k_cache, v_cache, tables, mask)  # noqa: E731
    new = lambda: cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 64 ** -0.5)  # noqa: E731
    with torch.inference_mode():
        diff = (old() - new()).abs().max().item()
        print(f"B={args.batch} context~{args.context} float32, max abs diff {diff:.2e}")
        print(f"{'threads':>7} {'pytorch ms':>11} {'kernel ms':>10} {'speed-up':>9}")
        for n in args.threads:
            torch.set_num_threads(n)
            t_old, t_new = best_ms([old, new], args.repeats)
            print(f"{n:>7} {t_old:>11.3f} {t_new:>10.3f} {t_old / t_new:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
