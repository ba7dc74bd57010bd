"""A decode forward on the path CUDA takes, checked on CPU: every registered architecture's tiny
model runs it without a host sync (so a CUDA graph can capture it), and a Llama layer stays within
its kernel budget. The CUDA path's layer choices are forced on CPU tensors (layers/fused.py), the
Triton kernels run in the interpreter, and linear layers take F.linear as on a GPU."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

import collections

import pytest
import torch
import triton.runtime.interpreter as interpreter
from tiny_model import tiny_runner
from torch.utils._python_dispatch import TorchDispatchMode

from meshserve.layers import fused
from meshserve.layers.attention import create_backend
from meshserve.models import registry
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

BLOCK = 8
aten = torch.ops.aten

_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
TINY = {  # what each architecture adds to tiny_model.TINY_CONFIG
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {},  # q/k/v bias
    "Qwen3MoeForCausalLM": {**_MOE, "norm_topk_prob": True, "head_dim": 16},  # q/k norms
    "Qwen2MoeForCausalLM": {**_MOE, "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]},
    "MixtralForCausalLM": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
}

# Ops that make the host wait for the device on CUDA: a scalar read, or an output whose size
# depends on the values (nonzero and the ops built on it, bincount sized by its largest value).
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.bincount.default, aten.unique_consecutive.default, aten._unique2.default, aten.unique_dim.default,
            aten.repeat_interleave.Tensor, aten.is_nonzero.default, aten.equal.default, aten.masked_scatter.default,
            aten.nonzero_numpy.default}
# Allocations and views launch no kernel.
NOT_KERNELS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.detach.default,
               aten._unsafe_view.default, aten.lift_fresh.default}


class DecodeOps(TorchDispatchMode):
    """Counts the aten ops that launch kernels, and Triton launches (whose interpreted bodies run
    on the device on a GPU, so the ops inside them are not counted); with `no_syncs`, raises on
    one that would make the host wait."""

    def __init__(self, no_syncs: bool = False):
        super().__init__()
        self.no_syncs, self.in_kernel = no_syncs, False
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.in_kernel:
            bool_index = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
            if self.no_syncs and (func in SYNC_OPS or bool_index):
                raise AssertionError(f"{func} makes the host wait for the device")
            if not func.is_view and func not in NOT_KERNELS:
                self.ops[str(func)] += 1
        return func(*args, **kwargs)


@pytest.fixture
def launches(monkeypatch):
    """F.linear for every matmul (no CPU packing), and Triton launches counted by the active
    DecodeOps (pushed on the returned list), which ignores the interpreter's own ops."""
    monkeypatch.setenv("MESHSERVE_DISABLE_CPU_KERNELS", "1")
    mode_box: list[DecodeOps] = []
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        if not mode_box:
            return run(self, *args, **kwargs)
        mode = mode_box[-1]
        mode.ops[f"triton:{self.fn.__name__}"] += 1
        mode.in_kernel = True
        try:
            return run(self, *args, **kwargs)
        finally:
            mode.in_kernel = False

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted_run)
    return mode_box


@pytest.fixture
def cuda_path(launches):
    """The CUDA path's layer choices on CPU tensors."""
    with fused.force_triton():
        yield launches


def _host_read_refused(monkeypatch, mode: DecodeOps):
    def refuse(name):
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, **k):
            if not mode.in_kernel:
                raise AssertionError(f"Tensor.{name} reads the device on the host")
            return real(self, *a, **k)
        return wrapped

    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


def _decode_forward(tmp_path, architecture: str, mode: DecodeOps, mode_box: list, layers: int = 2,
                    monkeypatch=None):
    config = {"architectures": [architecture], "num_hidden_layers": layers, **TINY[architecture]}
    tmp_path.mkdir(parents=True, exist_ok=True)
    runner = tiny_runner(tmp_path, block_size=BLOCK, config=config)
    backend = create_backend("triton", runner.attn_backend.spec, runner.device)
    caches = [torch.zeros(2, 8, BLOCK, runner.num_kv_heads, runner.head_dim) for _ in range(layers)]
    step = StepInput([SeqStep(0, [7], 5, [0], sample=True), SeqStep(1, [9], 17, [1, 2, 3], sample=True),
                      SeqStep(2, [3], 0, [4], sample=True)])
    ids, positions, meta = backend.build_inputs(pack_step(step, BLOCK))
    mode_box.append(mode)
    with torch.inference_mode():
        if monkeypatch is not None:
            with monkeypatch.context() as m:
                _host_read_refused(m, mode)
                with mode:
                    hidden = runner.model(ids, positions, caches, meta)
        else:
            with mode:
                hidden = runner.model(ids, positions, caches, meta)
    mode_box.pop()
    assert hidden.shape == (3, runner.model.cfg.hidden_size) and bool(torch.isfinite(hidden).all())
    return mode.ops


def test_every_architecture_has_a_tiny_config():
    registry.check_supported("LlamaForCausalLM")  # discovers every family
    assert set(registry._CLASSES) == set(TINY), "add the new architecture's tiny config to TINY"


@pytest.mark.parametrize("architecture", sorted(TINY))
def test_decode_forward_has_no_host_sync(tmp_path, cuda_path, monkeypatch, architecture):
    ops = _decode_forward(tmp_path, architecture, DecodeOps(no_syncs=True), cuda_path, monkeypatch=monkeypatch)
    assert ops["triton:_paged_attention_kernel"] == 2
    if "Moe" in architecture or "Mixtral" in architecture:
        assert ops["triton:_expert_matmul_kernel"] >= 2  # the grouped experts, not the host loop


def test_host_sync_check_catches_the_eager_expert_loop(tmp_path, launches, monkeypatch):
    """Without the Triton path the MoE block reads its token counts on the host: the check sees it."""
    with pytest.raises(AssertionError, match="reads the device|host wait"):
        _decode_forward(tmp_path, "MixtralForCausalLM", DecodeOps(no_syncs=True), launches, monkeypatch=monkeypatch)


LAYER_KERNEL_BUDGET = 12


def test_llama_decode_layer_kernel_budget(tmp_path, cuda_path):
    """Kernels a decoder layer adds to a decode step (4 layers minus 2): the fused norms, RoPE with
    the KV write, SiLU-and-mul, attention and four matmuls."""
    two = _decode_forward(tmp_path / "2", "LlamaForCausalLM", DecodeOps(), cuda_path, layers=2)
    four = _decode_forward(tmp_path / "4", "LlamaForCausalLM", DecodeOps(), cuda_path, layers=4)
    per_layer = {op: (four[op] - two[op]) / 2 for op in four if four[op] != two[op]}
    assert sum(per_layer.values()) <= LAYER_KERNEL_BUDGET, per_layer
    assert per_layer["triton:_add_rms_norm_kernel"] == 2 and per_layer["triton:_rope_and_cache_kernel"] == 1
    assert per_layer["triton:_silu_and_mul_kernel"] == 1
    assert two["aten.index.Tensor"] == 2 == four["aten.index.Tensor"]  # cos/sin gathered once per step


def test_pytorch_layer_path_is_what_the_budget_replaces(tmp_path, launches):
    """The same count with the element-wise work in PyTorch formulas (CPU kernels off, no Triton
    forcing): several times the budget."""
    two = _decode_forward(tmp_path / "2", "LlamaForCausalLM", DecodeOps(), launches, layers=2)
    four = _decode_forward(tmp_path / "4", "LlamaForCausalLM", DecodeOps(), launches, layers=4)
    assert (sum(four.values()) - sum(two.values())) / 2 > 2.5 * LAYER_KERNEL_BUDGET
