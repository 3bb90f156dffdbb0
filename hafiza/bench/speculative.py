"""`hafiza bench speculative`: greedy decode speed with and without speculative decoding, on three workloads.

- edit: rewrite a ~300-line Python module (generated deterministically here) with one constant changed;
- json: echo a JSON document with one field added;
- chat: free prose, where drafts rarely hit (speculation backs off there).

Systems, interleaved in one run on the same token ids: plain hafiza decoding, hafiza with ngram (prompt lookup)
drafting, hafiza drafted by a small model of the same tokenizer (`--draft-model`), and llama.cpp
(llama-cpp-python) on the same GGUF, plain and with `LlamaPromptLookupDecoding`. Each speculating system's
`identical` says whether its greedy tokens equal its own engine's plain decoding.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from hafiza.bench.common import write_json
from hafiza.bench.llama_peer import llama_import
from hafiza.bench.markdown import Region, replace_region, table
from hafiza.models import LoadedModel
from hafiza.options import Weights

WORKLOADS = ("edit", "json", "chat")
REGION = Region("speculative", "Speculative decoding")
EDIT_CHANGE = ("DEFAULT_TIMEOUT", "30", "45")
CHAT_PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. Describe the sea, "
               "the weather and what the keeper decides to do.")
ANSWER_START = {"edit": "```python\n", "json": "```json\n"}
_NOUNS = ("order", "invoice", "customer", "parcel", "route", "driver", "warehouse", "shelf", "supplier", "refund",
          "coupon", "basket", "payment", "receipt", "ticket", "review", "account", "session", "report", "vehicle")
_VERBS = ("load", "save", "check", "format", "count", "merge", "split", "find", "update", "archive")


@dataclass(frozen=True)
class Settings:
    """What one run measures: tokens per request, runs per system and workload, the edit file's and the JSON
    document's size, and each system's drafting settings."""

    max_tokens: int = 384
    repeats: int = 3
    edit_lines: int = 300
    json_items: int = 12
    num_speculative_tokens: int = 8
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    llama_pred_tokens: int = 10
    llama_ngram_size: int = 2
    draft_model: str | None = None


def edit_source(lines: int = 300) -> str:
    """A deterministic Python module of about `lines` lines: constants, a dataclass and small functions."""
    rng = random.Random(1234)
    out = ['"""Order handling for a small shop: loading, checking and formatting records."""', "",
           "from __future__ import annotations", "", "import json", "import logging",
           "from dataclasses import dataclass, field", "from pathlib import Path", "",
           f"{EDIT_CHANGE[0]} = {EDIT_CHANGE[1]}", "MAX_RETRIES = 3", 'DATA_DIR = Path("data")',
           "log = logging.getLogger(__name__)", "", "", "@dataclass", "class Record:",
           '    """One stored record: its id, owner, amount and tags."""', "", "    id: int", "    owner: str",
           "    amount: float = 0.0", "    tags: list[str] = field(default_factory=list)", "", "",
           "def read_records(path: Path) -> list[Record]:",
           '    """Every record stored in the JSON file at `path`."""',
           "    with path.open() as f:", "        return [Record(**row) for row in json.load(f)]", ""]
    i = 0
    while len(out) < lines - 2:
        noun, verb = _NOUNS[i % len(_NOUNS)], _VERBS[(i * 7 + i // len(_NOUNS)) % len(_VERBS)]
        limit, scale = rng.randint(2, 90), rng.choice((2, 3, 5, 10, 12, 100))
        out += ["", f"def {verb}_{noun}(records: list[Record], limit: int = {limit}) -> list[Record]:",
                f'    """{verb.capitalize()} the {noun} records, at most `limit` of them."""',
                "    result = []", "    for record in records:",
                f'        if "{noun}" in record.tags and record.amount > {scale}:',
                f"            record.amount = round(record.amount * {scale} / 100, 2)",
                "            result.append(record)", "        if len(result) >= limit:", "            break",
                f'    log.debug("{verb} %d {noun} records", len(result))', "    return result", ""]
        i += 1
    return "\n".join(out[:lines]) + "\n"


def json_document(items: int = 12) -> str:
    """A deterministic JSON document: a catalogue of `items` products."""
    rng = random.Random(99)
    products = [{"id": 1000 + i, "name": f"{_NOUNS[i % len(_NOUNS)]} kit {i}", "price": round(rng.uniform(2, 90), 2),
                 "stock": rng.randint(0, 40), "tags": [_VERBS[(i + j) % len(_VERBS)] for j in range(2)]}
                for i in range(items)]
    return json.dumps({"shop": "Harbour Supplies", "currency": "EUR", "products": products}, indent=2)


def workload_text(name: str, settings: Settings) -> str:
    """The user message of workload `name`."""
    if name == "edit":
        const, old, new = EDIT_CHANGE
        return (f"Here is a Python file:\n```python\n{edit_source(settings.edit_lines)}```\nRewrite the whole file "
                f"with {const} changed from {old} to {new}. Output the complete file and nothing else.")
    if name == "json":
        return (f"Here is a JSON document:\n```json\n{json_document(settings.json_items)}\n```\nReturn the same "
                'document with a field "updated": true added to the top-level object. Output only the JSON.')
    if name == "chat":
        return CHAT_PROMPT
    raise ValueError(f"unknown workload {name!r}")


def prompt_ids(loaded: LoadedModel, name: str, settings: Settings) -> list[int]:
    """The chat prompt of workload `name` as token ids, the same for every system. The edit and json answers
    start with their code fence, as a coding tool prefills them, so a small model answers with the document."""
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": workload_text(name, settings)}])
    return tok.encode(text + ANSWER_START.get(name, ""), add_special=False)


@dataclass
class Run:
    """One greedy generation: its tokens, decode rate (first token to last) and drafting counts."""

    tokens: list[int]
    seconds: float
    decode_tok_s: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


def _rate(n: int, first: float | None, last: float | None) -> float:
    return (n - 1) / (last - first) if first is not None and last is not None and last > first else 0.0


class HafizaSystem:
    """One hafiza engine, plain or speculating, on the loaded model."""

    def __init__(self, loaded: LoadedModel, spec: Any, draft: LoadedModel | None = None) -> None:
        from hafiza.engine import EngineConfig, LLMEngine

        self.engine = LLMEngine(loaded, EngineConfig(kv_memory="512MiB", speculative=spec, draft_model=draft))
        self.salt = 0

    def generate(self, ids: list[int], max_tokens: int) -> Run:
        """Greedy tokens of `ids`, prefilled cold (a fresh cache salt) so every run does the same work."""
        from hafiza.engine import SamplingParams

        before = self.engine.stats().spec
        self.salt += 1
        t0 = time.perf_counter()
        self.engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0),
                                cache_salt=f"bench-{self.salt}")
        tokens: list[int] = []
        first = last = None
        at_first = 0
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.new_token_ids:
                    tokens += out.new_token_ids
                    last = time.perf_counter()
                    if first is None:
                        first, at_first = last, len(tokens)
        seconds = time.perf_counter() - t0
        after = self.engine.stats().spec
        run = Run(tokens, seconds, _rate(len(tokens) - at_first + 1, first, last))
        if before is not None and after is not None:
            run.drafts = after.num_drafts - before.num_drafts
            run.draft_tokens = after.num_draft_tokens - before.num_draft_tokens
            run.accepted_tokens = after.num_accepted_tokens - before.num_accepted_tokens
        return run


class LlamaSystem:
    """llama-cpp-python on the same GGUF, plain or with `LlamaPromptLookupDecoding` drafting."""

    def __init__(self, llama_cpp: Any, path: Path, n_ctx: int, threads: int, eos: list[int],
                 lookup: tuple[int, int] | None) -> None:
        self.drafted: list[tuple[int, list[int]]] = []
        draft = None
        if lookup is not None:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            inner = LlamaPromptLookupDecoding(max_ngram_size=lookup[0], num_pred_tokens=lookup[1])

            def draft(input_ids: Any, /, **kwargs: Any) -> Any:
                out = inner(input_ids, **kwargs)
                self.drafted.append((len(input_ids), [int(t) for t in out]))
                return out

            draft = _Drafter(draft)
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False, draft_model=draft,
                                   logits_all=draft is not None)
        self.eos = set(eos)

    def generate(self, ids: list[int], max_tokens: int) -> Run:
        """Greedy tokens of `ids` after a fresh prefill; drafts counted as accepted up to the first mismatch."""
        self.llm.reset()
        self.drafted.clear()
        tokens: list[int] = []
        t0 = time.perf_counter()
        first = last = None
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True):
            if token in self.eos:
                break
            tokens.append(int(token))
            last = time.perf_counter()
            first = first or last
            if len(tokens) >= max_tokens:
                break
        seconds = time.perf_counter() - t0
        run = Run(tokens, seconds, _rate(len(tokens), first, last))
        for length, draft in self.drafted:
            if not draft:
                continue
            start = length - len(ids)
            actual = tokens[start:start + len(draft)]
            if len(actual) < len(draft) and start + len(actual) >= len(tokens):
                continue  # drafted past the end of the generation: never verified against a kept token
            run.drafts += 1
            run.draft_tokens += len(draft)
            run.accepted_tokens += next((i for i, (a, b) in enumerate(zip(draft, actual, strict=False)) if a != b),
                                        min(len(draft), len(actual)))
        return run


class _Drafter:
    """A `LlamaDraftModel` that forwards to a callable (llama-cpp-python calls its draft model with the ids)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        return self.fn(input_ids, **kwargs)


