"""Router settings: one pydantic-settings model read from flags, environment and a config file.

Every field is a command-line flag (kebab-case; nested ones as ``--fleet.health-interval-s``), an
environment variable (``KVROUTE_PORT``, nested ``KVROUTE_FLEET__HEALTH_INTERVAL_S``; lists and dicts
as JSON, except the comma-separated shorthands ``KVROUTE_REPLICAS`` and ``KVROUTE_API_KEYS``) and a
key of the config file given by ``--config FILE`` or ``KVROUTE_CONFIG``.  Priority: flags, then
environment, then the file, then defaults.

The config file is TOML (``.toml``, read by the standard library) or JSON (``.json``); YAML
(``.yaml``/``.yml``) works too when PyYAML is installed, which kvroute does not require.  Its keys
are the field names, nested tables for ``fleet``, ``tokenizers`` and ``policy_options``::

    port = 8000
    replicas = [
        "http://10.0.0.1:8000",  # KV events by convention: tcp://10.0.0.1:5557, replay :5558
        {url = "http://10.0.0.2:8000", events_endpoint = "tcp://10.0.0.2:6557", replay_endpoint = ""},
    ]
    policy = "cost_model"
    [tokenizers]
    "meta-llama/Llama-3.1-8B-Instruct" = "/models/llama-3.1-8b"
    [fleet]
    health_interval_s = 2.0
"""

from __future__ import annotations

import contextvars
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, IPvAnyNetwork, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from kvroute.common.registration_auth import read_secrets

from kvroute.router.fleet.discovery import ReplicaEntry, entry_url
from kvroute.router.fleet.settings import FleetSettings
from kvroute.router.placement.policy import POLICIES
from kvroute.router.settings_cli import cli_source
from kvroute.router.settings_cli import hint as _hint

