"""Decode attention per layer on CPU: the PyTorch gather + SDPA path against the paged C++ kernel,
the kernel on its AVX2 path (which float32 caches take on every CPU), and in bfloat16 on its
AVX512-BF16 path and with its scores on AMX tiles (where the CPU has them).

SmolLM2-135M geometry (9 query heads, 3 KV heads, head_dim 64, --block-size tokens per block), float32 or
--dtype bfloat16 (the AVX512-BF16 path where the CPU has it), a batch
of decoding sequences whose blocks are scattered through a larger cache as after some serving.
Each pass runs over --layers such caches, as a decode step does, so K/V come from memory and not
from the last-level cache; the caches are on transparent huge pages, as the engine's are. Beside
each time, the K/V bytes read per second. The machine may be shared, so each figure is the minimum
over many interleaved repeats.

    python3 benchmarks/decode_attention.py [--batch 64] [--context 320] [--threads 1 2] [--repeats 20] [--block-size 16]
                                           [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import time

import torch

from meshserve.layers import cpu_kernels
from meshserve.layers.attention.torch_ref import gathered_decode
from meshserve.utils import huge_pages
from meshserve.utils.cpuinfo import cpu_flags


def make_inputs(batch: int, context: int, layers: int, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = -(-context // block_size)
    num_blocks = 2 * batch * width
    caches = [(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g),
               torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)) for _ in range(layers)]
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)
    # Lengths spread just below `context`, as in a batch of requests that started at different steps.
    lens = context - torch.randint(0, block_size, (batch,), generator=g)
    mask = (torch.arange(width * block_size)[None, :] < lens[:, None])[:, None, None, :]
    q = torch.randn(batch, heads, head_dim, generator=g)
    return q, caches, tables, mask, lens


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
    ap.add_argument("--layers", type=int, default=30, help="caches a pass reads, one per layer")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU attention kernel did not build; nothing to compare")
    q, caches, tables, mask, lens = make_inputs(args.batch, args.context, args.layers, block_size=args.block_size)
    dtype = getattr(torch, args.dtype)

    def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
        return huge_pages.zeros(tuple(t.shape), dtype).copy_(t)

    q, caches = q.to(dtype), [(on_huge_pages(k), on_huge_pages(v)) for k, v in caches]
    scale = q.shape[-1] ** -0.5

    def use(isa: str) -> None:
        cpu_kernels.allow_avx512(isa != "avx2")
        cpu_kernels.allow_amx(isa == "amx")

    def kernel(isa: str):
        def run():
            use(isa)
            for k, v in caches:
                cpu_kernels.paged_decode(q, k, v, tables, lens, scale)
        return run

    def pytorch():
        for k, v in caches:
            gathered_decode(q, k, v, tables, mask)

    isas = ["avx2", "avx512"] if dtype == torch.bfloat16 and "avx512_bf16" in cpu_flags() else ["avx2"]
    if dtype == torch.bfloat16 and cpu_kernels.panel_bf16_isa() == "amx":
        isas.append("amx")
    paths = {"pytorch": pytorch, **{f"kernel {isa}": kernel(isa) for isa in isas}}
    kv_bytes = lens.sum().item() * 2 * caches[0][0][0, 0].numel() * q.element_size() * args.layers
    with torch.inference_mode():
        k, v = caches[0]
        reference = gathered_decode(q.float(), k.float(), v.float(), tables, mask)
        for isa in isas:
            use(isa)
            diff = (reference - cpu_kernels.paged_decode(q, k, v, tables, lens, scale).float()).abs().max().item()
            print(f"B={args.batch} context~{args.context} block {args.block_size} {args.dtype}, {isa}: "
                  f"max abs diff {diff:.2e}")
        print(f"{'threads':>7} " + " ".join(f"{name:>24}" for name in paths) + "   speed-up over pytorch")
        for n in args.threads:
            torch.set_num_threads(n)
            times = best_ms(list(paths.values()), args.repeats)
            cells = [f"{t / args.layers:.3f} ms ({kv_bytes / t / 1e6:.1f} GB/s)" for t in times]
            ratios = [f"{times[0] / t:.2f}x" for t in times[1:]]
            print(f"{n:>7} " + " ".join(f"{c:>24}" for c in cells) + "   " + " / ".join(ratios))
        use("amx")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
