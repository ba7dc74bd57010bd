"""Layouts are checked against the model before any worker starts; steps split into pipeline
micro-batches that preserve every token and the sampling order; ranks get disjoint CPU shares."""
import json

import psutil
import pytest

from meshserve import LLM
from meshserve.models.model_config import ModelConfig
from meshserve.models.sharding import ShardedDims, check_parallel_layout, valid_tp_sizes
from meshserve.sampling_params import SamplingParams
from meshserve.worker.microbatch import split_microbatches
from meshserve.worker.step import SeqStep, StepInput


def _cfg(heads=8, kv=2, layers=4, inter=128) -> ModelConfig:
    return ModelConfig(hidden_size=heads * 8, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=inter, vocab_size=1000)


def test_valid_tp_sizes_follow_heads_and_kv_heads():
    assert valid_tp_sizes(ShardedDims.of(_cfg(8, 2))) == [1, 2, 4, 8]  # 4 and 8 replicate the 2 KV heads
    assert valid_tp_sizes(ShardedDims.of(_cfg(9, 3, inter=1536))) == [1, 3]  # SmolLM2-135M: 1536 does not split 9 ways
    assert valid_tp_sizes(ShardedDims.of(_cfg(12, 4, inter=96))) == [1, 2, 4, 12]  # 3 and 6: KV heads 4 vs 3 or 6
    assert valid_tp_sizes(ShardedDims.of(_cfg(8, 8, inter=36))) == [1, 2, 4]  # the MLP must split too


@pytest.mark.parametrize("tp,pp,split,message", [
    (3, 1, None, "tensor_parallel_size 3 cannot shard this model: it does not divide the 8 attention heads; "
                 "valid tensor_parallel_size values are 1, 2, 4, 8"),
    (1, 5, None, "pipeline_parallel_size 5 exceeds the model's 4 layers; valid sizes are 1..4"),
    (1, 2, [1, 2], "pipeline_split [1, 2] sums to 3 but the model has 4 layers"),
    (1, 2, [0, 4], "every stage needs at least one layer"),
])
def test_bad_layouts_are_refused_with_the_valid_sizes(tp, pp, split, message):
    with pytest.raises(ValueError) as err:
        check_parallel_layout(_cfg(), tp, pp, split)
    assert message in str(err.value)


def test_kv_heads_that_neither_divide_nor_are_divided_are_refused():
    with pytest.raises(ValueError, match="neither it nor the 4 KV heads divides the other; valid "
                                         "tensor_parallel_size values are 1, 2, 4, 12"):
        check_parallel_layout(_cfg(12, 4, inter=96), 6, 1, None)


def test_even_split_gives_earlier_stages_the_remainder():
    assert check_parallel_layout(_cfg(layers=7), 1, 3, None) == [3, 2, 2]


def test_llm_refuses_a_bad_tp_size_before_starting_processes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 128}))
    before = len(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="valid tensor_parallel_size values are 1, 2, 4, 8"):
        LLM(str(tmp_path), load_format="dummy", tensor_parallel_size=3)
    assert len(psutil.Process().children(recursive=True)) == before


def _step() -> StepInput:
    p = SamplingParams(temperature=0.0)
    return StepInput([
        SeqStep(1, list(range(10)), 0, [0], True, p),  # a whole prompt
        SeqStep(2, list(range(7)), 16, [1, 2], False),  # a prefill chunk that does not sample
        SeqStep(3, [5], 30, [3, 4], True, p),  # decodes
        SeqStep(4, [6], 40, [5, 6, 7], True, p),
    ], finished_seq_ids=[9])


def test_microbatches_balance_tokens_and_keep_order_and_sampling():
    step = _step()
    pieces = split_microbatches(step, 3)
    assert [sum(len(s.token_ids) for s in p.seqs) for p in pieces] == [6, 7, 6]
    flat = [(s.seq_id, s.start + i, t) for p in pieces for s in p.seqs for i, t in enumerate(s.token_ids)]
    assert flat == [(s.seq_id, s.start + i, t) for s in step.seqs for i, t in enumerate(s.token_ids)]
    assert [s.seq_id for p in pieces for s in p.seqs if s.sample] == [1, 3, 4]  # last piece of seq 1 only
    assert pieces[0].seqs[0].start == 0 and pieces[1].seqs[0].start == 6  # seq 1 continues where it stopped
    assert split_microbatches(step, 1) == [step]
    # A micro-batch keeps at least min_tokens: small (decode) steps are not cut into bandwidth-bound bits.
    assert [sum(len(s.token_ids) for s in p.seqs) for p in split_microbatches(step, 3, min_tokens=8)] == [10, 9]
    assert split_microbatches(step, 3, min_tokens=20) == [step]
    assert len(split_microbatches(StepInput([SeqStep(1, [3], 5, [0], True, None)]), 4)) == 1
