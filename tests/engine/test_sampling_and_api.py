"""Sampling parameters, stop conditions, logprobs and argument validation on the embedded model."""
import math

import pytest

from meshserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    # Float32 weights: the GGUF blocks' decode rows round activations to int8, prompt rows do not, so
    # their outputs may depend on how a step is batched (docs/quantization.md).
    return LLM(dtype="float32", quantization="none", max_model_len=256, kv_cache_memory_bytes=64 << 20,
               max_num_batched_tokens=512)


def text_of(out, i=0):
    return out.outputs[i].text


def ids_of(out, i=0):
    return out.outputs[i].token_ids


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Tell me a story about a dragon", p)[0]
    others = SamplingParams(temperature=1.2, max_tokens=8, ignore_eos=True)
    batch = llm.generate(["Random noise here", "Tell me a story about a dragon", "Another prompt"],
                         [others, p, others])
    assert ids_of(batch[1]) == ids_of(alone)
    other_seed = llm.generate("Tell me a story about a dragon",
                              SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=12, ignore_eos=True))
    assert ids_of(other_seed[0]) != ids_of(alone)


def test_n_samples_and_top_k_1_equals_greedy(llm):
    prompt = "The weather today is"
    greedy = ids_of(llm.generate(prompt, GREEDY)[0])
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0.9, top_k=1, max_tokens=12, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == greedy for o in out.outputs)
    varied = llm.generate(prompt, SamplingParams(n=4, temperature=1.5, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert len({tuple(o.token_ids) for o in varied.outputs}) > 1
    tiny_p = llm.generate(prompt, SamplingParams(temperature=1.0, top_p=1e-6, seed=3, max_tokens=12, ignore_eos=True))
    assert ids_of(tiny_p[0]) == greedy
    min_p = llm.generate(prompt, SamplingParams(temperature=1.0, min_p=1.0, seed=3, max_tokens=12, ignore_eos=True))
    assert ids_of(min_p[0]) == greedy


def test_penalties_reduce_repetition(llm):
    prompt = "1, 1, 1, 1, 1, 1, 1, 1,"
    plain = ids_of(llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0])
    for kw in (dict(frequency_penalty=2.0), dict(repetition_penalty=1.8)):
        pen = ids_of(llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **kw))[0])
        assert len(set(pen)) > len(set(plain)), kw


def test_logprobs(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and len(lp) in (3, 4)
        assert lp[tok] == pytest.approx(max(lp.values()))  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values()) and sum(math.exp(v) for v in lp.values()) <= 1.0 + 1e-5


def test_stop_strings_and_stop_token_ids(llm):
    prompt = "Write the numbers from one to ten in words:"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    stop = full.text[8:11]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert text_of(cut) == full.text[:full.text.index(stop)]
    keep = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True))[0]
    assert text_of(keep) == full.text[:full.text.index(stop) + len(stop)]
    tid = full.token_ids[3]
    by_id = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[tid]))[0]
    assert ids_of(by_id) == full.token_ids[:full.token_ids.index(tid) + 1]
    assert by_id.outputs[0].finish_reason == "stop" and by_id.outputs[0].stop_reason == tid


def test_eos_max_tokens_and_max_model_len(llm):
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=100))[0]
    assert chat.outputs[0].finish_reason == "stop" and len(ids_of(chat)) < 100
    assert ids_of(chat)[-1] in llm.engine.eos_token_ids
    capped = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(ids_of(capped)) == 5 and capped.outputs[0].finish_reason == "length"
    ids = llm.get_tokenizer().encode("word " * 300)[:253]
    edge = llm.generate([ids], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(ids_of(edge)) == 3 and edge.outputs[0].finish_reason == "length"


def test_token_id_prompts_and_chat_equal_their_text_forms(llm):
    tok = llm.get_tokenizer()
    text = "A short poem about autumn:"
    assert ids_of(llm.generate([tok.encode(text)], GREEDY)[0]) == ids_of(llm.generate(text, GREEDY)[0])
    msgs = [{"role": "user", "content": "Name a color."}]
    templated = tok.apply_chat_template(msgs)
    assert ids_of(llm.chat(msgs, GREEDY)[0]) == ids_of(llm.generate([tok.encode(templated)], GREEDY)[0])


def test_abort_returns_blocks(llm):
    eng = llm.engine
    free = eng.block_manager.num_free_blocks
    eng.add_request("to-abort", "A long story begins " * 10, SamplingParams(max_tokens=50))
    eng.step()
    assert eng.block_manager.num_free_blocks < free
    eng.abort_request("to-abort")
    assert eng.block_manager.num_free_blocks == free and not eng.has_unfinished_requests()
    eng.abort_request("to-abort")  # unknown by now: a no-op
    assert eng.step() == []


@pytest.mark.parametrize("kwargs,name", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=0), "top_k"),
    (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_before_any_model_work(llm):
    eng = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine prompt", "word " * 400], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 10**9]], GREEDY)
    assert not eng.has_unfinished_requests()  # the good prompt of the batch was withdrawn too


def test_engine_config_validation():
    from meshserve.config import EngineConfig
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLM(kv_cache_memory_bytes=1 << 20, max_model_len=2048)


def test_final_only_requests_get_one_delta_with_the_streamed_text(llm):
    """LLM.generate's requests (final_only) get their whole output in one delta when they end: the
    same tokens and text as a request streamed step by step, stop strings included."""
    engine = llm.engine
    prompt = "Write a short poem about the sea:"
    full = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    stop_text = llm.generate(prompt, full)[0].outputs[0].text[5:8]
    cases = {"plain": full, "stop": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_text])}
    deltas: dict[str, list] = {}
    for name, params in cases.items():
        for final_only in (False, True):
            engine.add_request(f"{name}-{final_only}", prompt, params, final_only=final_only)
            deltas[f"{name}-{final_only}"] = []
    while engine.has_unfinished_requests():
        for d in engine.step():
            deltas[d.request_id].append(d)
    for name in cases:
        streamed, final = deltas[f"{name}-False"], deltas[f"{name}-True"]
        assert len(streamed) > 1 and len(final) == 1 and final[0].finished
        text = "".join(o.text for d in streamed for o in d.outputs)
        assert final[0].outputs[0].text == text
        assert final[0].outputs[0].token_ids == [t for d in streamed for o in d.outputs for t in o.token_ids]
        assert final[0].outputs[0].finish_reason == streamed[-1].outputs[0].finish_reason
    assert deltas["stop-True"][0].outputs[0].finish_reason == "stop"
    assert stop_text not in deltas["stop-True"][0].outputs[0].text
