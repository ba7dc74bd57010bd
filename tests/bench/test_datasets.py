"""Request sets: exact prompt token counts, reproducibility, the file formats."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from meshserve.bench.config import DatasetConfig, parse_goodput
from meshserve.bench.datasets import (
    fit_prompt,
    load_requests,
    prefix_requests,
    random_requests,
    token_space,
)
from meshserve.bench.tokenization import LocalTokenizer

from .fake_server import ToyTokenizer


class InProcessToy:
    """The fake server's tokenizer, without HTTP."""

    def __init__(self) -> None:
        self.tok = ToyTokenizer()

    async def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    async def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def count(tok, text: str) -> int:
    return len(asyncio.run(tok.encode(text)))


def test_naive_decode_reencode_drifts_and_fit_corrects_it():
    tok = InProcessToy()
    space = asyncio.run(token_space(tok))
    assert space.n_special == 1  # the toy tokenizer's BOS
    rng = np.random.default_rng(0)
    drifted = 0
    for target in (20, 100, 400):
        naive = tok.tok.decode(list(rng.choice(space.pool, size=target - 1)))
        drifted += count(tok, naive) != target
        assert count(tok, asyncio.run(fit_prompt(tok, target, rng, space))) == target
    assert drifted, "the toy tokenizer should merge pieces, or this test proves nothing"


def test_random_prompts_have_exact_lengths_and_repeat_with_the_seed():
    tok = InProcessToy()
    cfg = DatasetConfig(num_prompts=12, input_len=60, output_len=20, range_ratio=0.5, seed=3)
    reqs = asyncio.run(random_requests(cfg, tok))
    assert len(reqs) == 12
    assert all(count(tok, r.prompt) == r.prompt_len for r in reqs)
    assert all(30 <= r.prompt_len <= 90 and 10 <= r.output_len <= 30 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1  # the range ratio is applied
    again = asyncio.run(random_requests(cfg, tok))
    assert reqs == again
    other = asyncio.run(random_requests(DatasetConfig(num_prompts=12, input_len=60, seed=4), tok))
    assert [r.prompt for r in other] != [r.prompt for r in reqs]


def test_prefix_prompts_share_a_prefix_of_the_requested_length():
    tok = InProcessToy()
    cfg = DatasetConfig(name="prefix", num_prompts=6, input_len=20, prefix_len=50, num_prefixes=2)
    reqs = asyncio.run(prefix_requests(cfg, tok))
    assert all(r.prompt_len == 70 and count(tok, r.prompt) == 70 for r in reqs)
    heads = [r.prompt.split("\n")[0] for r in reqs]
    assert heads[0] == heads[2] == heads[4] and heads[1] == heads[3] == heads[5]
    assert heads[0] != heads[1] and count(tok, heads[0]) == 50
    assert len({r.prompt for r in reqs}) == 6  # suffixes are unique


def test_local_hf_tokenizer_gives_exact_lengths(tmp_path):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog " * 3,
              "people think that time goes faster when they work on something they like",
              "every state has a government that makes the law for the world"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    local = LocalTokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert asyncio.run(local.encode("")) == [0]
    assert asyncio.run(token_space(local)).n_special == 1
    reqs = asyncio.run(random_requests(DatasetConfig(num_prompts=8, input_len=40), local))
    assert all(len(tok.encode(r.prompt).ids) == 40 for r in reqs)


def test_sharegpt_uses_first_turns_and_skips_unusable(tmp_path):
    tok = InProcessToy()
    convs = [
        {"conversations": [{"from": "human", "value": "tell me about the quick brown fox"},
                           {"from": "gpt", "value": "the fox jumps over the lazy dog often"}]},
        {"conversations": [{"from": "human", "value": "hi"},  # too short: skipped
                           {"from": "gpt", "value": "hello there my friend"}]},
        {"conversations": [{"from": "human", "value": "only one turn here"}]},  # skipped
        {"conversations": [{"from": "human", "value": "what makes the law in every state"},
                           {"from": "gpt", "value": "a government makes the law there"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    cfg = DatasetConfig(name="sharegpt", path=str(path), num_prompts=2)
    reqs = asyncio.run(load_requests(cfg, tok))
    assert sorted(r.prompt for r in reqs) == sorted([convs[0]["conversations"][0]["value"],
                                                     convs[3]["conversations"][0]["value"]])
    for r in reqs:
        reply = next(c["conversations"][1]["value"] for c in convs
                     if c["conversations"][0]["value"] == r.prompt)
        assert r.output_len == count(tok, reply) and r.prompt_len == count(tok, r.prompt)
    fixed = DatasetConfig(name="sharegpt", path=str(path), num_prompts=2, sharegpt_output_len=7)
    assert {r.output_len for r in asyncio.run(load_requests(fixed, tok))} == {7}
    with pytest.raises(ValueError, match="2 usable conversations"):
        asyncio.run(load_requests(DatasetConfig(name="sharegpt", path=str(path), num_prompts=3),
                                  tok))


def test_jsonl_keeps_file_order_and_validates(tmp_path):
    path = tmp_path / "reqs.jsonl"
    path.write_text('{"prompt": "the quick fox", "max_tokens": 5}\n\n'
                    '{"prompt": "the lazy dog", "output_len": 9}\n')
    reqs = asyncio.run(load_requests(DatasetConfig(name="jsonl", path=str(path)), None))
    assert [(r.prompt, r.output_len, r.prompt_len) for r in reqs] == \
        [("the quick fox", 5, None), ("the lazy dog", 9, None)]
    with pytest.raises(ValueError, match="exceeds the 2 lines"):
        asyncio.run(load_requests(DatasetConfig(name="jsonl", path=str(path), num_prompts=3),
                                  None))
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="line 1"):
        asyncio.run(load_requests(DatasetConfig(name="jsonl", path=str(path)), None))


@pytest.mark.parametrize("kwargs, message", [
    ({"range_ratio": 1.0}, "random-range-ratio"),
    ({"name": "sharegpt"}, "needs --dataset-path"),
    ({"name": "bogus"}, "bogus"),
    ({"num_prompts": 0}, "num-prompts"),
])
def test_dataset_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DatasetConfig(**kwargs)


def test_goodput_parsing():
    assert parse_goodput(["ttft:1500", "TPOT:80"]) == {"ttft": 1500.0, "tpot": 80.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["e2el:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
