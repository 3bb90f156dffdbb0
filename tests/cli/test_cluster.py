"""`hafiza cluster`: the commands it runs wire every worker's event sockets to the router, and bad options are
clear errors (`main` prints a HafizaError as one line)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hafiza.cli import _register, app
from hafiza.cluster import Layout
from hafiza.errors import HafizaError


def test_the_router_reads_each_workers_events_and_replay_socket() -> None:
    layout = Layout.on_free_ports(3)
    router = layout.router_command()
    assert router[router.index("--policy") + 1] == "kv_aware"
    for w in layout.workers:
        assert f"{w.url}=tcp://127.0.0.1:{w.events}" in router
        assert f"{w.url}=tcp://127.0.0.1:{w.replay}" in router
    for w, cmd in zip(layout.workers, layout.worker_commands(), strict=True):
        assert cmd[cmd.index("--kv-events") + 1] == f"tcp://127.0.0.1:{w.events}"
        assert cmd[cmd.index("--store-redis") + 1] == layout.redis_url
    ports = [p for w in layout.workers for p in (w.port, w.events, w.replay)] + [layout.redis_port, layout.router_port]
    assert len(set(ports)) == len(ports)


def test_round_robin_gets_no_event_sources() -> None:
    assert "--kv-event-source" not in Layout.on_free_ports(2, "round_robin").router_command()


@pytest.mark.parametrize(("args", "message"), [(["--workers", "0"], "--workers must be at least 1"),
                                               (["--policy", "random"], "--policy must be kv_aware")])
def test_bad_options_are_a_clear_error_before_anything_starts(args: list[str], message: str) -> None:
    _register()
    result = CliRunner().invoke(app, ["cluster", *args])
    assert isinstance(result.exception, HafizaError) and message in str(result.exception), result.output
