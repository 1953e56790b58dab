"""Router settings: flags, environment (KVROUTE_*) and a TOML/JSON config file, in that priority."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvroute.router.main import main
from kvroute.router.config import load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for key in [k for k in os.environ if k.startswith("KVROUTE_")]:
        monkeypatch.delenv(key)


def test_cli_flags(monkeypatch):
    s = load_settings(
        ["--port", "9100", "--replicas", "http://a:1,http://b:2", "--policy", "round_robin",
         "--redis-url", "redis://r:6379/0", "--tokenizer", "/tok", "--fleet.breaker-failures", "7",
         "--tenant-isolation", "--api-keys", "k1,k2"]
    )
    assert s.port == 9100 and s.policy == "round_robin" and s.tokenizer == "/tok"
    assert s.fleet.replicas == ["http://a:1", "http://b:2"]
    assert s.fleet.breaker_failures == 7
    assert s.fleet.redis_url == "redis://r:6379/0"  # the index's Redis serves discovery too
    assert s.tenant_isolation is True
    assert s.client_keys() == {"k1", "k2"}


def test_env_overrides_file_and_flags_override_env(tmp_path, monkeypatch):
    cfg = tmp_path / "router.toml"
    cfg.write_text(
        'port = 9001\npolicy = "chwbl"\nreplicas = ["http://f:1"]\nmax_in_flight = 5\n'
        '[tokenizers]\n"org/model" = "/models/m"\n[fleet]\nhealth_interval_s = 4.5\n'
    )
    monkeypatch.setenv("KVROUTE_PORT", "9002")
    monkeypatch.setenv("KVROUTE_FLEET__BREAKER_COOLDOWN_S", "9")
    s = load_settings(["--config", str(cfg), "--max-in-flight", "6"])
    assert s.port == 9002  # env beats the file
    assert s.max_in_flight == 6  # flags beat the file
    assert s.policy == "chwbl" and s.fleet.replicas == ["http://f:1"]
    assert s.tokenizer_dir("org/model") == "/models/m" and s.tokenizer_dir("other") is None
    assert s.fleet.health_interval_s == 4.5 and s.fleet.breaker_cooldown_s == 9.0


def test_json_config_via_env_path(tmp_path, monkeypatch):
    cfg = tmp_path / "router.json"
    cfg.write_text(json.dumps({"fleet": {"replicas": ["http://j:1"]}, "admin_token": "s3cret", "retry_attempts": 4}))
    monkeypatch.setenv("KVROUTE_CONFIG", str(cfg))
    monkeypatch.setenv("KVROUTE_REPLICAS", "http://e:1")
    s = load_settings([])
    assert s.fleet.replicas == ["http://j:1", "http://e:1"]  # the shorthand adds to the fleet's list
    assert s.admin_token is not None and s.admin_token.get_secret_value() == "s3cret"
    assert s.retry_attempts == 4


@pytest.mark.parametrize("text", ["prot = 8000\n", "[fleet]\nhelth_interval_s = 1.0\n"])
def test_unknown_config_key_is_an_error(tmp_path, text):
    cfg = tmp_path / "router.toml"
    cfg.write_text(text)
    with pytest.raises(ValidationError):
        load_settings(["--config", str(cfg)])


def test_main_rejects_bad_settings_without_starting(tmp_path, capsys):
    cfg = tmp_path / "router.ini"
    cfg.write_text("port=1\n")
    assert main(["--config", str(cfg)]) == 2
    assert main(["--port", "-5"]) == 2
    assert main(["--no-such-flag"]) == 2
    assert main(["--help"]) == 0
    assert "--replicas" in capsys.readouterr().out


def test_empty_variables_mean_unset(monkeypatch):
    for name in ("KVROUTE_ADMIN_TOKEN", "KVROUTE_API_KEYS", "KVROUTE_TOKENIZER", "KVROUTE_REDIS_URL"):
        monkeypatch.setenv(name, "")
    s = load_settings([])
    assert s.admin_token is None and s.api_keys == [] and s.tokenizer is None and s.redis_url is None
