"""What `kvroute ... --help` shows people: every flag described, values named for what they are
(not Python types), the policy choices, no machine paths; and `--version`.

Each help is the real console script's output (a child process), parsed as argparse prints it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kvroute.router.config import load_settings
from kvroute.router.placement.policy import POLICIES

REPO = Path(__file__).resolve().parents[1]
# A value named after its Python type, as pydantic-settings prints it: `{str,None}`, `dict[str,str]`,
# `list[SecretStr]`, `int`, `Path`...
RAW_TYPE = re.compile(r"\b(str|int|float|bool|None|NoneType|null|list|dict|tuple|set|Path|SecretStr|Any)\b|[a-z]\[")


def kvroute(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kvroute.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout


def options(help_text: str) -> dict[str, tuple[str, str]]:
    """flag -> (metavar, description without its default) of each option argparse lists."""
    found: dict[str, tuple[str, str]] = {}
    current: list[str] | None = None  # [flags..., metavar, description]
    entries: list[list[str]] = []
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            head, _, desc = line.strip().partition("  ")
            words = head.split(" ")
            flags = [w.rstrip(",") for w in words if w.startswith("-")]
            metavar = " ".join(w for w in words if not w.startswith("-"))
            current = [" ".join(flags), metavar, desc.strip()]
            entries.append(current)
        elif current is not None and line.startswith("    ") and line.strip():
            current[2] = f"{current[2]} {line.strip()}".strip()
        else:
            current = None
    for flags, metavar, desc in entries:
        for flag in flags.split(" "):
            found[flag] = (metavar, re.sub(r"\(default[^)]*\)", "", desc).strip())
    return found


def assert_readable(help_text: str, *, exempt: tuple[str, ...] = ("-h", "--help")) -> dict[str, tuple[str, str]]:
    opts = options(help_text)
    assert len(opts) > 3, help_text
    raw = {flag: metavar for flag, (metavar, _) in opts.items() if RAW_TYPE.search(metavar)}
    assert not raw, f"flags whose value is named after a Python type: {raw}"
    bare = [flag for flag, (_, desc) in opts.items() if not desc and flag not in exempt]
    assert not bare, f"flags without a description: {bare}"
    assert "default factory" not in help_text
    assert "(default: )" not in help_text, "an empty default printed as nothing: say `empty`"
    for machine_path in {str(REPO), str(Path.home()), "/work/"}:
        assert machine_path not in help_text, f"--help shows a machine path ({machine_path})"
    return opts


def test_router_help_names_values_describes_flags_and_lists_policies():
    help_text = kvroute("router", "--help")
    opts = assert_readable(help_text)
    assert {"--replicas", "--policy", "--tokenizer", "--fleet.health-interval-s", "--version"} <= set(opts)
    choices = opts["--policy"][0]
    assert set(choices.strip("{}").split(",")) == set(POLICIES)
    assert opts["--fleet.health-interval-s"][0] == "SECONDS"
    assert opts["--tokenizers"][0] == "MODEL=DIR|HF_ID"
    assert "(default: empty)" in help_text  # --fleet.events-topic's empty string


def test_the_help_check_catches_what_pydantic_settings_prints_by_default():
    """The parser above is not vacuous: on pydantic-settings' own rendering it finds the raw types."""
    stock = "options:\n  --tokenizers dict[str,str]\n                        (default factory: dict)\n"
    with pytest.raises(AssertionError):
        assert_readable(stock + "  --a A  a\n  --b B  b\n  --c C  c\n")
    with pytest.raises(AssertionError, match="without a description"):
        assert_readable("options:\n  --port N   (default: 8000)\n  --a A  a\n  --b B  b\n  --c C  c\n")
    with pytest.raises(AssertionError, match="empty default"):
        assert_readable("options:\n  --topic TOPIC  a topic (default: )\n  --a A  a\n  --b B  b\n  --c C  c\n")


@pytest.mark.parametrize("command", [("sim",), ("demo",), ("bench", "replay"), ("bench", "gate"), ("replica",)])
def test_other_commands_help_is_readable(command):
    assert_readable(kvroute(*command, "--help"))


def test_sim_help_names_the_packaged_trace_not_a_path():
    assert "Mooncake's synthetic trace (packaged)" in kvroute("sim", "--help")


def test_version_is_the_installed_distributions():
    expected = metadata.version("kvroute")
    assert kvroute("--version").strip() == f"kvroute {expected}"
    assert kvroute("router", "--version").strip() == f"kvroute router {expected}"


def test_named_values_still_parse():
    """The metavars are only names: values parse as before (a dict repeated as KEY=VALUE)."""
    s = load_settings(["--tokenizers", "a=/models/a", "--tokenizers", "b=org/b", "--policy", "round_robin",
                       "--replicas", "http://h1:8000,http://h2:8000", "--fleet.health-interval-s", "3"])
    assert s.tokenizers == {"a": "/models/a", "b": "org/b"}
    assert s.policy == "round_robin"
    assert s.fleet.replicas == ["http://h1:8000", "http://h2:8000"]
    assert s.fleet.health_interval_s == 3.0


def test_unknown_policy_is_a_settings_error_naming_the_choices():
    done = subprocess.run([sys.executable, "-m", "kvroute.cli", "router", "--policy", "bogus"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2
    assert "unknown policy 'bogus'" in done.stderr and "cost_model" in done.stderr
    assert "Traceback" not in done.stderr