# The config file of the settings being built (the sources hook is a classmethod: no instance yet).
_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("kvroute_config_file", default=None)


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may run on (its affinity, which follows cpusets), at most its cgroup
    v2 CPU quota rounded up (a container's CPU limit, which the affinity does not show)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 CPU controller here: the affinity it is
    return cores


def _comma_list(value: Any) -> Any:
    """`a,b,c` from a flag or an env var; JSON lists and real lists pass through."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import json

            return json.loads(text)
        return [item.strip() for item in text.split(",") if item.strip()]
    return value


def config_file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    suffix = path.suffix.lower()
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    if suffix == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    if suffix == ".json":
        return JsonConfigSettingsSource(settings_cls, json_file=path)
    if suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    raise ValueError(f"config file {path}: use .toml or .json (or .yaml with PyYAML installed)")


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVROUTE_",
        env_nested_delimiter="__",
        extra="forbid",  # a typo in the config file is an error, not a silently ignored key
        cli_prog_name="kvroute router",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
        validate_default=True,
    )

    config: Path | None = Field(None, description="config file (.toml or .json; .yaml with PyYAML)")
    _registration_keys: tuple[bytes, ...] = PrivateAttr(())
    # `_hint(NAME)`: what --help calls a flag's value where router/settings_cli.py's rule says less

    # -- listening -------------------------------------------------------------------------
    host: str = Field("0.0.0.0", description="address to listen on", json_schema_extra=_hint("ADDRESS"))
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    listen_backlog: int = Field(
        4096, gt=0, description="connections the kernel completes and queues for the router to accept (the "
        "kernel caps it at net.core.somaxconn); a burst larger than this, on a busy router, waits for TCP's SYN "
        "retransmits (1 s, 3 s, 7 s)"
    )
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate (with its chain) of the listener: the router serves HTTPS (needs "
        "tls_key_file); every worker of --workers N too", json_schema_extra=_hint("FILE"),
    )
    tls_key_file: Path | None = Field(
        None, description="PEM private key of tls_cert_file", json_schema_extra=_hint("FILE")
    )
    workers: int = Field(
        1, ge=1, description="router processes sharing the port (SO_REUSEPORT), each a whole router; 'auto': one "
        "per usable core (CPU affinity, at most the cgroup CPU quota)"
    )

    # -- fleet -----------------------------------------------------------------------------
    replicas: Annotated[list[str | ReplicaEntry], NoDecode] = Field(
        default_factory=list, description="replica base URLs, comma-separated (added to fleet.replicas); in the "
        "config file also {url, events_endpoint, replay_endpoint} objects",
        json_schema_extra=_hint("URL[,URL...]"),
    )
    fleet: FleetSettings = Field(default_factory=FleetSettings, description="replica discovery and health")

    # -- routing ---------------------------------------------------------------------------
    policy: str = Field("cost_model", description="routing policy", json_schema_extra=_hint("{" + ",".join(POLICIES) + "}"))
    policy_options: dict[str, Any] = Field(
        default_factory=dict, description="keyword options of the policy, e.g. '{\"epsilon\": 0.5}'",
        json_schema_extra=_hint("JSON"),
    )
    tokenizer: str | None = Field(
        None, description="tokenizer of models without their own: a directory, or a Hugging Face model id "
        "(fetched through its cache; HF_HUB_OFFLINE=1 reads only the cache)", json_schema_extra=_hint("DIR|HF_ID"),
    )
    tokenizers: dict[str, str] = Field(
        default_factory=dict, description="a model's tokenizer (directory or Hugging Face id); repeat the flag per model",
        json_schema_extra=_hint("MODEL=DIR|HF_ID"),
    )
    hold_max_s: float = Field(
        0.0, ge=0, description="late binding: a request whose chosen replica has no room waits at the router (in "
        "arrival order) at most this long, then is placed again with the load and caches of that moment; 0: off "
        "(docs/design.md §5.9)", json_schema_extra=_hint("SECONDS"),
    )
    hold_queued_tokens: int = Field(
        8192, gt=0, description="late binding: a replica has room while the uncached prompt tokens this router sent "
        "it, first token not back, are at most this (vLLM's max_num_batched_tokens: one scheduler step)",
        json_schema_extra=_hint("TOKENS"),
    )
    redis_url: str | None = Field(None, description="Redis URL: shared prefix index (and fleet discovery)")
    redis_key_prefix: str = Field(
        "kvroute", description="prefix of every Redis key the index writes", json_schema_extra=_hint("PREFIX")
    )
    index_timeout_s: float = Field(0.2, gt=0, description="index call budget before routing without it")
    index_key_ttl_s: float = Field(
        600.0, gt=0, description="life of a Redis index key nobody writes or refreshes (routers refresh theirs every second)"
    )
    predicted_ttl_s: float = Field(30.0, gt=0, description="life of a prediction on replicas with KV events")
    kv_events: bool = Field(
        True, description="follow the replicas' KV events (registered in Redis, configured, or by the fleet.events_port "
        "convention)"
    )
    responses_memory_mb: float = Field(
        64.0, gt=0, description="memory of /v1/responses conversations (response id -> replica, session, the "
        "messages the next turn renders), MB of text, least recently used forgotten first",
        json_schema_extra=_hint("MB"),
    )
    responses_ttl_s: float = Field(
        86400.0, gt=0, description="with redis_url: life of a stored response's 'id -> replica' entry in Redis, "
        "through which every router and worker finds the replica of a previous_response_id, a GET or a cancel"
    )

    # -- limits ----------------------------------------------------------------------------
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0, description="largest request body (413 above)")
    max_prompt_tokens: int | None = Field(
        None, gt=0, description="largest prompt in tokens (400 above); unset: the longest max_model_len the "
        "model's replicas announce in /v1/models"
    )
    max_in_flight: int = Field(1024, gt=0, description="concurrent proxied requests (429 above)")
    max_client_connections: int | None = Field(
        None, gt=0, description="client connections held open at most, per process; at the cap a new one evicts "
        "the connection idle the longest, or is answered 503 when none is idle; unset: the open-file limit "
        "(raised to the hard limit at start) less 256 and less one upstream connection per request in flight"
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After of a 429")

    # -- overload: the admission queue and fair share (router/edge/overload/, design.md §7.6) --
    max_queue_wait_s: float = Field(
        1.0, ge=0, description="longest a request waits in the admission queue while the router is saturated "
        "(in-flight at its limit, the event loop lagging, the tokenizer pool backed up) before a 429 "
        "router_overloaded; one whose wait would certainly pass it is refused at once; 0: no queue (a 429 at "
        "--max-in-flight, at once), per worker", json_schema_extra=_hint("SECONDS"),
    )
    max_queue_length: int = Field(
        1024, gt=0, description="requests waiting in the admission queue at most, per worker (the lowest class "
        "and the heaviest tenant's latest are refused first above)"
    )
    saturated_loop_lag_s: float = Field(
        0.05, ge=0, description="event-loop lag above which the router counts itself saturated: new requests "
        "queue and its in-flight limit comes down until the lag does (0: the lag is not watched)",
        json_schema_extra=_hint("SECONDS"),
    )
    queue_when_saturated: bool = Field(
        True, description="queue requests that find no room while the router's own CPU is saturated (its loop "
        "lagging, its tokenizer pool backed up) as when only slots are short (the default); off: those are "
        "answered 429 router_overloaded at once and the accept queue counts as saturation, since a wait there "
        "holds the client's connection and an open-loop client opens another, work a saturated router has no "
        "CPU for; each request served is then on time, but fewer are served (design.md §7.6)"
    )
    stale_request_s: float = Field(
        0.0, ge=0, description="a request whose bytes waited this long in the kernel before the router read them "
        "(in the accept queue or its socket's buffer: TCP_INFO) is answered 429 router_overloaded at once "
        "and the router counts itself saturated; serving it would be late (0, the default: not checked; 0.25 with "
        "--no-queue-when-saturated, design.md §7.6; with a queue only)",
        json_schema_extra=_hint("SECONDS"),
    )
    fair_share_when_short: bool = Field(
        True, description="while the router is short of CPU (requests wait in the kernel to be read, the loop "
        "lags), each tenant may send its fair share of what the router serves, and its requests beyond it are "
        "answered 429 router_overloaded at the door, before they cost a handler (with a queue only; "
        "design.md §7.6)"
    )
    fair_slot_reserve: float = Field(
        1 / 16, ge=0, lt=1, description="share of the admission limit kept, while several tenants send, for "
        "tenants holding less than their fair share of it: a light tenant's request finds a slot at once "
        "instead of waiting for one of a heavy tenant's to end; the kept slots idle while only the heavy "
        "tenant waits for them (0: none kept; from 4 slots, at least one; design.md §7.6)"
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict, description="a tenant's share of a saturated router against the others' (default "
        "1); tenants are named key-<first 10 hex of the key's sha256>, user:<user field> or addr:<client address>",
        json_schema_extra=_hint("TENANT=WEIGHT"),
    )
    trusted_proxies: Annotated[list[IPvAnyNetwork], NoDecode] = Field(
        default_factory=list, description="CIDRs of proxies whose X-Forwarded-For names the client (tenant and "
        "access log); comma-separated; empty: the peer address is the client",
        json_schema_extra=_hint("CIDR[,CIDR...]"),
    )
    max_body_reads: int = Field(
        1024, gt=0, description="request bodies being received at once (503 above; a body sent whole is never refused)"
    )
    max_body_read_bytes: int = Field(
        1024 * 1024 * 1024, gt=0, description="memory the bodies being received may come to (each reserves its "
        "Content-Length, or max_body_bytes when chunked or compressed; 503 above)"
    )

    # -- clients ---------------------------------------------------------------------------
    header_timeout_s: float = Field(
        10.0, ge=0, description="accept (or a request's first byte) -> end of its headers; 408 and close (0: none)"
    )
    body_timeout_s: float = Field(30.0, ge=0, description="end of headers -> end of the body; 408 and close (0: none)")
    keepalive_timeout_s: float = Field(75.0, gt=0, description="an idle client connection is closed after this")

    # -- security --------------------------------------------------------------------------
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="client API keys, comma-separated (empty: no auth)",
        json_schema_extra=_hint("KEY[,KEY...]"),
    )
    admin_token: SecretStr | None = Field(None, description="bearer token of /admin/ (unset: admin disabled)")
    tenant_isolation: bool = Field(False, description="derive cache_salt from the client's API key")
    tenant_salt_secret: SecretStr | None = Field(None, description="HMAC key of tenant salts (share it among routers)")
    registration_secret: SecretStr | None = Field(
        None, description="shared secret of Redis registrations: only those its replica launchers signed are "
        "believed (unset: every registration, and a warning at start); several, one per line, during a "
        "rotation (any is believed); prefer registration_secret_file",
        json_schema_extra=_hint("SECRET"),
    )
    registration_secret_file: Path | None = Field(
        None, description="file holding registration_secret (a mounted Kubernetes Secret): one secret per line, "
        "an entry signed with any of them believed (a rotation: the new and the previous; blank lines ignored)",
        json_schema_extra=_hint("FILE"),
    )

    allow_client_chat_template: bool = Field(
        False, description="render a request's own chat_template (in a sandboxed worker process, within the "
        "budgets below); off: such requests get a 400"
    )
    client_chat_template_timeout_s: float = Field(
        1.0, gt=0, description="time budget of rendering one client chat template (400 and a new worker above)"
    )
    client_chat_template_max_chars: int = Field(
        16 * 1024 * 1024, gt=0, description="output budget of one client chat template, in characters (400 above)"
    )
    client_chat_template_workers: int = Field(1, gt=0, description="processes rendering client chat templates")

    # -- upstream --------------------------------------------------------------------------
    connect_timeout_s: float = Field(3.0, gt=0, description="TCP connect to a replica")
    first_byte_timeout_s: float = Field(
        300.0, gt=0, description="request sent -> first response byte (a whole non-streamed answer)"
    )
    idle_timeout_s: float = Field(60.0, gt=0, description="longest silence between two chunks of a stream")
    retry_attempts: int = Field(2, ge=0, description="other replicas tried when one fails before the first byte")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, wait this long for in-flight requests")
    health_requires_replica: bool = Field(
        False,
        description="/health answers 503 until a replica is healthy (a demo, one host); keep it off for "
        "Kubernetes liveness probes, which must not restart a router whose replicas are down",
    )

    # -- observability ---------------------------------------------------------------------
    reuse_window_blocks: int = Field(
        200_000, gt=0, description="block hashes kept per model for reuse-available (LRU; ~42 MB a model at 200k)"
    )
    max_client_labels: int = Field(100, gt=0, description="distinct client labels in metrics; more -> 'other'")
    log_level: str = Field("info", description="logging level", json_schema_extra=_hint("{debug,info,warning,error}"))
    log_format: Literal["text", "json"] = Field(
        "text", description="log lines: text, or json (one object per line: ts, level, logger, msg and the fields)"
    )
    tracing: bool = Field(
        False, description="OpenTelemetry spans of each routed request (the route decision, each upstream attempt), "
        "configured by the OTEL_* environment variables; needs pip install 'kvroute[otel]'. Off, a client's "
        "traceparent/tracestate still reach the replica unchanged"
    )
    access_log: bool = Field(
        True, description="a log line per API request once answered (logger kvroute.access: request id, model, "
        "replica, status, tokens, cached tokens, TTFT, duration)"
    )

    @field_validator("replicas", mode="before")
    @classmethod
    def _split_replicas(cls, value: Any) -> Any:
        return _comma_list(value)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy {value!r}; choose from {', '.join(POLICIES)}")
        return value

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _split_proxies(cls, value: Any) -> Any:
        return _comma_list(value)

    @field_validator("tenant_weights")
    @classmethod
    def _positive_weights(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in value.items() if not (w > 0 and math.isfinite(w))}
        if bad:
            raise ValueError(f"tenant weights must be positive numbers: {bad}")
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        return _comma_list(value)

    @field_validator("workers", mode="before")
    @classmethod
    def _auto_workers(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return usable_cores()
        return value

    @field_validator(
        "admin_token", "tenant_salt_secret", "tokenizer", "redis_url", "tls_cert_file", "tls_key_file",
        "registration_secret", "registration_secret_file", mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # `KVROUTE_ADMIN_TOKEN=` (an empty variable, as compose files pass them) means "not set"
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _one_port(self) -> RouterSettings:
        if self.workers > 1 and self.port == 0:
            raise ValueError("port 0 with several workers: each would listen on a different free port; name one")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> RouterSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: give both to serve HTTPS, or neither")
        return self

    @model_validator(mode="after")
    def _registration_secret_read(self) -> RouterSettings:
        # read now: a missing or empty file stops the router at start, not at its first listing
        self._registration_keys = read_secrets(
            self.registration_secret.get_secret_value() if self.registration_secret else None,
            self.registration_secret_file,
        )
        return self

    @model_validator(mode="after")
    def _merge_shorthands(self) -> RouterSettings:
        # `--replicas` and `--redis-url` are the everyday flags; the fleet reads its own settings
        merged = list(self.fleet.replicas)
        known = {entry_url(e) for e in merged}
        merged += [e for e in self.replicas if entry_url(e) not in known]
        self.fleet.replicas = merged
        if self.redis_url and not self.fleet.redis_url:
            self.fleet.redis_url = self.redis_url
        if "redis_key_prefix" not in self.fleet.model_fields_set:
            self.fleet.redis_key_prefix = self.redis_key_prefix
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_file.get()
        if path is not None:
            sources.append(config_file_source(settings_cls, path))
        return tuple(sources)

    def tokenizer_dir(self, model: str) -> str | None:
        return self.tokenizers.get(model, self.tokenizer)

    def registration_keys(self) -> tuple[bytes, ...]:
        """The secrets a Redis registration may be signed with, any of them (none: believe them all)."""
        return self._registration_keys

    def client_keys(self) -> set[str]:
        return {key.get_secret_value() for key in self.api_keys}


def _config_path(argv: Sequence[str] | None, env: dict[str, str]) -> Path | None:
    args = list(argv or [])
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            return Path(args[i + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    value = env.get("KVROUTE_CONFIG")
    return Path(value) if value else None


CLI_DESCRIPTION = """\
The cache-aware router: an OpenAI-compatible endpoint in front of vLLM replicas, sending each
request where its prompt's prefix is cached.  Every flag is also an environment variable
(KVROUTE_PORT; nested: KVROUTE_FLEET__HEALTH_INTERVAL_S) and a key of the --config file;
flags win over the environment, which wins over the file."""


def load_settings(argv: Sequence[str] | None = None, **overrides: Any) -> RouterSettings:
    """Settings from flags (``argv``; None reads no flags), env, the config file and ``overrides``."""
    path = _config_path(argv, dict(os.environ))
    token = _config_file.set(path)
    try:
        if argv is None:
            return RouterSettings(**overrides)
        source = cli_source(RouterSettings, "kvroute router", argv, description=CLI_DESCRIPTION)
        return RouterSettings(_cli_settings_source=source, **overrides)
    finally:
        _config_file.reset(token)
