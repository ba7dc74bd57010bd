"""The engine generates the same tokens on every attention backend (the Triton kernels in the
interpreter here, the PyTorch reference, the CPU backend with its C++ paths): chunked prefill,
prefix-cache hits within and across steps, and decodes."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

from tiny_model import write_tiny_config

from meshserve import LLM, SamplingParams
from meshserve.layers.attention import create_backend
from meshserve.layers.cpu_gemm import prepack_model

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _generate(config_path, backend: str) -> list[list[int]]:
    llm = LLM(str(config_path), load_format="dummy", dtype="float32", device="cpu", block_size=8,
              max_num_batched_tokens=40, max_model_len=128, kv_cache_memory_bytes=1 << 20, seed=3)
    runner = llm.engine.executor.runner
    runner.attn_backend = create_backend(backend, runner.attn_backend.spec, runner.device)
    # Random weights of std 0.02 make attention nearly uniform, which would hide a wrong kernel:
    # sharper queries and keys make every score matter.
    for layer in runner.model.layers.values():
        layer.self_attn.qkv_proj.weight.data.mul_(10.0)
    prepack_model(runner.model)  # the packed CPU copy must follow the weights
    shared = list(range(20, 44))  # three full blocks
    first = llm.generate([shared + [1, 2, 3], [t % 97 for t in range(50, 120)]], GREEDY)  # 70 tokens: two chunks
    again = llm.generate([shared + [4, 5], shared + [6]], GREEDY)  # prefix hits on the cached blocks
    llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in first + again]


def test_every_backend_generates_what_the_cpu_backend_generates(tmp_path):
    config_path = write_tiny_config(tmp_path)
    expected = _generate(config_path, "cpu")
    assert _generate(config_path, "torch") == expected
    assert _generate(config_path, "triton") == expected
    assert len(set(map(tuple, expected))) > 1  # the prompts lead to different continuations
