"""The speculative-decoding options `hafiza serve` and `hafiza generate` share (vLLM's names and meanings), and
their check, done before any model loads so a bad value costs one line and no wait."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from hafiza.engine.speculative import SpeculativeConfig
    from hafiza.models import LoadedModel

SpeculativeMethod = Annotated[str | None, typer.Option(
    help="Speculative decoding: ngram drafts tokens by prompt lookup, draft runs --speculative-model ahead; "
         "drafts are verified in the same step (greedy output is bit-identical to plain decoding).")]
NumSpeculativeTokens = Annotated[int | None, typer.Option(
    help="With --speculative-method: most tokens drafted per step (default 4).")]
PromptLookupMax = Annotated[int | None, typer.Option(
    help="With --speculative-method ngram: longest n-gram looked up (default: --prompt-lookup-min, else 5).")]
PromptLookupMin = Annotated[int | None, typer.Option(
    help="With --speculative-method ngram: shortest n-gram looked up (default: --prompt-lookup-max, else 5).")]
SpeculativeModel = Annotated[str | None, typer.Option(
    help="With --speculative-method draft: the draft model (path or name as for --model), same tokenizer as the "
         "target.")]


def speculative_config(method: str | None, num_tokens: int | None, lookup_max: int | None,
                       lookup_min: int | None, eviction: str | None = None,
                       speculative_model: str | None = None) -> SpeculativeConfig | None:
    """The engine's speculative settings from the options (None: off); a bad value raises HafizaError naming its
    option."""
    from hafiza.engine.speculative import SpeculativeConfig
    from hafiza.errors import ConfigError, HafizaError

    flags = {"--num-speculative-tokens": num_tokens, "--prompt-lookup-max": lookup_max,
             "--prompt-lookup-min": lookup_min, "--speculative-model": speculative_model}
    if method is None:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            needed = " draft" if given[0] == "--speculative-model" else ""
            raise HafizaError(f"{given[0]} needs --speculative-method{needed}")
        return None
    if eviction is not None:
        raise HafizaError(f"--speculative-method does not combine with --eviction {eviction}")
    config = SpeculativeConfig(method, 4 if num_tokens is None else num_tokens, lookup_max, lookup_min,
                               speculative_model)
    try:
        config.validate()
    except ConfigError as exc:
        raise HafizaError(f"--{(exc.setting or 'speculative_method').replace('_', '-')}: {exc}") from None
    return config


def load_draft(config: SpeculativeConfig | None, dtype: str, device: str, weights: str) -> LoadedModel | None:
    """The draft model the draft method runs, loaded as the target is (None for other methods or none at all)."""
    if config is None or config.method != "draft" or config.speculative_model is None:
        return None
    from hafiza.models import load_model

    return load_model(config.speculative_model, dtype=dtype, device=device, weights=weights)