def systems(loaded: LoadedModel, settings: Settings, n_ctx: int, draft: LoadedModel | None = None,
            ) -> tuple[dict[tuple[str, str], Any], str | None]:
    """The systems to interleave, keyed (system, method), and why llama.cpp is missing (None: it is there)."""
    import torch

    from hafiza.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig("ngram", settings.num_speculative_tokens, settings.prompt_lookup_max,
                             settings.prompt_lookup_min)
    out: dict[tuple[str, str], Any] = {("hafiza", "none"): HafizaSystem(loaded, None),
                                       ("hafiza", "ngram"): HafizaSystem(loaded, spec)}
    if draft is not None:
        drafted = SpeculativeConfig("draft", settings.num_speculative_tokens, speculative_model=str(draft.path))
        out[("hafiza", "draft")] = HafizaSystem(loaded, drafted, draft)
    llama_cpp, reason = llama_import()
    if llama_cpp is None:
        return out, reason
    if loaded.path.suffix != ".gguf":
        return out, f"llama.cpp reads GGUF files only; {loaded.path.name} is not one"
    threads, eos = torch.get_num_threads(), list(loaded.tokenizer.eos_token_ids)
    out[("llama.cpp", "none")] = LlamaSystem(llama_cpp, loaded.path, n_ctx, threads, eos, None)
    out[("llama.cpp", "prompt lookup")] = LlamaSystem(llama_cpp, loaded.path, n_ctx, threads, eos,
                                                      (settings.llama_ngram_size, settings.llama_pred_tokens))
    return out, None


