"""Constrained decoding with xgrammar: compile a GrammarSpec for the model's tokenizer (cached), mask each step's
logits to the tokens the grammar allows, advance on the sampled token, and say when the grammar is complete.

xgrammar was chosen over llguidance and outlines-core by measured per-step cost on the default model's 49k
vocabulary (docs/SERVER.md, "Constrained decoding"); outlines-core also has no context-free grammars.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from hafiza.errors import RequestError
from hafiza.models.tokenizer import Tokenizer

GrammarKind = Literal["json_schema", "json_object", "ebnf", "regex"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "ebnf", "regex")
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_XGR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. `text`: the JSON schema as JSON text (json_schema), EBNF with a `root` rule
    (ebnf) or a regular expression (regex); empty for json_object (any JSON object). `strict`: a schema allows no
    properties or items beyond those it names (OpenAI strict). `prefix` / `suffix`: literal text forced before and
    after the structured part, e.g. a tool-call wrapper."""

    kind: GrammarKind
    text: str = ""
    strict: bool = True
    prefix: str = ""
    suffix: str = ""

    def validate(self) -> None:
        """Raise RequestError for a spec that cannot be compiled, naming the field."""
        if self.kind not in KINDS:
            raise RequestError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json_object" and self.text:
            raise RequestError(f"grammar kind json_object takes no text, got {len(self.text)} characters")
        if self.kind != "json_object" and not self.text:
            raise RequestError(f"grammar kind {self.kind} needs its text (schema, EBNF or pattern)")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise RequestError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise RequestError(f"json_schema must be a JSON object, got {type(schema).__name__}")


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: its name and its parameters' JSON schema (None: any object)."""

    name: str
    parameters: Mapping[str, object] | None = None


def tool_call_grammar(tools: Sequence[ToolSpec], begin: str = "", end: str = "",
                      arguments_key: str = "arguments") -> GrammarSpec:
    """Force exactly one call of one of `tools`: `begin` + {"name": <tool name>, "<arguments_key>": <arguments
    matching that tool's schema>} + `end`. Hermes/Qwen2.5 style: begin="<tool_call>\\n", end="\\n</tool_call>";
    Llama 3 style: a bare object with arguments_key="parameters"."""
    if not tools:
        raise RequestError("a forced tool call needs at least one tool, got 0")
    envelopes = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, arguments_key: dict(t.parameters or {"type": "object"})},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = envelopes[0] if len(envelopes) == 1 else {"anyOf": envelopes}
    return GrammarSpec("json_schema", json.dumps(schema), strict=True, prefix=begin, suffix=end)


def _literal(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _structured(spec: GrammarSpec) -> xgr.Grammar:
    """The spec's grammar without its literal prefix and suffix; JSON compact on one line, ", " and ": "."""
    if spec.kind in ("json_schema", "json_object"):
        text = spec.text if spec.kind == "json_schema" else JSON_OBJECT_SCHEMA
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=spec.strict)
    if spec.kind == "ebnf":
        return xgr.Grammar.from_ebnf(spec.text)
    return xgr.Grammar.from_regex(spec.text)


class GrammarCompiler:
    """Compiles specs for one tokenizer and keeps the last `max_entries` compiled grammars. Thread-safe: the
    server compiles while checking a request, the engine thread builds matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_entries: int = 256) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's: padded embedding rows)."""
        self.tokenizer, self.vocab_size, self.max_entries = tokenizer, vocab_size, max_entries
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def _xgr(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
            info = xgr.TokenizerInfo.from_huggingface(
                hf, vocab_size=self.vocab_size, stop_token_ids=list(self.tokenizer.eos_token_ids) or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def prepare(self) -> None:
        """Build the tokenizer's xgrammar info now (at server start), so the first structured request does not
        wait for it."""
        with self._lock:
            self._xgr()

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec` (cached); RequestError if the spec is invalid."""
        spec.validate()
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            try:
                parts = [_literal(spec.prefix)] if spec.prefix else []
                parts.append(_structured(spec))
                if spec.suffix:
                    parts.append(_literal(spec.suffix))
                grammar = parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)
                compiled = self._xgr().compile_grammar(grammar)
            except (RuntimeError, ValueError, TypeError) as exc:
                reason = _XGR_LOG_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
                raise RequestError(f"grammar ({spec.kind}) does not compile: {reason[:300]}") from None
            self._cache[spec] = compiled
            if len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
            return compiled

    def state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher for one sequence."""
        return GrammarState(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)


class GrammarState:
    """One sequence's position in its grammar: the allowed-token mask for the next step, advance, completion."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits of disallowed tokens to -inf in place (a [V] or [1, V] row on any device)."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        row = logits.view(1, -1)
        bitmask = self._bitmask if row.device.type == "cpu" else self._bitmask.to(row.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(row, bitmask, vocab_size=self.vocab_size)
        return logits

    def allowed(self) -> torch.Tensor:
        """Boolean [V] of the tokens the grammar allows next (for tests and diagnostics)."""
        row = self.mask_(torch.zeros(self.vocab_size))
        return torch.isfinite(row)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self.matcher.is_terminated())

    def fork(self) -> GrammarState:
        """An independent copy at the same position (for the n choices of one request)."""
        return GrammarState(self.matcher.fork(), self.vocab_size)
