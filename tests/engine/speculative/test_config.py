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
])
def test_bad_values_name_their_setting(config: SpeculativeConfig, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.validate()
    assert err.value.setting == setting