def run_bench(loaded: LoadedModel, settings: Settings, workloads: tuple[str, ...] = WORKLOADS,
              draft: LoadedModel | None = None) -> dict[str, Any]:
    """Every system on every workload, `repeats` rounds interleaved (each round runs every pair once); medians.
    `draft`: the loaded draft model for the draft method (None: that system is left out)."""
    prompts = {w: prompt_ids(loaded, w, settings) for w in workloads}
    n_ctx = max(len(p) for p in prompts.values()) + settings.max_tokens + 64
    chosen, reason = systems(loaded, settings, n_ctx, draft)
    warm = prompts[workloads[0]][:32]
    for system in chosen.values():
        system.generate(warm, 4)
    runs: dict[tuple[str, str, str], list[Run]] = {}
    load_start = os.getloadavg()[0]
    for _ in range(settings.repeats):
        for w in workloads:
            for key, system in chosen.items():
                runs.setdefault((*key, w), []).append(system.generate(prompts[w], settings.max_tokens))
    results = []
    for (system, method, w), samples in runs.items():
        reference = runs[(system, "none", w)][0].tokens
        drafts = sum(r.drafts for r in samples)
        drafted = sum(r.draft_tokens for r in samples)
        accepted = sum(r.accepted_tokens for r in samples)
        tok_s = statistics.median(r.decode_tok_s for r in samples)
        plain = statistics.median(r.decode_tok_s for r in runs[("hafiza", "none", w)])
        results.append({
            "model": loaded.path.name, "system": system, "method": method, "workload": w,
            "tok_s": tok_s, "speedup_vs_hafiza_plain": tok_s / plain if plain else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_len": accepted / drafts if drafts else None,
            "identical": all(r.tokens == reference for r in samples),
            "matches_hafiza_plain": samples[0].tokens == runs[("hafiza", "none", w)][0].tokens,
            "output_tokens": len(samples[0].tokens), "prompt_tokens": len(prompts[w]),
            "drafts_per_token": drafts / sum(len(r.tokens) for r in samples) if samples else 0.0,
            "seconds": statistics.median(r.seconds for r in samples), "samples": len(samples),
            "tok_s_runs": [r.decode_tok_s for r in samples]})
    for r in results:
        if r["system"] == "hafiza" and r["method"] in ("ngram", "draft"):
            peer = next((p for p in results if p["system"] == "llama.cpp" and p["method"] == "prompt lookup"
                         and p["workload"] == r["workload"]), None)
            r["speedup_vs_llamacpp_lookup"] = r["tok_s"] / peer["tok_s"] if peer and peer["tok_s"] else None
    return {"model": loaded.path.name, "settings": settings.__dict__, "workloads": list(workloads),
            "llama_cpp": reason or "measured", "load_average_start": load_start,
            "load_average_end": os.getloadavg()[0], "results": results,
            "texts": {w: loaded.tokenizer.decode(runs[("hafiza", "none", w)][0].tokens)[:300] for w in workloads}}


