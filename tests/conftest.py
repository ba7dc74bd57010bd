import os

# Tests must not depend on the developer's cache, and must not reach any network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest


def make_peaked_model(path, num_layers: int = 2, vocab_size: int = 49152):
    """A tiny random Llama with the embedded model's tokenizer, written with transformers. Its LM head
    is scaled up so that the top logits stand far apart: greedy choices then never hinge on float
    rounding, and a greedy token sequence is a well-defined answer to compare across batches."""
    import torch
    import transformers

    from meshserve.models.loader import resolve_model

    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(500.0)
    model.save_pretrained(path, safe_serialization=True)
    resolve_model("default").load_tokenizer().save_hf(path)
    return path


@pytest.fixture(scope="session")
def peaked_model(tmp_path_factory) -> str:
    return str(make_peaked_model(tmp_path_factory.mktemp("peaked")))
