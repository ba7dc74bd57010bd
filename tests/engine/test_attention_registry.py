"""The attention backend registry: which backend each device gets and why, a clear error for a name
nobody registered, which backends CUDA graphs can capture, that each builds metadata of its own
type naming itself, and that importing the package leaves Triton unimported."""
import logging
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

import pytest
import torch

import meshserve
from meshserve.layers.attention import (
    AttentionSpec,
    backend_class,
    backend_names,
    choose_backend,
    create_backend,
    register_backend,
    select_backend,
)
from meshserve.layers.attention.torch_ref import TorchBackend
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, block_size=8)


def test_the_three_backends_are_registered():
    assert backend_names() == ["cpu", "torch", "triton"]


def test_cpu_selects_the_cpu_backend_and_logs_why(caplog):
    with caplog.at_level(logging.INFO, logger="meshserve.layers.attention.registry"):
        backend = select_backend(torch.device("cpu"), SPEC)
    assert backend.name == "cpu" and backend.spec == SPEC and backend.device == torch.device("cpu")
    assert any("attention backend cpu" in r.getMessage() for r in caplog.records)


def test_cuda_gets_triton_when_installed_else_the_reference():
    assert choose_backend("cuda", triton_installed=True)[0] == "triton"
    name, reason = choose_backend("cuda", triton_installed=False)
    assert name == "torch" and "Triton is not installed" in reason
    assert choose_backend("mps")[0] == "torch"  # a device without a backend of its own


def test_an_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*cpu, torch, triton"):
        create_backend("flash", SPEC, "cpu")


def test_a_second_backend_under_a_taken_name_is_refused():
    class Impostor(TorchBackend):
        name = "torch"

    with pytest.raises(ValueError, match="two attention backends named 'torch'"):
        register_backend(Impostor)
    assert backend_class("torch") is TorchBackend


def test_only_triton_supports_cuda_graphs():
    assert {name: backend_class(name).supports_cuda_graphs for name in backend_names()} == \
        {"cpu": False, "torch": False, "triton": True}
    with pytest.raises(NotImplementedError, match="cpu attention backend"):
        create_backend("cpu", SPEC, "cpu").decode_graph_metadata(torch.zeros(1, dtype=torch.long),
                                                                 torch.zeros(1, 1, dtype=torch.long),
                                                                 torch.ones(1, dtype=torch.long))


@pytest.mark.parametrize("name", ["cpu", "torch", "triton"])
def test_each_backend_builds_its_own_metadata(name):
    step = StepInput([SeqStep(0, [1, 2, 3], 0, [0], True), SeqStep(1, [4], 9, [1, 2], True)])
    packed = pack_step(step, SPEC.block_size)
    backend = create_backend(name, SPEC, "cpu")
    ids, positions, meta = backend.build_inputs(packed)
    assert type(meta) is backend.metadata_type and meta.backend is backend
    assert ids.tolist() == packed.input_ids and positions.tolist() == packed.positions
    assert meta.slot_mapping.tolist() == packed.slot_mapping and meta.num_prefill_tokens == 3
    # Triton keeps its decode tables on the device, wider than this step's (they grow in powers of
    # two): what lies past a row's blocks is never read, the context lengths bound every read.
    assert meta.decode_context_lens.tolist() == [10] and meta.decode_block_tables[:, :2].tolist() == [[1, 2]]


def test_importing_the_package_does_not_import_triton():
    code = "import sys, meshserve.layers.attention; assert 'triton' not in sys.modules, 'triton imported'"
    root = os.path.dirname(os.path.dirname(meshserve.__file__))  # this checkout, not an installed copy
    env = {**os.environ, "PYTHONPATH": root}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)
