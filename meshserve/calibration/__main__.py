"""python -m meshserve.calibration [--calibration-file F] [--cpu-dtype float32|bfloat16]
[--quant-formats Q4_1,Q8_0,INT8_ROWS]: measure, write the JSON, print where (the last line of standard
output is the file's path)."""
from __future__ import annotations

import argparse
import sys

from meshserve.block_formats import BlockType
from meshserve.calibration.measure import CPU_DTYPES, DEFAULT_QUANT_FORMATS, calibrate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshserve.calibration", description=__doc__)
    p.add_argument("--calibration-file", default=None, help="where to write it (default: the cache directory's)")
    p.add_argument("--cpu-dtype", default="float32", choices=CPU_DTYPES,
                   help="on a CPU, the dtype the engine will serve in (a GPU always measures bfloat16)")
    p.add_argument("--quant-formats", default=",".join(DEFAULT_QUANT_FORMATS),
                   help="on a CPU, the block formats whose quantized GEMV to measure, comma-separated "
                        f"(default {','.join(DEFAULT_QUANT_FORMATS)}; none: empty)")
    args = p.parse_args(argv)
    formats = tuple(f.strip().upper() for f in args.quant_formats.split(",") if f.strip())
    readable = [t.name for t in BlockType if t != BlockType.FP8_E4M3_ROWS]
    if bad := [f for f in formats if f not in readable]:
        p.error(f"--quant-formats: {', '.join(bad)} not among {', '.join(readable)}")
    try:
        _, path = calibrate(args.calibration_file, cpu_dtype=args.cpu_dtype, quant_formats=formats)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
