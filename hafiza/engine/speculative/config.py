"""The speculative-decoding settings of an engine, with vLLM's option names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

from hafiza.errors import ConfigError

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` ngram drafts up to `num_speculative_tokens` tokens per step by prompt lookup: the longest suffix of
    the request's tokens of `prompt_lookup_min`..`prompt_lookup_max` tokens that occurred before is continued by
    what followed it. As in vLLM, a bound left unset takes the other's value, and both default to 5. `method` draft
    runs the small model at `speculative_model` greedily ahead of the target (the engine is handed it loaded)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    speculative_model: str | None = None

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(min, max) n-gram length, vLLM's defaults applied."""
        lo = self.prompt_lookup_min
        hi = self.prompt_lookup_max if self.prompt_lookup_max is not None else (lo if lo is not None else 5)
        return (lo if lo is not None else hi), hi

    def validate(self) -> None:
        """Raise ConfigError naming the first bad setting."""
        if self.method not in METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}",
                              setting="speculative_method")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ConfigError(f"num_speculative_tokens must be between 1 and 64, got {self.num_speculative_tokens}",
                              setting="num_speculative_tokens")
        if self.method == "draft":
            if not self.speculative_model:
                raise ConfigError("speculative method draft needs speculative_model (the draft model's path)",
                                  setting="speculative_model")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} applies to speculative method ngram only, not draft", setting=name)
            return
        if self.speculative_model is not None:
            raise ConfigError(f"speculative_model applies to speculative method draft only, not {self.method}",
                              setting="speculative_model")
        lo, hi = self.lookup_range
        if lo < 1:
            raise ConfigError(f"prompt_lookup_min must be >= 1, got {lo}", setting="prompt_lookup_min")
        if hi < lo:
            raise ConfigError(f"prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo})",
                              setting="prompt_lookup_max")
