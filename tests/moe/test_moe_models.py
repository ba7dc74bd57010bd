"""Each MoE family, loaded from a HF directory, generates transformers' eager greedy tokens; the
config parser reads each family's MoE fields; bad expert-parallel layouts fail with clear errors."""
import json

import pytest
from moe_helpers import ENGINE_ARGS, run_greedy

from meshserve import LLM
from meshserve.models.model_config import ModelConfig


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_family_matches_transformers(tiny_moe, family):
    path, reference = tiny_moe(family)
    ids, load, _ = run_greedy(path)
    assert ids == reference
    cfg = ModelConfig.from_json_file(f"{path}/config.json")
    assert load["layers"] == [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    # Every token of every step is routed to k experts in every MoE layer.
    routed = [sum(row) for row in load["tokens"]]
    assert len(set(routed)) == 1 and routed[0] % cfg.num_experts_per_tok == 0


def test_parser_reads_each_family(tiny_moe):
    q3 = ModelConfig.from_json_file(f"{tiny_moe('qwen3_moe')[0]}/config.json")
    assert (q3.num_experts, q3.num_experts_per_tok, q3.moe_intermediate_size) == (8, 2, 32)
    assert q3.norm_topk_prob and q3.qk_norm and not q3.attention_bias
    q2 = ModelConfig.from_json_file(f"{tiny_moe('qwen2_moe')[0]}/config.json")
    assert q2.shared_expert_intermediate_size == 48 and q2.attention_bias and not q2.norm_topk_prob
    assert [q2.is_moe_layer(i) for i in range(3)] == [True, False, True]
    mx = ModelConfig.from_json_file(f"{tiny_moe('mixtral')[0]}/config.json")
    assert (mx.num_experts, mx.moe_intermediate_size, mx.norm_topk_prob) == (4, 32, True)
    # A config written back from the parsed one parses to the same geometry (GGUF conversion uses it).
    for cfg in (q3, q2, mx):
        again = ModelConfig.from_hf_config(json.loads(json.dumps(cfg.to_hf_config())))
        assert again == cfg


def test_expert_parallel_layout_errors(tiny_moe, tmp_path):
    mixtral = tiny_moe("mixtral")[0]  # 4 experts, 8 heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size 8 cannot shard this model with expert parallelism: "
                                         r".*does not divide the 4 experts; .* are 1, 2, 4$"):
        LLM(mixtral, tensor_parallel_size=8, enable_expert_parallel=True, **ENGINE_ARGS)
    dense = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(dense))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model.*--enable-expert-parallel"):
        LLM(str(tmp_path / "config.json"), load_format="dummy", tensor_parallel_size=2,
            enable_expert_parallel=True, **ENGINE_ARGS)
