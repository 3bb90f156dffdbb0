"""`hafiza bench grammar | choices`: decode speed with and without a grammar (and the per-step mask cost of the
grammar engines on the model's vocabulary); n choices in one request vs n separate requests."""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from hafiza.bench.common import write_json
from hafiza.bench.engine_benches import chat_ids, system_prompt, timed_generate
from hafiza.engine import EngineConfig, LLMEngine, SamplingParams
from hafiza.engine.grammar import GrammarSpec
from hafiza.models import LoadedModel, load_model

# Open-ended on purpose (an array of strings), so the grammar run decodes as many tokens as the plain one.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "tags": {"type": "array", "items": {"enum": ["new", "used", "sale"]}},
    "lines": {"type": "array", "items": {"type": "string"}},
}, "required": ["title", "tags", "lines"], "additionalProperties": False}
QUESTION = "List the parts of a bicycle as JSON, with a title, tags and one line per part."


def _decode_rate(engine: LLMEngine, ids: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """Tokens per second from the first token to the last (decode only), and the tokens."""
    engine.add_request(ids, params)
    first = last = None
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.new_token_ids:
                last = time.perf_counter()
                first = first or last
    if first is None or last is None or len(tokens) < 2:
        raise RuntimeError(f"the run produced {len(tokens)} tokens; raise --new-tokens")
    return (len(tokens) - 1) / (last - first), tokens


def _step_costs(step: Callable[[torch.Tensor, int], None], tokens: list[int], vocab: int) -> list[float]:
    """Seconds per step of mask + apply + advance along `tokens`, on a random fp32 logits row; stops early where
    the engine's reading of the schema rejects a token (its whitespace rules differ)."""
    logits = torch.randn(1, vocab)
    times = []
    for t in tokens:
        row = logits.clone()
        t0 = time.perf_counter()
        try:
            step(row, t)
        except ValueError:
            break
        times.append(time.perf_counter() - t0)
    return times


def _xgrammar_step(loaded: LoadedModel, schema: str) -> Callable[[], Callable[[torch.Tensor, int], None]]:
    from hafiza.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size)

    def prepare() -> Callable[[torch.Tensor, int], None]:
        state = compiler.state(GrammarSpec("json_schema", schema))

        def step(row: torch.Tensor, token: int) -> None:
            state.mask_(row)
            state.accept(token)

        return step

    return prepare


