"""SpeculativeConfig: vLLM's defaults for the lookup bounds, and bad values named."""

from __future__ import annotations

import pytest

from hafiza.engine.speculative import SpeculativeConfig
from hafiza.errors import ConfigError


def test_lookup_bounds_default_to_each_other() -> None:
    assert SpeculativeConfig().lookup_range == (5, 5)
    assert SpeculativeConfig(prompt_lookup_max=4).lookup_range == (4, 4)
    assert SpeculativeConfig(prompt_lookup_min=2).lookup_range == (2, 2)
    assert SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3).lookup_range == (1, 3)


@pytest.mark.parametrize(("config", "setting"), [
    (SpeculativeConfig(method="eagle"), "speculative_method"),
    (SpeculativeConfig(num_speculative_tokens=0), "num_speculative_tokens"),
    (SpeculativeConfig(prompt_lookup_min=0), "prompt_lookup_min"),
    (SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
    (SpeculativeConfig(method="draft"), "speculative_model"),
    (SpeculativeConfig(method="draft", speculative_model="m", prompt_lookup_max=3), "prompt_lookup_max"),
    (SpeculativeConfig(method="draft", speculative_model="m", prompt_lookup_min=1), "prompt_lookup_min"),
    (SpeculativeConfig(speculative_model="m"), "speculative_model"),
])
def test_bad_values_name_their_setting(config: SpeculativeConfig, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.validate()
    assert err.value.setting == setting


def test_draft_with_its_model_is_valid() -> None:
    SpeculativeConfig(method="draft", speculative_model="m").validate()


@pytest.mark.parametrize(("args", "message"), [
    ((None, None, None, None), "--speculative-model needs --speculative-method draft"),
    (("ngram", None, None, None), "--speculative-model"),
    (("draft", None, 3, None), "--prompt-lookup-max"),
])
def test_cli_refuses_the_draft_model_option_out_of_place(args: tuple, message: str) -> None:
    from hafiza.cli.speculative import speculative_config
    from hafiza.errors import HafizaError

    with pytest.raises(HafizaError, match=message):
        speculative_config(*args, speculative_model="small.gguf")


def test_cli_draft_needs_its_model() -> None:
    from hafiza.cli.speculative import speculative_config
    from hafiza.errors import HafizaError

    with pytest.raises(HafizaError, match="--speculative-model"):
        speculative_config("draft", None, None, None)
    config = speculative_config("draft", 3, None, None, speculative_model="small.gguf")
    assert config is not None and config.speculative_model == "small.gguf" and config.num_speculative_tokens == 3
