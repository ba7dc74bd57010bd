"""`meshserve generate` end to end, and the CLI's handling of bad values."""
import json
import subprocess
import sys

from meshserve.cli import main


def test_generate_cli_matches_the_python_api(capsys):
    from meshserve import LLM, SamplingParams

    rc = main(["generate", "--prompt", "The capital of France is", "--max-tokens", "6", "--json",
               "--max-model-len", "128", "--kv-cache-memory", "16MiB", "--ignore-eos"])
    assert rc == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = LLM(max_model_len=128, kv_cache_memory_bytes=16 << 20).generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert line["token_ids"] == ref.token_ids and line["text"] == ref.text and line["finish_reason"] == "length"


def test_bad_values_are_named_with_their_range():
    proc = subprocess.run([sys.executable, "-m", "meshserve", "generate", "--prompt", "x", "--temperature", "-1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "temperature must be in [0, 100]" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "meshserve", "generate", "--prompt", "x", "--kv-cache-memory", "lots"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "invalid byte size 'lots'" in proc.stderr


def test_device_defaults(monkeypatch):
    import torch

    from meshserve import config
    from meshserve.config import EngineConfig
    from meshserve.utils import cpuinfo

    # On a CPU, float weights compute in bfloat16 where the CPU multiplies it natively (with
    # AVX-512 BW/VL beside AVX512-BF16, which oneDNN needs to pack it), else in float32; quantized
    # weights keep float32 activations whatever the CPU.
    cases = [({"amx_bf16", "avx512_bf16", "avx512bw", "avx512vl"}, "bfloat16", "AMX"),
             ({"avx512_bf16", "avx512bw", "avx512vl", "avx512f"}, "bfloat16", "AVX512-BF16"),
             ({"avx512_bf16", "avx512f"}, "float32", "without AVX512-BF16"),
             ({"avx2", "fma"}, "float32", "without AVX512-BF16")]
    for flags, expected, reason in cases:
        monkeypatch.setattr(cpuinfo, "cpu_flags", lambda flags=flags: flags)
        name, why = config.auto_dtype("cpu", False)
        assert (name, reason in why) == (expected, True), (flags, name, why)
        assert config.auto_dtype("cpu", False, quantized=True)[0] == "float32"
        chosen = EngineConfig(device="cpu", quantization="none").dtype_choice()
        assert chosen == (getattr(torch, expected), why)
        assert EngineConfig(device="cpu", quantization="gguf").resolved_dtype() == torch.float32
    # oneDNN capped below a level (ONEDNN_MAX_CPU_ISA) cannot use it, whatever the CPU has
    monkeypatch.setattr(cpuinfo, "cpu_flags", lambda: cases[0][0] | {"avx512dq"})
    for cap, expected, reason in [("avx512_core_amx", "bfloat16", "AMX"), ("AVX10_1_512_AMX", "bfloat16", "AMX"),
                                  ("AVX512_CORE_BF16", "bfloat16", "AVX512-BF16"),
                                  ("AVX512_CORE_VNNI", "float32", "ONEDNN_MAX_CPU_ISA"),
                                  ("AVX2", "float32", "ONEDNN_MAX_CPU_ISA"), ("ALL", "bfloat16", "AMX"),
                                  ("no-such-level", "bfloat16", "AMX")]:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        cpuinfo._onednn_cap.cache_clear()  # read once per process, as oneDNN reads it
        name, why = config.auto_dtype("cpu", False)
        assert (name, reason in why) == (expected, True), (cap, name, why)
        assert cpuinfo.onednn_packs_bf16() == (cap != "AVX2")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    cpuinfo._onednn_cap.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = EngineConfig()
    monkeypatch.setattr(config, "_cuda_bf16_supported", lambda device: True)
    assert cfg.resolved_device().type == "cuda" and cfg.resolved_dtype() == torch.bfloat16
    monkeypatch.setattr(config, "_cuda_bf16_supported", lambda device: False)  # before Ampere
    assert cfg.resolved_dtype() == torch.float16
    assert EngineConfig(dtype="float32").resolved_dtype() == torch.float32


def test_enforce_eager_flag_reaches_the_engine_config():
    from meshserve.cli import build_parser
    from meshserve.config import EngineConfig

    parser = build_parser()
    for argv in (["serve"], ["generate", "--prompt", "x"]):
        assert EngineConfig.from_cli_args(parser.parse_args(argv)).enforce_eager is False
        assert EngineConfig.from_cli_args(parser.parse_args(argv + ["--enforce-eager"])).enforce_eager is True
