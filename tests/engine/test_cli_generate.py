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

    if not torch.cuda.is_available():
        assert EngineConfig().dtype_choice() == (torch.float32, config.auto_dtype("cpu", False)[1])
    # auto stays float32 on a CPU; with AMX the start-up log points at the faster setting.
    for amx in (True, False):
        monkeypatch.setattr(config, "cpu_has_amx_bf16", lambda amx=amx: amx)
        name, why = config.auto_dtype("cpu", False)
        assert name == "float32" and ("--dtype bfloat16" in why) == amx
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
