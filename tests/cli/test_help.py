"""Every command's --help renders (help texts are rich markup: a stray `[...]` once made `serve --help` crash)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from hafiza.cli import _register, app


def command_paths() -> list[list[str]]:
    _register()
    root = typer.main.get_command(app)
    paths: list[list[str]] = []

    def walk(cmd: object, path: list[str]) -> None:
        paths.append(path)
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*path, name])

    walk(root, [])
    return paths


@pytest.mark.parametrize("path", command_paths(), ids=lambda p: " ".join(p) or "hafiza")
def test_help_renders(path: list[str]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output
