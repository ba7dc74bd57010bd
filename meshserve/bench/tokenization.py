"""Token counting for building prompts: the server's own tokenizer or a local one.

Counts include the special tokens the tokenizer adds by default (a BOS token, for example),
because that is what a completions request with the same text costs the server.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import aiohttp


class PromptTokenizer(Protocol):
    async def encode(self, text: str) -> list[int]: ...

    async def decode(self, ids: Sequence[int]) -> str: ...


class ServerTokenizer:
    """`POST /tokenize` and `POST /detokenize` of an OpenAI-compatible server (vLLM's shapes)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str | None,
                 max_in_flight: int = 16) -> None:
        self._session = session
        self._base = base_url.rstrip("/")
        self._model = model
        # Building a thousand prompts must not open a thousand sockets at once.
        self._gate = asyncio.Semaphore(max_in_flight)

    async def _post(self, path: str, body: dict) -> dict:
        if self._model:
            body = {"model": self._model, **body}
        async with self._gate, self._session.post(self._base + path, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(
                    f"{self._base}{path} answered HTTP {resp.status}; pass --tokenizer PATH "
                    "to count tokens locally instead")
            answer: dict[str, Any] = await resp.json()
            return answer

    async def encode(self, text: str) -> list[int]:
        return list((await self._post("/tokenize", {"prompt": text}))["tokens"])

    async def decode(self, ids: Sequence[int]) -> str:
        text: str = (await self._post("/detokenize", {"tokens": [int(i) for i in ids]}))["prompt"]
        return text


class LocalTokenizer:
    """A Hugging Face tokenizer: a tokenizer.json file, or a directory holding one or a
    tokenizer that transformers can load."""

    def __init__(self, path: str) -> None:
        json_path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self._encode: Callable[[str], list[int]]
        self._decode: Callable[[list[int]], str]
        if os.path.isfile(json_path) and json_path.endswith(".json"):
            from tokenizers import Tokenizer

            fast = Tokenizer.from_file(json_path)
            self._encode = lambda text: fast.encode(text).ids
            self._decode = lambda ids: fast.decode(list(ids), skip_special_tokens=True)
        elif os.path.isdir(path):
            from transformers import AutoTokenizer

            auto = AutoTokenizer.from_pretrained(path)
            self._encode = lambda text: auto(text)["input_ids"]

            def decode(ids: list[int]) -> str:
                text = auto.decode(list(ids), skip_special_tokens=True)
                assert isinstance(text, str), "one sequence of ids decodes to one string"
                return text

            self._decode = decode
        else:
            raise ValueError(f"--tokenizer {path!r} is neither a tokenizer.json file nor a "
                             "tokenizer directory")

    async def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    async def decode(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids])
