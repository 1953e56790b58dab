"""The fleet's settings (``--fleet.*``): where replicas come from, how they are probed, where
their KV events are.  A field of RouterSettings (router/config.py); router/fleet/membership.py acts on them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvroute.router.fleet.discovery import ReplicaEntry
from kvroute.router.settings_cli import hint


class FleetSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt setting is an error, as at the top level

    replicas: list[str | ReplicaEntry] = Field(
        [], description="static replica base URLs, comma-separated (e.g. http://10.0.0.1:8000); in the config file "
        "also {url, events_endpoint, replay_endpoint} objects (KV-event endpoints of their own)",
        json_schema_extra=hint("URL[,URL...]"),
    )
    discovery_redis: bool = Field(False, description="read replica registrations from Redis (needs redis_url)")
    redis_url: str | None = Field(None, description="Redis of the registrations (unset: the router's --redis-url)")
    redis_key_prefix: str = Field(
        "kvroute", description="prefix of the registration keys (unset here: the router's --redis-key-prefix)",
        json_schema_extra=hint("PREFIX"),
    )
    dns_name: str | None = Field(
        None, description="host:port of a headless service; each A/AAAA record is a replica",
        json_schema_extra=hint("HOST:PORT"),
    )
    dns_scheme: str = Field("http", description="scheme of the replicas found by DNS", json_schema_extra=hint("{http,https}"))
    # "auto": IPv4 addresses when the name has any, else IPv6 (a dual-stack pod, or localhost,
    # answers with both families: counting it twice would double its share of traffic).
    dns_family: Literal["auto", "ipv4", "ipv6", "both"] = Field(
        "auto", description="address family of DNS replicas (auto: IPv4 when the name has any, else IPv6)"
    )
    k8s_selector: str | None = Field(
        None,
        description="label selector of the replica pods, e.g. 'app=vllm,model=x': each ready pod is a replica, "
        "watched through the Kubernetes API ($KUBECONFIG when set, else the pod's service account in a cluster, "
        "else ~/.kube/config; needs the extra 'k8s')",
        json_schema_extra=hint("SELECTOR"),
    )
    k8s_namespace: str | None = Field(
        None, description="namespace of those pods; unset: the service account's in a cluster, else the kubeconfig "
        "context's", json_schema_extra=hint("NAMESPACE"),
    )
    k8s_port_name: str = Field(
        "http", description="name of the pods' container port that serves the OpenAI API", json_schema_extra=hint("NAME")
    )
    k8s_port: int | None = Field(
        None, gt=0, le=65535, description="port of a pod that has no port of that name", json_schema_extra=hint("PORT")
    )
    k8s_scheme: Literal["http", "https"] = Field("http", description="scheme of the replicas found in Kubernetes")
    replica_api_key: str | None = Field(
        None, description="sent to replicas as Bearer (not a client key)", json_schema_extra=hint("KEY")
    )
    replica_ca_file: Path | None = Field(
        None, description="PEM CA bundle that https replicas' certificates are verified against (unset: the "
        "system's CAs)", json_schema_extra=hint("FILE"),
    )
    replica_server_name: str | None = Field(
        None, description="name the https replicas' certificates are checked against (and sent as SNI), in place "
        "of the host of each replica's URL: one certificate for a fleet found by IP address (DNS, Kubernetes), "
        "e.g. vllm.llm.svc", json_schema_extra=hint("NAME"),
    )
    replica_client_cert_file: Path | None = Field(
        None, description="PEM client certificate the router presents to https replicas that require one (mTLS)",
        json_schema_extra=hint("FILE"),
    )
    replica_client_key_file: Path | None = Field(
        None, description="PEM private key of replica_client_cert_file", json_schema_extra=hint("FILE")
    )
    health_interval_s: float = Field(2.0, gt=0, description="seconds between health checks of a replica")
    health_timeout_s: float = Field(1.0, gt=0, description="a health check slower than this failed")
    unhealthy_after: int = Field(3, ge=1, description="consecutive failed health checks that take a replica out")
    metrics_interval_s: float = Field(1.0, gt=0, description="seconds between scrapes of a replica's /metrics (load)")
    metrics_timeout_s: float = Field(1.0, gt=0, description="a /metrics scrape slower than this failed")
    models_refresh_s: float = Field(30.0, gt=0, description="seconds between reads of healthy replicas' /v1/models")
    discovery_timeout_s: float = Field(
        2.0, gt=0, description="budget of a Redis listing, a DNS lookup, a Kubernetes API connect (and the first pod list)"
    )
    breaker_failures: int = Field(3, ge=1, description="consecutive request failures that open a replica's circuit")
    breaker_cooldown_s: float = Field(5.0, gt=0, description="an open circuit goes half-open (one trial) after this")
    block_size: int | None = Field(
        None, gt=0, description="KV block size in tokens (unset: the replicas' vllm:cache_config_info)"
    )
    capacity_blocks: int | None = Field(
        None, gt=0, description="KV capacity of a replica in blocks (unset: its num_gpu_blocks)"
    )
    fallback_capacity_blocks: int = Field(65536, gt=0, description="index bound of a replica while its capacity is unknown")
    events_port: int = Field(
        5557, ge=0, le=65535, description="KV events of a replica not registered in Redis: tcp://ITS_HOST:PORT "
        "(vLLM's default endpoint; 0: no events by convention)", json_schema_extra=hint("PORT"),
    )
    replay_port: int = Field(
        5558, ge=0, le=65535, description="its replay socket by the same convention (0: none)",
        json_schema_extra=hint("PORT"),
    )
    events_topic: str = Field(
        "", description="topic prefix to subscribe to (vLLM's kv_events_config topic; empty: every topic)",
        json_schema_extra=hint("TOPIC"),
    )
    events_silent_after_s: float = Field(
        10.0, gt=0, description="a followed replica with no KV-event batch and no replay answer for this long is "
        "'silent': routed on predictions until its events arrive"
    )

    @field_validator("replica_ca_file", "replica_client_cert_file", "replica_client_key_file", "replica_server_name",
                     mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value  # a chart's empty variable

    @model_validator(mode="after")
    def _client_pair(self) -> FleetSettings:
        if (self.replica_client_cert_file is None) != (self.replica_client_key_file is None):
            raise ValueError("fleet.replica_client_cert_file and fleet.replica_client_key_file go together")
        return self

    @field_validator("replicas", mode="before")
    @classmethod
    def _split_replicas(cls, value: Any) -> Any:
        if isinstance(value, str):  # "url,url" from an environment variable or a flag
            return [v.strip() for v in value.split(",") if v.strip()]
        return value
