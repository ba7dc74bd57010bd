"""Causal attention of fresh prompts on CPU: the C++ kernel (cpu_kernels.prefill_causal: float32 on
AVX2 CPUs without AVX-512, bfloat16 on AMX tiles) against F.scaled_dot_product_attention (PyTorch's
flash attention on CPU), on the same q/k/v: column slices of one QKV output, as the model has them.

SmolLM2-135M geometry by default (9 query heads, 3 KV heads, head_dim 64). Each figure is the
fastest of --repeats runs, the two taking turns; the ratio is SDPA's time over the kernel's, and
GFLOP/s counts the causal half of the scores and the weighted sums (4 x heads x L(L+1)/2 x D a prompt).

    python benchmarks/prefill_attention.py [--shapes 1x256 8x256 1x1024 16x128] [--threads 2] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1x256", "8x256", "1x1024", "2x1024", "16x128"],
                    help="PROMPTSxLENGTH: prompts of one length packed back to back, as a step groups them")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    H, KVH, D = args.heads, args.kv_heads, args.head_dim
    if not cpu_kernels.prefill_usable(torch.zeros(1, H, D, dtype=dtype), 1):
        print(f"the prefill kernel does not take {args.dtype} on this CPU (not built; float32: AVX-512 present, "
              "bfloat16: no AMX): nothing to compare")
        return 1
    print(f"{args.dtype}, threads {args.threads}; heads {H}, kv heads {KVH}, head_dim {D}; fastest of {args.repeats}")
    print(f"{'prompts x length':>17} {'sdpa ms':>9} {'kernel ms':>10} {'kernel GFLOP/s':>15} {'speed-up':>9}")
    for shape in args.shapes:
        n, length = (int(x) for x in shape.split("x"))
        qkv = torch.randn(n * length, (H + 2 * KVH) * D).to(dtype)
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=1)
        q, k, v = q.view(-1, H, D), k.view(-1, KVH, D), v.view(-1, KVH, D)

        def heads_first(x, n=n, length=length):
            return x.view(n, length, x.shape[1], D).transpose(1, 2)

        def sdpa(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                                  enable_gqa=True)

        def kernel(q=q, k=k, v=v, n=n):
            return cpu_kernels.prefill_causal(q, k, v, n)

        if not cpu_kernels.prefill_usable(q, n):
            print(f"{shape:>17}   past the kernel's limit (prompts up to 2,048 tokens): SDPA runs")
            continue
        best = [float("inf"), float("inf")]
        for _ in range(args.repeats):
            for i, fn in enumerate((sdpa, kernel)):
                t = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - t)
        flops = 4 * n * H * length * (length + 1) / 2 * D
        print(f"{shape:>17} {best[0] * 1e3:>9.2f} {best[1] * 1e3:>10.2f} {flops / best[1] / 1e9:>15.0f} "
              f"{best[0] / best[1]:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
