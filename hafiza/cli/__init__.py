"""The `hafiza` command: serve | generate | bench | codec | memory | top.

Each sub-command lives in its own module and registers itself on `app` (or on `bench_app` for benchmarks).
User errors (HafizaError) end in one clear line and exit status 2, never a traceback; a configuration error
also names the option that sets the field at fault (library messages name no flag).
"""

from __future__ import annotations

import sys

import typer

from hafiza.errors import ConfigError, HafizaError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="hafiza: an LLM engine built around its KV cache")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: print a table, write JSON under bench/results/.")
app.add_typer(bench_app, name="bench")


def _register() -> None:
    from hafiza.cli import generate, memory  # noqa: F401  (modules register their commands on import)

    for optional in ("hafiza.cli.serve", "hafiza.cli.cluster", "hafiza.cli.codec", "hafiza.cli.top",
                     "hafiza.bench.commands"):
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


def main() -> None:
    """Entry point: run the typer app, turning user errors into one line on stderr."""
    _register()
    try:
        app(standalone_mode=False)
    except HafizaError as exc:
        print(f"error: {error_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    except (typer.BadParameter, typer.Exit) as exc:
        if isinstance(exc, typer.Exit):
            sys.exit(exc.exit_code)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
