"""Loading paths: HF directories (Llama with Llama-3 rope scaling and untied embeddings, Qwen2 with
attention bias), dummy weights from a config.json, and the cached GGUF conversion."""
import json

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.models import loader


def _save_tiny(tmp_path, arch: str):
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=True, rope_theta=10000.0, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, **common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init, so that greedy paths are not flat
        for name, p in model.named_parameters():
            if "norm" not in name:  # weights and Qwen2's q/k/v biases
                p.normal_(0, 0.2)
    model.eval().save_pretrained(tmp_path, safe_serialization=True)
    loader.resolve_model("default").load_tokenizer().save_hf(tmp_path)
    return model


def _hf_greedy(model, ids, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_hf_directory_matches_transformers(tmp_path, arch):
    model = _save_tiny(tmp_path, arch)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is (arch == "qwen2")
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=40)
    prompts = [[5, 17, 300, 42] * k for k in (2, 5, 30)]  # up to 120 tokens: past the 64-token rope boundary
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(model, ids, 10)


def test_dummy_weights_from_a_config_json(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 1000,
           "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path / "config.json"), load_format="dummy", kv_cache_memory_bytes=4 << 20)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and all(0 <= t < 1000 for t in out.outputs[0].token_ids)
    assert llm.engine.model_info.revision == "dummy"


def test_gguf_conversion_is_cached(monkeypatch):
    first = loader.resolve_model("default")

    def no_convert(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(loader, "convert_gguf", no_convert)
    again = loader.resolve_model("default")
    assert again.path == first.path and again.revision == first.revision and len(first.revision) == 16


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="never downloaded"):
        loader.resolve_model("meta-llama/Llama-3.1-8B")


def test_architectures_come_from_the_registry(tmp_path, monkeypatch):
    """config.json's architecture selects the class; an unknown one is refused before loading,
    naming the supported ones; a family registered in a new module is found the same way."""
    from meshserve.models import registry
    from meshserve.models.llama import LlamaForCausalLM
    assert registry.model_class("Qwen2ForCausalLM") is LlamaForCausalLM
    assert registry.architecture_of_gguf("qwen2") == "Qwen2ForCausalLM"
    cfg = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*not supported; supported: .*LlamaForCausalLM"):
        loader.resolve_model(str(tmp_path / "config.json"), load_format="dummy")
    monkeypatch.setattr(registry, "_CLASSES", dict(registry._CLASSES))

    @registry.register_model("GPTNeoXForCausalLM")
    class Family:
        pass

    assert registry.model_class("GPTNeoXForCausalLM") is Family
    assert loader.resolve_model(str(tmp_path / "config.json"), load_format="dummy").config.num_hidden_layers == 1


def test_concurrent_revision_hashing_shares_the_cache_dir_safely(tmp_path, monkeypatch):
    """Engines starting together hash their weights at once: each writes the memo through its own
    temporary file, so none fails on another's rename and every revision is right."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    files = []
    for i in range(16):
        f = tmp_path / f"w{i}.safetensors"
        f.write_bytes(bytes([i]) * 1000)
        files.append(f)
    with ThreadPoolExecutor(8) as pool:
        revisions = list(pool.map(lambda f: loader._file_sha256([f]), files * 3))
    assert revisions == [hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in files * 3]
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_one_cache_directory_rule(tmp_path, monkeypatch):
    from meshserve.plan.calibration import default_calibration_path
    from meshserve.utils.paths import cache_dir
    monkeypatch.delenv("MESHSERVE_CALIBRATION_FILE", raising=False)
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "a" and default_calibration_path() == tmp_path / "a" / "calibration.json"
    monkeypatch.delenv("MESHSERVE_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "meshserve" == default_calibration_path().parent
