"""Hypothesis profiles for the suite, and each property test's share of the profile's example count.

`ci` (the default, and what `make test` selects) runs the counts the suite always ran; `dev` runs a tenth of them
for a quick local pass (`pytest --hypothesis-profile=dev`, or HYPOTHESIS_PROFILE=dev). Both are deterministic
under load: no per-example deadline and no too-slow health check (a busy core makes both fail at random), and the
same examples on every run (derandomize; no example database carried between runs)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

CI_EXAMPLES = 100
DEV_EXAMPLES = 10


def register_profiles() -> None:
    """Register `ci` and `dev`, and load HYPOTHESIS_PROFILE's (default `ci`); hypothesis's own
    `--hypothesis-profile` option, applied after this, wins over both."""
    common = {"deadline": None, "derandomize": True, "database": None,
              "suppress_health_check": [HealthCheck.too_slow]}
    settings.register_profile("ci", max_examples=CI_EXAMPLES, **common)
    settings.register_profile("dev", max_examples=DEV_EXAMPLES, **common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def examples(share: float) -> int:
    """`share` of the loaded profile's example count (at least 1), for a test whose cases cost much more or much
    less than a typical one; read when the test module is imported, after the profile is loaded."""
    return max(1, round(settings().max_examples * share))
