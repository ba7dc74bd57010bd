"""Tokenizer: text <-> token ids and chat templates, built from GGUF metadata or a HF tokenizer.json."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp): 3 = control, 4 = user-defined. Both are never split by BPE.
_GGUF_SPECIAL_TYPES = (3, 4)


def _render_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     **extra: Any) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> NoReturn:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **extra)


class Tokenizer:
    def __init__(self, tok: HFTokenizer, *, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, add_bos: bool):
        self._tok = tok
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The tokenizer in the `tokenizers` library's JSON form (what llguidance reads)."""
        return str(self._tok.to_str())

    def identity(self) -> str:
        """Everything that decides token ids: the vocabulary, merges, pre-tokenizer and BOS rule."""
        return f"{self._tok.to_str()}|bos={self.bos_token}|add_bos={self.add_bos}"

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """`tools`: the functions the answer may call, as Hugging Face templates take them (a list of
        `{"type": "function", "function": {...}}`); None, as there, when there are none."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        return _render_template(self.chat_template, messages, add_generation_prompt, tools=tools,
                                bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, fields: dict) -> Tokenizer:
        """`fields`: GGUF key -> python value (lists for arrays)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if fields.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "smaug-bpe"):
            # These pre-tokenizers split every digit on its own before byte-level BPE.
            pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty in _GGUF_SPECIAL_TYPES])

        def token(key: str) -> str | None:
            i = fields.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        return cls(tok, chat_template=fields.get("tokenizer.chat_template"),
                   bos_token=token("tokenizer.ggml.bos_token_id"),
                   eos_token=token("tokenizer.ggml.eos_token_id"),
                   add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise ValueError(f"{path} has no tokenizer.json (the fast-tokenizer file is required)")
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())

        def text(v: object) -> str | None:  # a token is a string or an AddedToken's fields
            token = v.get("content") if isinstance(v, dict) else v
            return token if isinstance(token, str) else None

        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        # tokenizer.json's post-processor may add BOS itself; we add it explicitly instead.
        tok.post_processor = None
        return cls(tok, chat_template=template, bos_token=text(cfg.get("bos_token")),
                   eos_token=text(cfg.get("eos_token")), add_bos=bool(cfg.get("add_bos_token", False)))

    def save_hf(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (for exporting a HF model directory)."""
        path = Path(path)
        self._tok.save(str(path / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
               "eos_token": self.eos_token, "add_bos_token": self.add_bos,
               "chat_template": self.chat_template, "clean_up_tokenization_spaces": False,
               "model_max_length": 1 << 30}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def tokenizer_hash(tokenizer: object) -> str:
    """A fingerprint of the vocabulary and merges (two replicas agree on token ids iff it matches)."""
    identity = getattr(tokenizer, "identity", None)
    text = identity() if callable(identity) else f"{type(tokenizer).__name__}:{getattr(tokenizer, 'vocab_size', '')}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