COLUMNS = ("workload", "system", "method", "tok_s", "speedup_vs_hafiza_plain", "speedup_vs_llamacpp_lookup",
           "acceptance_rate", "mean_accepted_len", "drafts_per_token", "identical", "output_tokens")


def _cell(v: Any) -> str:
    if v is None:
        return ""
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def rows(data: dict[str, Any]) -> list[list[str]]:
    """The results as table rows, grouped by workload."""
    ordered = sorted(data["results"], key=lambda r: (WORKLOADS.index(r["workload"]), r["system"], r["method"]))
    return [[_cell(r.get(c)) for c in COLUMNS] for r in ordered]


def markdown(data: dict[str, Any]) -> str:
    """The docs region: a markdown table of the results, the model and what llama.cpp did."""
    note = "" if data["llama_cpp"] == "measured" else f"\n\nllama.cpp not measured: {data['llama_cpp']}"
    return f"Model: `{data['model']}`, settings: `{json.dumps(data['settings'])}`\n\n{table(COLUMNS, rows(data))}{note}"


def print_table(data: dict[str, Any]) -> None:
    """The results as a rich table, and why llama.cpp is missing when it is."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if Console().is_terminal else 160)
    t = Table(title=f"Speculative decoding, greedy, {data['model']} (decode tok/s, medians)")
    for c in COLUMNS:
        t.add_column(c, justify="left" if c in ("workload", "system", "method") else "right")
    for r in rows(data):
        t.add_row(*r)
    console.print(t)
    if data["llama_cpp"] != "measured":
        console.print(f"llama.cpp not measured: {data['llama_cpp']}", markup=False)


def register(bench_app: typer.Typer) -> None:
    """Add `hafiza bench speculative`."""

    @bench_app.command("speculative")
    def speculative(
        json_path: Annotated[str | None, typer.Option("--json", help="Where to write the JSON results.")] = None,
        model: Annotated[str | None, typer.Option(help="GGUF file (default: SmolLM2-135M Q4_1).")] = None,
        workloads: Annotated[str, typer.Option(help="Comma-separated: edit, json, chat.")] = ",".join(WORKLOADS),
        max_tokens: Annotated[int, typer.Option(help="Greedy tokens per request.")] = Settings.max_tokens,
        repeats: Annotated[int, typer.Option(help="Interleaved rounds (medians reported).")] = Settings.repeats,
        edit_lines: Annotated[int, typer.Option(help="Lines of the edit workload's file.")] = Settings.edit_lines,
        num_speculative_tokens: Annotated[int, typer.Option(help="hafiza: most tokens drafted per step.")
                                          ] = Settings.num_speculative_tokens,
        prompt_lookup_max: Annotated[int, typer.Option(help="hafiza: longest n-gram looked up.")
                                     ] = Settings.prompt_lookup_max,
        prompt_lookup_min: Annotated[int, typer.Option(help="hafiza: shortest n-gram looked up.")
                                     ] = Settings.prompt_lookup_min,
        llama_pred_tokens: Annotated[int, typer.Option(help="llama.cpp LlamaPromptLookupDecoding num_pred_tokens.")
                                     ] = Settings.llama_pred_tokens,
        llama_ngram_size: Annotated[int, typer.Option(help="llama.cpp LlamaPromptLookupDecoding max_ngram_size.")
                                    ] = Settings.llama_ngram_size,
        draft_model: Annotated[str | None, typer.Option(help="hafiza: also run the draft method with this small "
                                                             "model (path or name as for --model; same tokenizer).")
                               ] = None,
        docs: Annotated[str | None, typer.Option(help="Also write the table into this markdown file's "
                                                      "'Speculative decoding' section.")] = None,
        weights: Weights = "auto",
    ) -> None:
        """Greedy decode speed: plain, ngram drafting, a draft model and llama.cpp prompt lookup, on edit, json
        and chat."""
        from hafiza.errors import HafizaError
        from hafiza.models import load_model
        from hafiza.models.weights import check_weights_mode

        check_weights_mode(weights)
        chosen = tuple(w.strip() for w in workloads.split(",") if w.strip())
        bad = [w for w in chosen if w not in WORKLOADS]
        if bad or not chosen:
            raise HafizaError(f"--workloads: choose from {', '.join(WORKLOADS)}, got {workloads!r}")
        if min(max_tokens, repeats, edit_lines) < 1:
            raise HafizaError("--max-tokens, --repeats and --edit-lines must be positive")
        settings = Settings(max_tokens, repeats, edit_lines, Settings.json_items, num_speculative_tokens,
                            prompt_lookup_max, prompt_lookup_min, llama_pred_tokens, llama_ngram_size, draft_model)
        loaded = load_model(model, dtype="fp32", device="cpu", weights=weights)
        draft = None
        if draft_model is not None:
            from hafiza.engine.speculative.draft import check_same_vocab
            from hafiza.errors import ConfigError

            draft = load_model(draft_model, dtype="fp32", device="cpu", weights=weights)
            try:
                check_same_vocab(loaded, draft)
            except ConfigError as exc:
                raise HafizaError(f"--draft-model: {exc}") from None
        data = run_bench(loaded, settings, chosen, draft)
        print_table(data)
        print(f"wrote {write_json(data, json_path, f'speculative-{loaded.path.stem}.json')}")
        if docs:
            path = Path(docs)
            path.write_text(replace_region(path.read_text(), REGION, markdown(data)))
