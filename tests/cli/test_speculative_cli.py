"""`--speculative-method` and its options on `hafiza generate`: bad values are one clear line naming the option
(checked before the model loads); ngram speculation prints what plain decoding prints."""

from __future__ import annotations

import pytest

from tests.cli.test_generate_cli import assert_clean_error, hafiza


@pytest.mark.parametrize(("args", "needles"), [
    (["--speculative-method", "eagle"], ["--speculative-method", "eagle"]),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], ["--num-speculative-tokens"]),
    (["--speculative-method", "ngram", "--prompt-lookup-min", "0"], ["--prompt-lookup-min"]),
    (["--speculative-method", "ngram", "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"],
     ["--prompt-lookup-max"]),
    (["--num-speculative-tokens", "3"], ["--num-speculative-tokens", "--speculative-method"]),
    (["--speculative-method", "ngram", "--eviction", "streaming", "--kv-budget-tokens", "256"], ["--eviction"]),
])
def test_bad_values_name_the_option(args: list[str], needles: list[str]) -> None:
    assert_clean_error(hafiza("generate", "x", *args), *needles)


def test_ngram_prints_the_plain_text() -> None:
    prompt = "one two three four five, one two three four five, one two three"
    common = ["generate", prompt, "--max-tokens", "16", "--temperature", "0"]
    plain = hafiza(*common)
    spec = hafiza(*common, "--speculative-method", "ngram", "--prompt-lookup-min", "1", "--prompt-lookup-max", "3")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
