"""Usage errors as a new user meets them: every command, given an unknown option or a malformed value of a typed
option, ends in one line on stderr that names the command and the option, with exit status 2 and no traceback.

The commands are found by walking the typer/click tree, and run in this process through the entry point
(`hafiza.cli.main`); parsing fails before any command body runs, so nothing is loaded."""

from __future__ import annotations

import enum
import inspect
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
import typer
from typer.models import ParameterInfo

from hafiza.cli import _register, app
from tests.support.serve import run_cli

UNKNOWN = "--no-such-option-for-hafiza"


def commands() -> list[tuple[list[str], Any]]:
    """(path, click command) for `hafiza` and every group and command under it."""
    _register()
    found: list[tuple[list[str], Any]] = []

    def walk(cmd: Any, path: list[str]) -> None:
        found.append((path, cmd))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def _unwrap(annotation: Any) -> tuple[Any, ParameterInfo | None]:
    """The annotation without Annotated, Optional or list[...], and the typer Option/Argument info it carried."""
    info = None
    if typing.get_origin(annotation) is Annotated:
        annotation, *meta = typing.get_args(annotation)
        info = next((m for m in meta if isinstance(m, ParameterInfo)), None)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
    if typing.get_origin(annotation) is list:
        annotation = typing.get_args(annotation)[0]
    return annotation, info


def malformed(annotation: Any, info: ParameterInfo | None) -> str | None:
    """A value the option's type refuses, or None when every string is a valid value (str, a path that need not
    exist, a flag)."""
    if annotation is bool:
        return None
    if annotation is int or annotation is float:
        return "not-a-number"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "no-such-choice"
    if typing.get_origin(annotation) is Literal:
        return "no-such-choice"
    if annotation is Path and info is not None and (info.exists or not info.file_okay or not info.dir_okay):
        return "/nonexistent/hafiza-usage-test"
    return None


def typed_options() -> list[tuple[list[str], str, str]]:
    """(command path, option name, malformed value) for every typed option of every command."""
    cases = []
    for path, cmd in commands():
        if cmd.callback is None or getattr(cmd, "commands", None):
            continue
        hints = typing.get_type_hints(cmd.callback, include_extras=True)
        signature = inspect.signature(cmd.callback)
        for param in cmd.params:
            if param.param_type_name != "option" or param.name not in hints:
                continue
            annotation, info = _unwrap(hints[param.name])
            default = signature.parameters[param.name].default
            info = info or (default if isinstance(default, ParameterInfo) else None)
            value = malformed(annotation, info)
            if value is not None:
                name = max(param.opts, key=len)
                cases.append((path, name, value))
    return cases


COMMANDS = [path for path, _ in commands()]
TYPED = typed_options()


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_the_walk_finds_typed_options() -> None:
    assert len(COMMANDS) > 10 and len(TYPED) > 20  # the tree was walked, not an empty app
    assert (["serve"], "--port", "not-a-number") in TYPED


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "hafiza")
def test_an_unknown_option_is_one_line(path: list[str], monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    done = run_cli([*path, UNKNOWN], monkeypatch, capsys)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr)
    assert UNKNOWN in line and line.startswith(f"error: {' '.join(['hafiza', *path])}: "), line


@pytest.mark.parametrize(("path", "option", "value"), TYPED, ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_a_malformed_value_names_its_option(path: list[str], option: str, value: str,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    done = run_cli([*path, option, value], monkeypatch, capsys)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr)
    assert f"'{option}'" in line and " ".join(["hafiza", *path]) in line, line


def test_an_unknown_command_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for path in (["bogus"], ["bench", "bogus"], ["codec", "bogus"]):
        done = run_cli(path, monkeypatch, capsys)
        assert done.returncode == 2
        line = _one_line(done.stderr)
        assert "'bogus'" in line and line.startswith(f"error: {' '.join(['hafiza', *path[:-1]])}: "), line


def test_no_arguments_prints_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for path in ([], ["bench"], ["codec"]):
        done = run_cli(path, monkeypatch, capsys)
        assert done.returncode == 2 and "Usage" in done.stdout + done.stderr
        assert "Traceback" not in done.stderr
