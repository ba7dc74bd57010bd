"""`meshserve generate`: one-shot offline generation from the command line."""
from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshserve.config import EngineConfig

    p = sub.add_parser(
        "generate", help="generate text offline (no server)",
        description="Generate a completion for one or more prompts with the offline engine.",
        epilog="Example: meshserve generate --prompt 'What is the capital of France?' --chat --max-tokens 32",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from meshserve.config import EngineConfig
    from meshserve.llm import LLM
    from meshserve.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    llm = LLM(**EngineConfig.from_cli_args(args).to_dict())
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outs = llm.generate(args.prompt, params)
    for out in outs:
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt_tokens": len(out.prompt_token_ids), "index": c.index, "text": c.text,
                                  "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
            else:
                print(c.text)
    sys.stdout.flush()
    llm.engine.shutdown()
    return 0
