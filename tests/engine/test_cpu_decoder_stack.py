"""The C++ decoder-layer loop (models/cpu_decoder_stack.py) computes bit for bit what the module
path computes, for every kind of step the scheduler makes: fresh prompts (equal lengths batched
into one attention call, and not), a chunk after cached tokens, decodes, and all of them in one
step; and the layers it cannot run, and steps of other attention backends, keep the module path."""
import pytest
import torch
from tiny_model import tiny_runner

from meshserve.layers import cpu_gemm, cpu_kernels
from meshserve.layers.attention import create_backend
from meshserve.models.cpu_decoder_stack import CPUDecoderStack
from meshserve.models.llama import LlamaAttention, LlamaMLP
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

BLOCK = 8


def _steps() -> list[StepInput]:
    """Sequences 0 and 1: 12-token prompts (one batched attention call), 2: a 7-token prompt, then
    its next 6 tokens as a chunk over the cache alongside decodes of 0 and 1, then a 3-token prompt
    joining three decodes, then steps of decodes alone (fewer rows than the packed matmuls take: the
    weight panels, all layers in one parallel region where the panels run)."""
    toks = lambda n, base: [(base + 7 * i) % 100 + 1 for i in range(n)]  # noqa: E731
    tables = {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6]}
    return [
        StepInput([SeqStep(0, toks(12, 1), 0, tables[0], True), SeqStep(1, toks(12, 2), 0, tables[1], True),
                   SeqStep(2, toks(7, 3), 0, tables[2], False)]),
        StepInput([SeqStep(2, toks(6, 4), 7, tables[2], True), SeqStep(0, [5], 12, tables[0], True),
                   SeqStep(1, [6], 12, tables[1], True)]),
        StepInput([SeqStep(3, toks(3, 5), 0, tables[3], True), SeqStep(0, [7], 13, tables[0], True),
                   SeqStep(1, [8], 13, tables[1], True), SeqStep(2, [9], 13, tables[2], True)]),
        StepInput([SeqStep(0, [10], 14, tables[0], True), SeqStep(3, [11], 3, tables[3], True)]),  # unpacked rows
        StepInput([SeqStep(0, [12], 15, tables[0], True), SeqStep(1, [13], 14, tables[1], True),
                   SeqStep(2, [14], 14, tables[2], True), SeqStep(3, [15], 4, tables[3], True)]),
        StepInput([SeqStep(3, [16], 5, tables[3], True)]),  # batch 1
        StepInput([SeqStep(1, [17], 15, tables[1], True), SeqStep(2, [18], 15, tables[2], True),
                   SeqStep(3, [19], 6, tables[3], True)]),  # more sequences on one thread than the other
        # ten rows, past one register block of the panels (which read x as stored there on AVX-512);
        # their caches' first two slots never written: zeros, alike on both paths
        StepInput([SeqStep(s, [20 + s], 2, [4 + s], True) for s in range(4, 14)]),
    ]


def _decodes_only(step: StepInput) -> bool:
    return all(len(s.token_ids) == 1 and s.start > 0 for s in step.seqs)


# Head size 32 (hidden 128): bfloat16 prompts take the AMX prompt kernel where the CPU has it. Head
# size 64 (hidden 384, 3 KV heads of 2 query heads): bfloat16 decode attention takes the AVX512-BF16
# kernel where the CPU has it, a sequence's KV heads split between the threads (not on AMX).
@pytest.mark.parametrize("config,dtype", [({}, "float32"), ({"attention_bias": True}, "float32"),
                                          ({"num_key_value_heads": 4}, "float32"), ({}, "bfloat16"),
                                          ({"attention_bias": True}, "bfloat16"), ({"hidden_size": 128}, "bfloat16"),
                                          ({"hidden_size": 384, "num_attention_heads": 6, "num_key_value_heads": 3},
                                           "bfloat16")])
# 2 and 3 threads: a decode step's attention is shared out by KV head, one sequence's heads split
# between threads (and, with 3, a thread left without any).
@pytest.mark.parametrize("threads", [2, 3])
def test_stack_equals_module_path_bit_for_bit(tmp_path, config, dtype, isa, threads):
    assert cpu_kernels.available()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _stack_equals_module_path(tmp_path, config, dtype)
    finally:
        torch.set_num_threads(before)


