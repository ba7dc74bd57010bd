"""python -m meshserve.calibration [--calibration-file F] [--cpu-dtype float32|bfloat16]: measure, write
the JSON, print where (the last line of standard output is the file's path)."""
from __future__ import annotations

import argparse
import sys

from meshserve.calibration.measure import CPU_DTYPES, calibrate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshserve.calibration", description=__doc__)
    p.add_argument("--calibration-file", default=None, help="where to write it (default: the cache directory's)")
    p.add_argument("--cpu-dtype", default="float32", choices=CPU_DTYPES,
                   help="on a CPU, the dtype the engine will serve in (a GPU always measures bfloat16)")
    args = p.parse_args(argv)
    try:
        _, path = calibrate(args.calibration_file, cpu_dtype=args.cpu_dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
