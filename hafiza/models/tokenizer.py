"""Tokenizer and chat template from the model itself: GGUF metadata or a Hugging Face directory."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Encoding, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from hafiza.errors import ModelLoadError

# Pre-tokenizer regexes for the BPE variants llama.cpp names in `tokenizer.ggml.pre`.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Tokenizer:
    """Encodes text, decodes ids incrementally and renders the model's chat template."""

    backend: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    chat_template: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    _template: jinja2.Template | None = field(default=None, repr=False)
    textual_ids: frozenset[int] = frozenset()
    _plain: HFTokenizer | None = field(default=None, repr=False, compare=False)
    _special_ids: frozenset[int] | None = field(default=None, repr=False, compare=False)
    _special_re: re.Pattern[str] | None = field(default=None, repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised; BOS added if the model wants it."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token is not None:
            bos = self.backend.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the control tokens (such as `<|im_start|>`): the special added tokens, less `textual_ids`
        (GGUF USER_DEFINED tokens such as Qwen2.5's `<tool_call>`, which plain text may contain, as in llama.cpp)."""
        if self._special_ids is None:
            added = self.backend.get_added_tokens_decoder()
            self._special_ids = frozenset(i for i, t in added.items() if t.special and i not in self.textual_ids)
        return self._special_ids

    def encode_unlocked(self, text: str) -> Encoding:
        """The backend's encoding of `text` (no special tokens added), computed without holding the GIL, so a
        long prompt tokenized on a worker thread does not stall the event loop (`encode` holds it throughout)."""
        return self.backend.encode_batch([text], add_special_tokens=False)[0]

    def spells_special(self, text: str) -> bool:
        """Whether `text` contains the spelling of a control token."""
        if self._special_re is None:
            added = self.backend.get_added_tokens_decoder()
            texts = sorted((added[i].content for i in self.special_ids if added[i].content), key=len, reverse=True)
            self._special_re = re.compile("|".join(map(re.escape, texts)) or r"(?!)")
        return self._special_re.search(text) is not None

    def encode_plain(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character spans of `text` read as plain text: control-token spellings such as `<|im_end|>`
        become ordinary characters. For message content, which must never yield control tokens."""
        if self._plain is None:
            spec = json.loads(self.backend.to_str())
            for tok in spec.get("added_tokens", []):
                tok["special"] = tok["id"] in self.special_ids
            plain = HFTokenizer.from_str(json.dumps(spec))
            plain.encode_special_tokens = True
            self._plain = plain
        enc = self._plain.encode_batch([text], add_special_tokens=False)[0]
        return list(enc.ids), list(enc.offsets)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any] | str] | None = None, **variables: object) -> str:
        """Render a conversation to the prompt text the model was trained on. `tools` (function definitions in
        OpenAI's `{"type": "function", "function": {...}}` form) and `variables` reach the template as Hugging
        Face's apply_chat_template passes them."""
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template or DEFAULT_CHAT_TEMPLATE)
        extra = {"tools": tools} if tools is not None else {}
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
            **variables,
        )

    @property
    def template_supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` variable (Qwen2.5's and Llama 3.x's do; SmolLM2's not)."""
        return bool(self.chat_template) and re.search(r"\btools\b", self.chat_template or "") is not None


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text) :]
        self.text = full
        return delta


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Hugging Face's `tojson`: key order kept and no HTML escaping (jinja's own sorts keys and escapes `<`)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def tokenizer_from_gguf(fields: dict[str, Any], path: Path) -> Tokenizer:
    """Build the tokenizer from GGUF metadata: gpt2-style BPE natively, others through transformers' converter."""
    model = fields.get("tokenizer.ggml.model")
    template = fields.get("tokenizer.chat_template")
    tokens: list[str] = fields.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    eos_id = fields.get("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None
    eos = tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None
    eos_ids = [int(eos_id)] if eos_id is not None else []
    eot_id = fields.get("tokenizer.ggml.eot_token_id")
    if eot_id is not None and int(eot_id) not in eos_ids:
        eos_ids.append(int(eot_id))
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", model == "llama"))
    backend = _bpe_from_gguf(fields, tokens) if model == "gpt2" else _converted_by_transformers(path)
    types = fields.get("tokenizer.ggml.token_type") or []
    textual = frozenset(i for i, t in enumerate(types) if int(t) == 4)  # USER_DEFINED: plain text may hold them
    return Tokenizer(backend, bos, eos, add_bos, template, eos_ids, textual_ids=textual)


def _bpe_from_gguf(fields: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = fields.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    elif pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    elif pre in ("smollm", "starcoder", "refact"):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type") or []
    special = [tokens[i] for i, t in enumerate(types) if int(t) in (3, 4)]  # CONTROL, USER_DEFINED
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    return backend


def _converted_by_transformers(path: Path) -> HFTokenizer:
    """SentencePiece-style GGUF vocabularies: let transformers convert them (slow, but correct)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"{path}: cannot build tokenizer from GGUF metadata ({exc})") from exc
    return tok.backend_tokenizer


def tokenizer_from_dir(model_dir: Path) -> Tokenizer:
    """Load tokenizer.json and tokenizer_config.json (chat template, BOS/EOS) from a Hugging Face directory."""
    tok_file = model_dir / "tokenizer.json"
    cfg_file = model_dir / "tokenizer_config.json"
    cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    if tok_file.exists():
        backend = HFTokenizer.from_file(str(tok_file))
    else:
        from transformers import AutoTokenizer

        try:
            backend = AutoTokenizer.from_pretrained(str(model_dir)).backend_tokenizer
        except Exception as exc:
            raise ModelLoadError(f"{model_dir}: no usable tokenizer ({exc})") from exc
    template = cfg.get("chat_template")
    tmpl_file = model_dir / "chat_template.jinja"
    if template is None and tmpl_file.exists():
        template = tmpl_file.read_text()
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    eos_ids = [i for i in [backend.token_to_id(eos)] if eos is not None and i is not None]
    add_bos = bool(cfg.get("add_bos_token", False))
    return Tokenizer(backend, bos, eos, add_bos, template, eos_ids)


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