def _llguidance_step(loaded: LoadedModel, schema: str) -> Callable[[], Callable[[torch.Tensor, int], None]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=loaded.tokenizer.backend)
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=loaded.config.vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    warm = llguidance.LLMatcher(tok, grammar)  # the first mask builds the token trie: not a per-step cost
    lt.fill_next_token_bitmask(warm, lt.allocate_token_bitmask(1, loaded.config.vocab_size), 0)

    def prepare() -> Callable[[torch.Tensor, int], None]:
        matcher = llguidance.LLMatcher(tok, grammar)
        mask = lt.allocate_token_bitmask(1, loaded.config.vocab_size)

        def step(row: torch.Tensor, token: int) -> None:
            lt.fill_next_token_bitmask(matcher, mask, 0)
            lt.apply_token_bitmask_inplace(row, mask)
            matcher.consume_token(token)

        return step

    return prepare


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-ins for bytes (e.g. "\u0120" for a space), mapped back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    codes = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def _outlines_step(loaded: LoadedModel, schema: str) -> Callable[[], Callable[[torch.Tensor, int], None]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = loaded.tokenizer.eos_token_ids[0]
    special = loaded.tokenizer.special_ids
    unicode_to_byte = _byte_level_alphabet()
    vocab: dict[bytes, list[int]] = {}
    for text, i in loaded.tokenizer.backend.get_vocab().items():
        if i != eos and i not in special:
            byte_level = set(text) <= unicode_to_byte.keys()
            raw = bytes(unicode_to_byte[c] for c in text) if byte_level else text.encode()
            vocab.setdefault(raw, []).append(i)
    index = Index(build_regex_from_schema(schema, whitespace_pattern=r"[ ]?"), Vocabulary(eos, vocab))

    import xgrammar as xgr  # its bitmask kernel applies outlines-core's mask (same 32-bit word layout)

    vocab_size = loaded.config.vocab_size

    def prepare() -> Callable[[torch.Tensor, int], None]:
        guide = Guide(index)
        mask = torch.zeros(1, -(-vocab_size // 32), dtype=torch.int32)

        def step(row: torch.Tensor, token: int) -> None:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            xgr.apply_token_bitmask_inplace(row, mask, vocab_size=vocab_size)
            if token != eos:
                guide.advance(token)

        return step

    return prepare


ENGINES = {"xgrammar": ("xgrammar", _xgrammar_step), "llguidance": ("llguidance", _llguidance_step),
           "outlines-core": ("outlines_core", _outlines_step)}


def bench_grammar(loaded: LoadedModel, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Decode tok/s of the same prompt with and without the schema (median of `repeats`); then each installed
    grammar engine's per-step cost along the tokens the grammar run produced (a second matcher's, after the first
    one paid any lazy set-up, whose first step is reported apart)."""
    engine = LLMEngine(loaded, EngineConfig(kv_memory="256MiB"))
    ids = chat_ids(loaded, "You answer in JSON.", QUESTION)
    schema = json.dumps(SCHEMA)
    engine.generate([ids], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    plain = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    guided = SamplingParams(max_tokens=new_tokens, temperature=0, grammar=GrammarSpec("json_schema", schema))
    rates: dict[str, list[float]] = {"plain": [], "grammar": []}
    tokens: list[int] = []
    for _ in range(repeats):
        rates["plain"].append(_decode_rate(engine, ids, plain)[0])
        rate, tokens = _decode_rate(engine, ids, guided)
        rates["grammar"].append(rate)
    p, g = statistics.median(rates["plain"]), statistics.median(rates["grammar"])
    engines = []
    for name, (module, factory) in ENGINES.items():
        if importlib.util.find_spec(module) is None:
            engines.append({"engine": name, "installed": False})
            continue
        t0 = time.perf_counter()
        prepare = factory(loaded, schema)
        first_step = prepare()
        setup = time.perf_counter() - t0
        first = _step_costs(first_step, tokens, loaded.config.vocab_size)
        times = _step_costs(prepare(), tokens, loaded.config.vocab_size)  # steady state: a second matcher
        if not times:
            engines.append({"engine": name, "installed": True, "setup_s": setup, "steps": 0})
            continue
        engines.append({"engine": name, "installed": True, "setup_s": setup, "steps": len(times),
                        "first_matcher_first_step_ms": 1e3 * first[0],
                        "median_ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.mean(times),
                        "max_ms": 1e3 * max(times)})
    chosen = next(e for e in engines if e["engine"] == "xgrammar")
    step_ms = 1e3 / p
    return {"new_tokens": new_tokens, "grammar_tokens": len(tokens), "repeats": repeats,
            "plain_tok_s": p, "grammar_tok_s": g, "ratio": g / p, "rates": rates,
            "mask_only_ratio": step_ms / (step_ms + chosen["mean_ms"]),
            "grammar_text": loaded.tokenizer.decode(tokens)[:200], "vocab": loaded.config.vocab_size,
            "engines": engines}


def bench_choices(loaded: LoadedModel, n: int, system_tokens: int, new_tokens: int) -> dict[str, Any]:
    """One request with n choices vs n separate concurrent requests of the same prompt (fresh engine each, so
    neither starts with a warm cache): wall time and prompt tokens computed."""
    ids = chat_ids(loaded, system_prompt(loaded, system_tokens), "Which bike suits a city commute?")
    rows = []
    for label, prompts, params in [
        (f"n={n}, one request", [ids], SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0, n=n,
                                                      ignore_eos=True)),
        (f"{n} separate requests", [ids] * n, SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0,
                                                             ignore_eos=True)),
    ]:
        out, secs = timed_generate(LLMEngine(loaded, EngineConfig(kv_memory="512MiB")), prompts, params)
        computed = sum(r.num_prompt_tokens - r.num_cached_tokens for r in out)
        rows.append({"run": label, "choices": len(out), "seconds": secs, "prompt_tokens_computed": computed})
    return {"n": n, "prompt_tokens": len(ids), "new_tokens": new_tokens, "results": rows,
            "speedup": rows[1]["seconds"] / rows[0]["seconds"]}


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("grammar")
    def grammar(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file or model directory.")] = None,
        new_tokens: Annotated[int, typer.Option(help="Tokens decoded per run.")] = 96,
        repeats: Annotated[int, typer.Option(help="Runs with and without the grammar (medians reported).")] = 3,
        dtype: Annotated[str, typer.Option(help="fp32 or bf16.")] = "fp32",
        device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    ) -> None:
        """Decode speed with a JSON-schema grammar vs without, and each grammar engine's per-step cost."""
        data = bench_grammar(load_model(model, dtype=dtype, device=device), new_tokens, repeats)
        _table("Constrained decoding: single stream, greedy",
               ["tokens", "plain tok/s", "grammar tok/s", "ratio", "ratio from mask cost alone"],
               [[str(data["grammar_tokens"]), f"{data['plain_tok_s']:.1f}", f"{data['grammar_tok_s']:.1f}",
                 f"{data['ratio']:.2f}", f"{data['mask_only_ratio']:.3f}"]])
        _table(f"Per-step mask + apply + advance, {data['vocab']}-token vocabulary",
               ["engine", "setup s", "first step ms", "steps", "median ms", "mean ms", "max ms"],
               [[e["engine"], f"{e['setup_s']:.2f}", f"{e['first_matcher_first_step_ms']:.1f}", str(e["steps"]),
                 f"{e['median_ms']:.3f}", f"{e['mean_ms']:.3f}", f"{e['max_ms']:.2f}"] if e.get("steps")
                else [e["engine"], "not installed" if not e["installed"] else f"{e['setup_s']:.2f}", "", "0", "", "",
                      ""]
                for e in data["engines"]])
        print(f"wrote {write_json(data, json_path, 'grammar.json')}")

    @bench_app.command("choices")
    def choices(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file or model directory.")] = None,
        n: Annotated[int, typer.Option(help="Choices per request.")] = 4,
        system_tokens: Annotated[int, typer.Option(help="Length of the shared system prompt.")] = 1000,
        new_tokens: Annotated[int, typer.Option(help="Tokens generated per choice.")] = 32,
        dtype: Annotated[str, typer.Option(help="fp32 or bf16.")] = "fp32",
        device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    ) -> None:
        """n choices in one request (shared prompt blocks) vs n separate requests."""
        data = bench_choices(load_model(model, dtype=dtype, device=device), n, system_tokens, new_tokens)
        _table(f"n choices of a {data['prompt_tokens']}-token prompt, {new_tokens} tokens each",
               ["run", "choices", "seconds", "prompt tokens computed"],
               [[r["run"], str(r["choices"]), f"{r['seconds']:.2f}", str(r["prompt_tokens_computed"])]
                for r in data["results"]])
        print(f"wrote {write_json(data, json_path, 'choices.json')}")
