"""`meshserve serve | gateway | generate | bench | plan`: one CLI, one module per subcommand.

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func` to the callable that runs it. Modules import heavy dependencies (torch) lazily so
that `meshserve --help` and `meshserve plan` start fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown in --help.
SUBCOMMAND_MODULES = [
    "meshserve.entrypoints.serve_cli",
    "meshserve.entrypoints.gateway_cli",
    "meshserve.entrypoints.generate_cli",
    "meshserve.bench.cli",
    "meshserve.plan.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshserve",
        description="Serve large language models beyond one device: size it (plan), run it "
        "(serve, generate), front a fleet of replicas (gateway), and measure it (bench).",
        epilog="Example: meshserve generate --prompt 'What is the capital of France?'",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # validated user input: a message, not a traceback
        print(f"meshserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
