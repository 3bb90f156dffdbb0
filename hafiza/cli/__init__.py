"""The `hafiza` command: serve | generate | bench | codec | memory | top.

Each sub-command lives in its own module and registers itself on `app`; the benchmarks
register on `bench_app` (hafiza/bench/commands.py), added here as `hafiza bench`.
User errors (HafizaError) end in one clear line and exit status 2, never a traceback; a configuration error
also names the option that sets the field at fault (library messages name no flag).
"""

from __future__ import annotations

import sys

import typer

from hafiza.errors import ConfigError, HafizaError
from hafiza.threads import openmp_defaults

app = typer.Typer(add_completion=False, no_args_is_help=True, help="hafiza: an LLM engine built around its KV cache")
_registered = False


def _register() -> None:
    """Import every command module (each registers itself on `app`) and add the `bench` group; once."""
    global _registered
    if _registered:
        return
    _registered = True
    from hafiza.cli import generate, memory  # noqa: F401  (modules register their commands on import)

    try:
        from hafiza.bench.commands import bench_app
    except ModuleNotFoundError as exc:
        if exc.name != "hafiza.bench.commands":
            raise
    else:
        app.add_typer(bench_app, name="bench")
    for optional in ("hafiza.cli.serve", "hafiza.cli.cluster", "hafiza.cli.codec", "hafiza.cli.top"):
        try:
            __import__(optional)
        except ModuleNotFoundError as exc:
            if exc.name != optional:
                raise


SETTING_FLAGS = {"kv_memory": "--kv-memory", "kv_dtype": "--kv-dtype", "kv_budget_tokens": "--kv-budget-tokens",
                 "eviction": "--eviction", "max_num_seqs": "--max-num-seqs", "block_size": "--block-size",
                 "store_ram": "--store-ram", "store_disk": "--store-disk", "store_redis": "--store-redis",
                 "store_codec": "--store-codec", "store_ram_codec": "--store-ram-codec",
                 "store_disk_codec": "--store-disk-codec", "store_redis_codec": "--store-redis-codec",
                 "store_write_back": "--store-write-back", "api_keys_file": "--api-keys-file", "prices": "--prices",
                 "admin_key": "--admin-key", "metrics_auth": "--metrics-auth", "dashboard_auth": "--dashboard-auth",
                 "weights": "--weights", "device": "--device"}


def error_line(exc: HafizaError) -> str:
    """The one line printed for a user error: prefixed with the option to change when one is at fault."""
    flag = SETTING_FLAGS.get(exc.setting or "") if isinstance(exc, ConfigError) else None
    return f"{flag}: {exc}" if flag else str(exc)


def usage_line(exc: typer.TyperException) -> str:
    """The one line printed for a usage error (unknown command or option, malformed value): it names the command
    and, through click's message, the option at fault; empty when click already printed help (no arguments)."""
    message = exc.format_message()
    if not message:
        return ""
    ctx = getattr(exc, "ctx", None)
    if ctx is None:
        return f"error: {message}"
    return f"error: {ctx.command_path}: {message} (see '{ctx.command_path} --help')"


def main() -> None:
    """Entry point: run the typer app, turning user and usage errors into one line on stderr.

    OpenMP's defaults are set first, before anything imports torch (hafiza/threads.py); nothing else in hafiza
    touches the environment."""
    openmp_defaults()
    _register()
    try:
        app(prog_name="hafiza", standalone_mode=False)
    except HafizaError as exc:
        print(f"error: {error_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    except typer.TyperException as exc:  # click's errors: usage (status 2) and the rest (their own status)
        line = usage_line(exc)
        if line:
            print(line, file=sys.stderr)
        sys.exit(exc.exit_code)