def _stack_equals_module_path(tmp_path, config, dtype):
    runner = tiny_runner(tmp_path, block_size=BLOCK, config=config, dtype=dtype)
    if "hidden_size" in config:
        q = torch.zeros(12, 4, runner.head_dim, dtype=torch.bfloat16)
        assert cpu_kernels.prefill_usable(q, 1) == (cpu_kernels.panel_bf16_isa() == "amx")
    model = runner.model
    stack = model.cpu_stack
    assert stack is not None, f"the tiny Llama on CPU {dtype} must take the C++ loop"
    assert runner.attn_backend.name == "cpu"
    if config.get("attention_bias"):
        assert all(layer.self_attn.qkv_proj.bias is not None for layer in model.layers.values())
    shape = (2, 18, BLOCK, runner.num_kv_heads, runner.head_dim)
    fast_caches = [torch.zeros(shape, dtype=getattr(torch, dtype)) for _ in model.layers]
    plain_caches = [c.clone() for c in fast_caches]
    fused = cpu_kernels.fused_decode_steps()
    with torch.inference_mode():
        for step in _steps():
            ids, positions, meta = runner.attn_backend.build_inputs(pack_step(step, BLOCK))
            model.cpu_stack = stack
            fast = model(ids, positions, fast_caches, meta)
            model.cpu_stack = None
            plain = model(ids, positions, plain_caches, meta)
            assert torch.equal(fast, plain)
            for a, b in zip(fast_caches, plain_caches):
                assert torch.equal(a, b)
    assert fast.abs().sum() > 0
    # every decode-only step took the one-region loop wherever this CPU runs the panels
    decode_steps = sum(map(_decodes_only, _steps())) if cpu_gemm.panel_max_rows(getattr(torch, dtype)) else 0
    assert cpu_kernels.fused_decode_steps() - fused == decode_steps


def test_a_bad_decode_step_is_refused_before_the_threads_start(tmp_path):
    """A slot outside the cache is an error the caller sees (the step fails), never a write out of
    bounds or an exception inside the parallel region (which would end the process)."""
    runner = tiny_runner(tmp_path, block_size=BLOCK)
    model = runner.model
    assert model.cpu_stack is not None and cpu_gemm.panel_max_rows(torch.float32) > 0
    shape = (2, 8, BLOCK, runner.num_kv_heads, runner.head_dim)
    caches = [torch.zeros(shape) for _ in model.layers]
    ids, positions, meta = runner.attn_backend.build_inputs(pack_step(_steps()[-3], BLOCK))
    meta.slot_mapping[0] = 8 * BLOCK  # one past the last slot
    with torch.inference_mode(), pytest.raises(RuntimeError, match="out of range"):
        model(ids, positions, caches, meta)
    assert all(c.abs().sum() == 0 for c in caches)  # nothing was written before the refusal


def test_layers_it_cannot_run_keep_the_module_path(tmp_path):
    moe = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    assert tiny_runner(tmp_path, block_size=BLOCK, config=moe).model.cpu_stack is None
    layers = list(tiny_runner(tmp_path, block_size=BLOCK).model.layers.values())
    assert CPUDecoderStack.build(layers, 2, LlamaAttention, LlamaMLP) is None  # the all-reduces stay in the module path
    assert CPUDecoderStack.build(layers, 1, LlamaAttention, LlamaMLP) is not None
    assert CPUDecoderStack.build(layers, 1, LlamaAttention, torch.nn.Module) is None  # an MLP it does not know


def test_only_the_cpu_backends_steps_take_the_stack(tmp_path):
    runner = tiny_runner(tmp_path, block_size=BLOCK)
    stack, packed = runner.model.cpu_stack, pack_step(_steps()[1], BLOCK)
    caches = [torch.zeros(2, 8, BLOCK, runner.num_kv_heads, runner.head_dim) for _ in runner.model.layers]
    with torch.inference_mode():
        for name, accepted in (("cpu", True), ("torch", False)):
            ids, _, meta = create_backend(name, runner.attn_backend.spec, runner.device).build_inputs(packed)
            assert stack.accepts(runner.model.embed_tokens(ids), caches, meta) is accepted


def test_disabled_with_the_cpu_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHSERVE_DISABLE_CPU_KERNELS", "1")
    assert tiny_runner(tmp_path, block_size=BLOCK).model.cpu_stack is None


def test_repacking_after_a_weight_change_reaches_the_stack(tmp_path):
    from meshserve.layers.cpu_gemm import prepack_model

    runner = tiny_runner(tmp_path, block_size=BLOCK)
    model = runner.model
    for layer in model.layers.values():
        layer.mlp.gate_up_proj.weight.data.mul_(3.0)
    prepack_model(model)  # new packed copies: the stack must not keep the old ones
    ids, positions, meta = runner.attn_backend.build_inputs(pack_step(_steps()[1], BLOCK))  # 8 rows: packed
    shape = (2, 8, BLOCK, runner.num_kv_heads, runner.head_dim)
    outs = []
    with torch.inference_mode():
        for stack in (model.cpu_stack, None):
            model.cpu_stack = stack
            outs.append(model(ids, positions, [torch.zeros(shape) for _ in model.layers], meta))
    assert torch.equal(outs[0], outs[1])
