"""Greedy float32 token ids equal Hugging Face transformers on the same dequantized weights,
with prefix caching on and off, with chunked prefill, and under preemption."""
import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.models.loader import resolve_model

NEW_TOKENS = 32
DOC = ("The history of the printing press begins in the fifteenth century, when movable type "
       "changed how books were produced across Europe. Before that, manuscripts were copied by hand. ")


def _prompts(tok):
    chat = lambda text: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),  # noqa: E731
                                   add_special_tokens=False)
    long_doc = DOC * 12
    prompts = [
        tok.encode("Hello there, my friend"),
        tok.encode("def fibonacci(n):"),
        chat("What is the capital of France?"),
        chat("Write a haiku about the sea."),
        tok.encode(long_doc + "Summarize the text above in one sentence:"),
        tok.encode(long_doc + "Which century is mentioned in the text?"),  # shares a long prefix
        chat(DOC * 4 + "Explain this to a child."),
        tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,"),
        tok.encode("Once upon a time in"),
    ]
    lens = [len(p) for p in prompts]
    assert min(lens) >= 5 and max(lens) <= 400, lens
    assert any(l > 300 for l in lens)
    return prompts


@pytest.fixture(scope="module")
def reference():
    import transformers

    source = resolve_model("default")
    tok = source.load_tokenizer()
    prompts = _prompts(tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf(torch.tensor([ids]), use_cache=True)
            past, seq = out.past_key_values, []
            for _ in range(NEW_TOKENS):
                nxt = int(out.logits[0, -1].argmax())
                seq.append(nxt)
                out = hf(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            expected.append(seq)
    return prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
BLOCK_BYTES = 2 * 30 * 3 * 64 * 16 * 4  # SmolLM2 float32, 16-token blocks


@pytest.mark.parametrize("name,kwargs", [
    ("prefix_caching", dict(enable_prefix_caching=True)),
    ("no_prefix_caching", dict(enable_prefix_caching=False)),
    ("chunked_prefill", dict(max_num_batched_tokens=48)),
    ("prefill_chunks_with_decodes", dict(max_num_batched_tokens=48, prefill_chunk_with_decodes=16)),
    ("preemption", dict(kv_cache_memory_bytes=40 * BLOCK_BYTES, max_model_len=512)),
])
def test_greedy_matches_transformers(reference, name, kwargs):
    prompts, expected = reference
    # transformers runs the float32 weights: so does the engine (the file's blocks: test_quantization.py)
    config = dict(dtype="float32", quantization="none", max_model_len=1024, kv_cache_memory_bytes=512 * BLOCK_BYTES)
    config.update(kwargs)
    llm = LLM(**config)
    engine = llm.engine
    free_at_start = engine.block_manager.num_free_blocks
    budget = engine.scheduler.max_num_batched_tokens
    real_schedule = engine.scheduler.schedule
    seen_batches = []

    capped_steps = []

    def spy():
        # The cap gives way to a backlog of more prompt tokens than one step takes.
        backlog = sum(s.num_tokens - s.num_computed_tokens for s in engine.scheduler.waiting)
        out = real_schedule()
        seen_batches.append(out.num_batched_tokens)
        prefill = sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1)
        if any(s.num_tokens == 1 for s in out.scheduled) and prefill and backlog <= budget:
            capped_steps.append(prefill)
        return out

    engine.scheduler.schedule = spy
    outs = llm.generate(prompts, GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens) diverges under {name}"
    assert engine.block_manager.num_free_blocks == free_at_start  # no block leaked
    assert max(seen_batches) <= budget
    if name == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if name == "chunked_prefill":
        assert max(seen_batches) == 48
    if name == "prefill_chunks_with_decodes":  # prompts joined decoding steps in chunks of <= 16
        assert capped_steps and max(capped_steps) <= 16
    if name == "prefix_caching":
        assert engine.block_manager.prefix_hits > 0
