"""`hafiza serve`: the Anthropic Messages and OpenAI Chat Completions APIs over HTTP, with prompt caching."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated

import typer

from hafiza import settings
from hafiza.cli import app
from hafiza.cli.speculative import (
    NumSpeculativeTokens,
    PromptLookupMax,
    PromptLookupMin,
    SpeculativeMethod,
    SpeculativeModel,
    load_draft,
    speculative_config,
)
from hafiza.options import Eviction, KvBudgetTokens, KvDtype, Weights

if TYPE_CHECKING:
    from hafiza.engine.engine import LLMEngine
    from hafiza.server.store import StoreOptions
    from hafiza.store.connector import StoreConnector


@app.command()
def serve(
    model: Annotated[str | None, typer.Option(help="GGUF file or model directory (default: SmolLM2-135M).")] = None,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[list[str] | None, typer.Option(
        metavar="KEY",
        help="Require an API key: x-api-key (Anthropic routes) or Authorization: Bearer (OpenAI routes). "
             "Repeat for several keys; each is then its own cache partition.",
        envvar=settings.API_KEY.name)] = None,
    api_keys_file: Annotated[str | None, typer.Option(
        help="More API keys, one per line ('#' comments).")] = None,
    admin_key: Annotated[str | None, typer.Option(
        help="The key for dashboard actions and cached prompt text (distinct from every API key).",
        envvar=settings.ADMIN_KEY.name)] = None,
    shared_cache: Annotated[bool, typer.Option(
        help="Let all API keys share one cache partition (a request's cache_salt still partitions).")] = False,
    explain_details: Annotated[bool, typer.Option(
        help="x-hafiza-cache names the earlier request and token offset it compared with (same partition).")
                               ] = False,
    allowed_host: Annotated[list[str] | None, typer.Option(
        metavar="HOST",
        help="Host header to accept (repeatable; '*' for any). Default: the bind address and localhost.")] = None,
    cors_origin: Annotated[list[str] | None, typer.Option(
        metavar="ORIGIN",
        help="Browser origin allowed to call the API cross-origin (repeatable). Default: none.")] = None,
    metrics_auth: Annotated[str, typer.Option(help="Who may read /metrics: none, api or admin.")] = "none",
    dashboard_auth: Annotated[str, typer.Option(
        help="Who may read /dashboard/state: none, api or admin (actions and prompt text: admin).")] = "api",
    model_name: Annotated[str | None, typer.Option(
        help="Model id clients send (default: the model file's stem).")] = None,
    kv_memory: Annotated[str, typer.Option(help="KV pool size: auto, a size (2GiB) or a fraction of free memory.")
                         ] = "auto",
    kv_dtype: KvDtype = "auto",
    eviction: Eviction = None,
    kv_budget_tokens: KvBudgetTokens = None,
    min_cache_tokens: Annotated[int, typer.Option(
        help="Shortest prefix a cache_control breakpoint caches (shorter ones are ignored, no error).")] = 1024,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Compute dtype: fp32 or bf16.")] = "fp32",
    weights: Weights = "auto",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    max_num_seqs: Annotated[int, typer.Option(help="Most requests in the running batch.")] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Most tokens computed per engine step.")] = 512,
    max_model_len: Annotated[int | None, typer.Option(help="Cap on prompt + output tokens (default: the model's).")
                             ] = None,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body accepted (413 above).")] = 8 * 2**20,
    max_messages: Annotated[int, typer.Option(help="Most messages in one request (400 above).")] = 10_000,
    max_prompt_chars: Annotated[int | None, typer.Option(
        help="Longest prompt in characters, content and rendered template (400 above; default: 32 per token "
             "of the model's context).")] = None,
    header_timeout: Annotated[float, typer.Option(
        help="Seconds a connection may take to send its request headers before it is closed.")] = 10.0,
    body_timeout: Annotated[float, typer.Option(
        help="Seconds a request body may take to arrive after its headers (408 above).")] = 60.0,
    allow_special_tokens_in_content: Annotated[bool, typer.Option(
        help="Read special-token text in message content as the special token (lets content forge turns).")
                                               ] = False,
    max_waiting: Annotated[int | None, typer.Option(
        help="Most requests waiting for admission; more are refused (429 / 529 with retry-after).")] = None,
    max_queue_time: Annotated[float | None, typer.Option(
        help="Seconds a request may wait for admission before it is refused (429 / 529 with retry-after).")
                              ] = None,
    prices: Annotated[str | None, typer.Option(
        help="Price table for the savings metrics: input_per_mtok=3,read=0.1,write_5m=1.25,write_1h=2.")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    store_ram: Annotated[str | None, typer.Option(help="KV store tier in host RAM of this size (e.g. 4GiB).")] = None,
    store_disk: Annotated[str | None, typer.Option(
        help="KV store tier on local disk: DIR[:SIZE] (default 10GiB); survives restarts.")] = None,
    store_redis: Annotated[str | None, typer.Option(
        help="KV store tier shared by instances: redis://host:port or redis://host:port/DB, or "
             "redis+cluster://host:port (?ttl=SECONDS, default 300; ?prefix=).")] = None,
    store_codec: Annotated[str, typer.Option(
        help="Lossless codec of stored KV blocks, every tier's default: raw, zstd, fast, planes, exponent, "
             "predictive or speculative (reruns a cheaper predictor on the prefix tokens at load).")] = "fast",
    store_ram_codec: Annotated[str | None, typer.Option(help="Codec of the RAM tier (default --store-codec).")
                               ] = None,
    store_disk_codec: Annotated[str | None, typer.Option(help="Codec of the disk tier (default --store-codec).")
                                ] = None,
    store_redis_codec: Annotated[str | None, typer.Option(
        help="Codec of the Redis tier (default --store-codec), e.g. speculative where capacity is the limit.")
                                 ] = None,
    store_write_back: Annotated[bool, typer.Option(
        help="Write blocks to RAM first, to disk/Redis on eviction and at shutdown (needs --store-ram).")] = False,
    kv_events: Annotated[str | None, typer.Option(
        metavar="ENDPOINT",
        help="Publish KV cache events (vLLM's format, 16-token blocks) on a ZMQ PUB socket, e.g. "
             "tcp://127.0.0.1:5557, for vllm-router's kv_aware policy.")] = None,
    kv_events_replay: Annotated[str | None, typer.Option(
        metavar="ENDPOINT",
        help="ZMQ ROUTER socket where a subscriber that missed KV events asks for them again (needs --kv-events).")
                                ] = None,
    role: Annotated[str, typer.Option(
        help="Part in a prefill/decode split behind vllm-router --vllm-pd-disaggregation: prefill (compute prompts, "
             "write their KV blocks to Redis) or decode (load them from Redis), both needing --store-redis; or "
             "both (an ordinary worker).")] = "both",
    speculative_method: SpeculativeMethod = None,
    num_speculative_tokens: NumSpeculativeTokens = None,
    prompt_lookup_max: PromptLookupMax = None,
    prompt_lookup_min: PromptLookupMin = None,
    speculative_model: SpeculativeModel = None,
) -> None:
    """Serve the model over HTTP until interrupted."""
    import uvicorn

    from hafiza.engine import EngineConfig
    from hafiza.errors import HafizaError
    from hafiza.server import PriceTable, ServerSettings, create_app
    from hafiza.server.launch import build_engine, describe, served_name, uvicorn_config
    from hafiza.server.pd import PDWorker, check_role
    from hafiza.server.store import serve_store

    if min_cache_tokens < 0 or max_body_bytes < 1:
        raise HafizaError("--min-cache-tokens must be >= 0 and --max-body-bytes >= 1")
    if block_size < 1 or max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise HafizaError("--block-size, --max-num-seqs and --max-num-batched-tokens must be positive")
    if max_messages < 1 or (max_prompt_chars is not None and max_prompt_chars < 1) or not header_timeout > 0 \
            or not body_timeout > 0:
        raise HafizaError("--max-messages, --max-prompt-chars, --header-timeout and --body-timeout must be positive")
    if (max_waiting is not None and max_waiting < 0) or (max_queue_time is not None and not max_queue_time > 0):
        raise HafizaError("--max-waiting must be >= 0 and --max-queue-time > 0")
    if kv_events_replay is not None and kv_events is None:
        raise HafizaError("--kv-events-replay needs --kv-events")
    if kv_events is not None and block_size % 16:
        raise HafizaError(f"--kv-events announces blocks of 16 tokens, as vLLM does: --block-size {block_size} "
                          f"must be a multiple of 16")
    check_role(role, store_redis)
    speculative = speculative_config(speculative_method, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min,
                                     eviction, speculative_model)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    security = _security(host, api_key, api_keys_file, admin_key, shared_cache, explain_details, allowed_host,
                         cors_origin, metrics_auth, dashboard_auth)
    price_table = PriceTable.parse(prices)
    store = _store_options(store_ram, store_disk, store_redis, store_codec, store_write_back,
                           {"ram": store_ram_codec, "disk": store_disk_codec, "redis": store_redis_codec})
    config = EngineConfig(kv_memory=kv_memory, kv_dtype=kv_dtype, block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                          eviction=eviction, kv_budget_tokens=kv_budget_tokens, speculative=speculative,
                          draft_model=load_draft(speculative, dtype, device, weights))
    aengine = build_engine(model, device, dtype, config, max_waiting, max_queue_time, weights=weights)
    connector = _connect_store(aengine.engine, store)
    events = None
    try:
        if kv_events is not None:
            from hafiza.server.kv_events import publish_kv_events

            events = publish_kv_events(aengine.engine, kv_events, kv_events_replay)
        lm = aengine.engine.loaded
        name = model_name or served_name(lm)
        aliases = tuple(a for a in (served_name(lm), lm.name) if a != name)
        settings = ServerSettings(model_name=name, aliases=aliases, min_cache_tokens=min_cache_tokens,
                                  max_body_bytes=max_body_bytes, prices=price_table, max_messages=max_messages,
                                  max_prompt_chars=max_prompt_chars, header_timeout_s=header_timeout,
                                  body_timeout_s=body_timeout,
                                  allow_special_tokens_in_content=allow_special_tokens_in_content, **security)
        logging.getLogger("hafiza.server").info("serving %r: %s", name, describe(aengine))
        app = create_app(aengine, settings)
        if connector is not None:
            serve_store(app, connector)
        if role != "both" and connector is not None:
            app.state.hafiza.pd = PDWorker(role, aengine.engine, connector)
        aengine.start()  # everything is attached: from here on only the engine thread touches the engine
        uvicorn.Server(uvicorn_config(app, host, port, log_level.lower(), header_timeout)).run()
    finally:
        aengine.shutdown()
        if events is not None:
            events.close()
        if connector is not None:
            connector.close()


def _security(host: str, api_keys: list[str] | None, keys_file: str | None, admin_key: str | None,
              shared_cache: bool, explain_details: bool, allowed_hosts: list[str] | None,
              cors_origins: list[str] | None, metrics_auth: str, dashboard_auth: str) -> dict[str, object]:
    """The keys, roles and browser rules as ServerSettings fields, checked before the model loads."""
    from hafiza.errors import HafizaError
    from hafiza.server.settings import LOCAL_HOSTS, Access, ServerSettings, read_keys_file

    for flag, value in (("--metrics-auth", metrics_auth), ("--dashboard-auth", dashboard_auth)):
        if value not in {a.value for a in Access}:
            raise HafizaError(f"{flag} must be none, api or admin, got {value!r}")
    keys = (*(api_keys or ()), *(read_keys_file(keys_file) if keys_file else ()))
    hosts = tuple(allowed_hosts) if allowed_hosts else (*LOCAL_HOSTS, host)
    fields: dict[str, object] = {
        "api_keys": keys, "admin_key": admin_key, "shared_cache": shared_cache, "explain_details": explain_details,
        "allowed_hosts": hosts, "cors_origins": tuple(cors_origins or ()), "metrics_auth": Access(metrics_auth),
        "dashboard_auth": Access(dashboard_auth)}
    ServerSettings(**fields)  # raises HafizaError on a bad combination
    log = logging.getLogger("hafiza.server")
    if not keys and admin_key is None and host not in LOCAL_HOSTS:
        log.warning("binding %s without --api-key or --admin-key: anyone who reaches it can use it and clear "
                    "its caches", host)
    if host in ("0.0.0.0", "::") and not allowed_hosts:
        log.warning("binding %s: only Host headers %s are accepted; name the others with --allowed-host",
                    host, ", ".join(LOCAL_HOSTS))
    return fields


def _store_options(ram: str | None, disk: str | None, redis: str | None, codec: str, write_back: bool,
                   tier_codecs: dict[str, str | None]) -> StoreOptions | None:
    """The --store-* options, checked before the model loads (None when no tier is asked for)."""
    from hafiza.server.store import StoreOptions

    options = StoreOptions(ram, disk, redis, codec, write_back,
                           tuple((tier, c) for tier, c in tier_codecs.items() if c is not None))
    options.validate()
    return options if options.enabled else None


def _connect_store(engine: LLMEngine, options: StoreOptions | None) -> StoreConnector | None:
    """Tiered KV store: a connector attached to the engine before its thread starts (None without tiers).

    Pending writes are flushed at the app's lifespan shutdown (uvicorn re-raises SIGTERM after it, so code
    after `uvicorn.run` may never run); `connector.close()` in `serve` also releases the tiers on SIGINT."""
    if options is None:
        return None
    from hafiza.server.store import connect_store

    connector = connect_store(engine, options)
    codecs = ", ".join(f"{n} {c}" for n, c in zip(connector.store.names, connector.codecs, strict=True))
    logging.getLogger("hafiza.store").info("KV store tiers: %s (codecs: %s%s)", " -> ".join(connector.store.names),
                                           codecs, ", write-back" if options.write_back else "")
    return connector
