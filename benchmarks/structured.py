"""What structured outputs cost, measured in one run on the embedded model (offline engine).

TPOT of a batch of 16 where half the rows are constrained by a JSON schema against the same batch
unconstrained, the two taking turns (--repeats rounds, medians): the schema forces long answers
(at least 50 items), so constrained rows run the whole `--output-len` like the unconstrained ones
(ignore_eos) and both batches compute the same tokens. Also the first-use cost: building the
tokenizer's view for the grammar library (once per engine) and compiling a schema (once per schema).
Goal: constrained TPOT within 1.15x of unconstrained.

    python benchmarks/structured.py
    python benchmarks/structured.py --batch 16 --output-len 128 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 50,
                                                     "items": {"type": "string", "maxLength": 16}}},
          "required": ["items"], "additionalProperties": False}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from meshserve import LLM, SamplingParams
    from meshserve.sampling_params import StructuredOutputsParams

    llm = LLM(max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    engine = llm.engine
    started = time.perf_counter()
    engine.structured._ll()
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    engine.structured.compile(StructuredOutputsParams(json=SCHEMA)).result()
    compile_s = time.perf_counter() - started

    prompts = [f"List {k} short words as JSON:" for k in range(args.batch)]
    plain = SamplingParams(temperature=0.8, seed=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=0, max_tokens=args.output_len, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    batches = {"unconstrained": [plain] * args.batch,
               "half constrained": [constrained if k % 2 else plain for k in range(args.batch)]}
    llm.generate(prompts[:2], plain)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in batches}
    for r in range(args.repeats):
        for name in (list(batches) if r % 2 == 0 else list(batches)[::-1]):
            engine.block_manager.reset_prefix_cache()  # both batches prefill their prompts in full
            t0 = time.perf_counter()
            outs = llm.generate(prompts, batches[name])
            elapsed = time.perf_counter() - t0
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs), "a row ended early"
            times[name].append(elapsed / args.output_len)
    engine.shutdown()
    tpot = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"batch {args.batch} x {args.output_len} tokens, median of {args.repeats} runs each, taking turns")
    for name, ms in tpot.items():
        print(f"  {name:17s} TPOT {ms:7.2f} ms")
    ratio = tpot["half constrained"] / tpot["unconstrained"]
    print(f"  ratio {ratio:.3f}x (goal <= 1.15x): {'met' if ratio <= 1.15 else 'NOT met'}")
    print(f"first use: tokenizer for the grammar library {tokenizer_s * 1e3:.0f} ms (once per engine), "
          f"schema compile {compile_s * 1e3:.1f} ms (once per schema)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
