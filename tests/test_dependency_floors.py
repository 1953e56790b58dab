"""pyproject.toml's dependency ranges: each direct runtime dependency has a floor, aiohttp (whose
private server internals router/edge/server.py extends, tests/test_aiohttp_internals.py) a ceiling
too, and under `make test-lowest` (KVROUTE_LOWEST_DEPS=1) what is installed is each floor itself,
so the tests run there show that floor holds."""

from __future__ import annotations

import os
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOWEST = os.environ.get("KVROUTE_LOWEST_DEPS") == "1"


def runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["k8s"] + extras["otel"]]


def floor(requirement: Requirement) -> Version:
    (low,) = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return low


def test_every_runtime_dependency_has_a_floor_and_aiohttp_a_ceiling():
    for r in runtime_requirements():
        assert floor(r), r
    (aiohttp,) = [r for r in runtime_requirements() if r.name == "aiohttp"]
    assert [s.operator for s in aiohttp.specifier if s.operator == "<"], "aiohttp needs an upper bound"


@pytest.mark.parametrize("requirement", runtime_requirements(), ids=str)
def test_installed_versions_are_in_range_and_at_the_floor_under_test_lowest(requirement):
    installed = Version(metadata.version(requirement.name))
    assert requirement.specifier.contains(installed, prereleases=True), (requirement, installed)
    if LOWEST:  # the floor, or its first release when the floor names none (xxhash>=3.4: 3.4.1)
        low = floor(requirement)
        assert installed.release[: len(low.release)] == low.release, f"{requirement.name} {installed}, floor {low}"
