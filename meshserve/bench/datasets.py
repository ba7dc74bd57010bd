"""Request sets: synthetic (random, prefix) and replayed (sharegpt, jsonl).

Synthetic prompts have exactly the requested token count *as the server tokenizes them*.
Decoding random token ids and re-encoding the text rarely gives back the same number of
tokens (pieces merge or split across boundaries), so each prompt is corrected in a loop:
decode, count, then drop or add ids by the difference until the count is exact.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshserve.bench.config import DatasetConfig
from meshserve.bench.tokenization import PromptTokenizer

# Token ids are drawn from the tokenization of ordinary words, so prompts decode to plain
# text and never contain special or partial-byte tokens.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "what will more if no out so said can about up other into them than its time only "
    "could new these two may first then do any like my now over such our man me even most "
    "made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take "
    "three himself few house use during without again place around however home small found "
    "thought went say part once general high upon school every does got united left number "
    "course war until always away something fact though water less public put think almost "
    "hand enough far took head yet government system better set told nothing night end why "
    "called didn eyes find going look asked later point knew city next program business give "
    "group toward young days let room president side social present given several order "
    "national second possible rather per face among form important often things looked early "
    "white case john become large big need four within felt along children saw best church "
    "ever least power development light thing family interest want members mind country area "
    "others done turned although open problem service certain kind began different door thus "
    "help means sense whole matter perhaps itself york times law human line above name "
    "example company hands local show whether five history gave today either act feet across "
    "taken past quite anything seen having death week experience field free"
)

_MAX_FIT_ROUNDS = 32


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (completions endpoint only)
    prompt_len: int | None  # tokens as the tokenizer counts them; None when unknown
    output_len: int


@dataclass(frozen=True)
class TokenSpace:
    pool: np.ndarray  # ids of ordinary text tokens to draw prompts from
    n_special: int  # tokens the tokenizer adds to any text (BOS, EOS)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def token_space(tok: PromptTokenizer) -> TokenSpace:
    """Find the tokens the tokenizer adds by itself without encoding an empty string (servers
    may reject empty prompts): what two unrelated texts share at both ends."""
    a, b = await tok.encode("alpha"), await tok.encode("7")
    head = _common_prefix_len(a, b)
    tail = _common_prefix_len(a[head:][::-1], b[head:][::-1])
    specials = set(a[:head]) | set(a[len(a) - tail:])
    ids = sorted(set(await tok.encode(_WORDS)) - specials)
    if len(ids) < 16:
        raise RuntimeError("the tokenizer produced too few distinct tokens to build prompts")
    return TokenSpace(np.asarray(ids, dtype=np.int64), head + tail)


async def fit_prompt(tok: PromptTokenizer, target: int, rng: np.random.Generator,
                     space: TokenSpace, prefix: str = "") -> str:
    """Text that tokenizes to exactly `target` tokens, starting with `prefix`."""
    base = len(await tok.encode(prefix)) if prefix else space.n_special
    if target < base + (0 if prefix else 1):
        raise ValueError(f"a prompt of {target} tokens cannot be built: the tokenizer adds "
                         f"{base} tokens by itself (prefix and special tokens)")
    sep = "\n" if prefix else ""
    ids = list(rng.choice(space.pool, size=target - base))
    for _ in range(_MAX_FIT_ROUNDS):
        text = prefix + sep + await tok.decode(ids)
        diff = len(await tok.encode(text)) - target
        if diff == 0:
            return text
        if diff > 0:
            ids = ids[:max(len(ids) - diff, 0)]
        else:
            ids.extend(rng.choice(space.pool, size=-diff))
    raise RuntimeError(f"no prompt of exactly {target} tokens found after {_MAX_FIT_ROUNDS} "
                       "corrections; this tokenizer merges pieces too aggressively")


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> np.ndarray:
    """Integers uniform in [mean*(1-r), mean*(1+r)], at least 1."""
    low = max(1, int(np.floor(mean * (1 - range_ratio))))
    high = max(low, int(np.ceil(mean * (1 + range_ratio))))
    return rng.integers(low, high + 1, size=n)


def _child_rngs(seed: int, n: int) -> list[np.random.Generator]:
    # One stream per prompt: the set is the same whatever order the async fits finish in.
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(n)]


async def random_requests(cfg: DatasetConfig, tok: PromptTokenizer) -> list[BenchRequest]:
    n = cfg.synthetic_count
    rng = np.random.default_rng(cfg.seed)
    in_lens = sample_lengths(rng, cfg.input_len, cfg.range_ratio, n)
    out_lens = sample_lengths(rng, cfg.output_len, cfg.range_ratio, n)
    space = await token_space(tok)
    prompts = await asyncio.gather(*(
        fit_prompt(tok, int(length), child, space)
        for length, child in zip(in_lens, _child_rngs(cfg.seed + 1, n))))
    return [BenchRequest(p, int(i), int(o)) for p, i, o in zip(prompts, in_lens, out_lens)]


async def prefix_requests(cfg: DatasetConfig, tok: PromptTokenizer) -> list[BenchRequest]:
    """A shared leading text (a system prompt) of `prefix_len` tokens plus a unique suffix
    of about `input_len` tokens: the shape that prefix caching is for."""
    n = cfg.synthetic_count
    rng = np.random.default_rng(cfg.seed)
    suffix_lens = sample_lengths(rng, cfg.input_len, cfg.range_ratio, n)
    out_lens = sample_lengths(rng, cfg.output_len, cfg.range_ratio, n)
    space = await token_space(tok)
    prefix_rngs = _child_rngs(cfg.seed + 2, cfg.num_prefixes)
    prefixes = [await fit_prompt(tok, cfg.prefix_len, r, space) for r in prefix_rngs]
    targets = [cfg.prefix_len + int(s) for s in suffix_lens]
    prompts = await asyncio.gather(*(
        fit_prompt(tok, t, child, space, prefix=prefixes[i % cfg.num_prefixes])
        for i, (t, child) in enumerate(zip(targets, _child_rngs(cfg.seed + 1, n)))))
    return [BenchRequest(p, t, int(o)) for p, t, o in zip(prompts, targets, out_lens)]


def _sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path!r} is not a ShareGPT list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) >= 2 and turns[0].get("value") and turns[1].get("value"):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs


async def sharegpt_requests(cfg: DatasetConfig, tok: PromptTokenizer,
                            max_model_len: int | None) -> list[BenchRequest]:
    """First human turn as the prompt; the reply's token count as the output length unless
    --sharegpt-output-len fixes it. Conversations too short to measure (under 4 tokens) or
    too long for the model are skipped."""
    pairs = _sharegpt_pairs(cfg.path or "")
    want = cfg.synthetic_count
    order = np.random.default_rng(cfg.seed).permutation(len(pairs))

    async def measure(idx: int) -> BenchRequest | None:
        prompt, reply = pairs[idx]
        p_len = len(await tok.encode(prompt))
        o_len = cfg.sharegpt_output_len or len(await tok.encode(reply))
        if p_len < 4 or o_len < 4:
            return None
        if max_model_len is not None and p_len + o_len > max_model_len:
            return None
        return BenchRequest(prompt, p_len, o_len)

    chosen: list[BenchRequest] = []
    pos = 0
    while len(chosen) < want and pos < len(order):
        batch = order[pos:pos + 2 * (want - len(chosen))]
        pos += len(batch)
        chosen += [r for r in await asyncio.gather(*(measure(int(i)) for i in batch)) if r]
    if len(chosen) < want:
        raise ValueError(f"--dataset-path {cfg.path!r} has {len(chosen)} usable conversations, "
                         f"fewer than --num-prompts {want}")
    return chosen[:want]


def _jsonl_rows(path: str) -> list[tuple[str, int]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            out = obj.get("max_tokens", obj.get("output_len"))
            if not isinstance(obj.get("prompt"), str) or not isinstance(out, int) or out < 1:
                raise ValueError(f"--dataset-path {path!r} line {lineno}: expected "
                                 '{"prompt": str, "max_tokens": int >= 1}')
            rows.append((obj["prompt"], out))
    return rows


async def jsonl_requests(cfg: DatasetConfig, tok: PromptTokenizer | None) -> list[BenchRequest]:
    """One request per line, in file order: {"prompt": ..., "max_tokens": ...}."""
    rows = _jsonl_rows(cfg.path or "")
    if cfg.num_prompts is not None:
        if cfg.num_prompts > len(rows):
            raise ValueError(f"--num-prompts {cfg.num_prompts} exceeds the {len(rows)} lines "
                             f"of {cfg.path!r}")
        rows = rows[:cfg.num_prompts]
    lens: Sequence[int | None] = [None] * len(rows)
    if tok is not None:
        lens = [len(ids) for ids in await asyncio.gather(*(tok.encode(p) for p, _ in rows))]
    return [BenchRequest(p, n, out) for (p, out), n in zip(rows, lens)]


async def load_requests(cfg: DatasetConfig, tok: PromptTokenizer | None,
                        max_model_len: int | None = None) -> list[BenchRequest]:
    if cfg.name == "jsonl":
        return await jsonl_requests(cfg, tok)
    if tok is None:
        raise ValueError(f"--dataset-name {cfg.name} needs a tokenizer: the server's /tokenize "
                         "or --tokenizer PATH")
    if cfg.name == "random":
        return await random_requests(cfg, tok)
    if cfg.name == "prefix":
        return await prefix_requests(cfg, tok)
    return await sharegpt_requests(cfg, tok, max_model_len)
