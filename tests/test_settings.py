"""Every HAFIZA_* variable is read through hafiza/settings.py, when asked for, and listed in docs/ENGINE.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hafiza import settings

ROOT = Path(__file__).resolve().parent.parent
# A read of a HAFIZA_ name: os.environ.get / os.getenv / os.environ[...] / typer's envvar=.
READ = re.compile(r"""(environ\.get|getenv|environ\[|envvar=)\s*\(?\s*["']HAFIZA_""")


def test_no_module_but_settings_reads_a_variable() -> None:
    readers = [str(p.relative_to(ROOT)) for p in (ROOT / "hafiza").rglob("*.py")
               if p.name != "settings.py" and READ.search(p.read_text())]
    assert readers == []


def test_no_module_but_settings_names_a_variable() -> None:
    """Code and docstrings refer to a switch through its Setting, so renaming one touches settings.py alone."""
    named = [str(p.relative_to(ROOT)) for p in (ROOT / "hafiza").rglob("*.py")
             if p.name != "settings.py" and "HAFIZA_" in p.read_text()]
    assert named == []


def test_every_setting_is_documented() -> None:
    doc = (ROOT / "docs" / "ENGINE.md").read_text()
    assert [s.name for s in settings.ALL if f"`{s.name}`" not in doc] == []
    assert all(s.name.startswith("HAFIZA_") and s.doc for s in settings.ALL)


def test_a_setting_is_read_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.ADAPTIVE_THREADS.name, raising=False)
    assert settings.ADAPTIVE_THREADS.read() is True  # on unless asked otherwise
    monkeypatch.setenv(settings.ADAPTIVE_THREADS.name, "0")
    assert settings.ADAPTIVE_THREADS.read() is False
    monkeypatch.setenv(settings.ADAPTIVE_THREADS.name, "1")
    assert settings.ADAPTIVE_THREADS.read() is True
    monkeypatch.setenv(settings.ADAPTIVE_THREADS.name, "yes")  # only `1` keeps the switch on, as it always did
    assert settings.ADAPTIVE_THREADS.read() is False
    monkeypatch.setenv(settings.LLAMA_SERVER.name, "")
    assert settings.LLAMA_SERVER.read() is None and settings.LLAMA_SERVER.is_set()
    assert settings.WEIGHTS_CACHE.read({settings.WEIGHTS_CACHE.name: "off"}) == "off"
    assert settings.WEIGHTS_CACHE.read({}) == ""
