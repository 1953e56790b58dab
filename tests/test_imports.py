"""Every module of the package imports: with the versions installed here, and in `make
test-lowest` with the lowest version pyproject.toml allows of each direct dependency (a floor
that does not hold fails here first: `aiohttp>=3.9` was declared while router/access_log.py used
aiohttp 3.12's RequestKey)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "replica", "bench")
# vllm_cpu_site's sitecustomize runs in vLLM's processes (it asks the kernel for AMX tiles):
# importing it is running it, so it is not imported here.
NOT_IMPORTED = {"replica.vllm_cpu_site.sitecustomize"}


def modules() -> list[str]:
    """Every .py file under the packages, as a module name (from the files: walking the packages
    would import them, and a package that fails to import would hide its modules)."""
    names = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
             for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    return sorted(names - NOT_IMPORTED)


def test_the_modules_are_found():
    found = modules()
    assert {"router", "router.app", "router.server", "router.access_log", "replica.cli", "bench.sim"} <= set(found)
    assert len(found) > 100 and all((REPO / p).is_dir() for p in PACKAGES)


@pytest.mark.parametrize("name", modules())
def test_module_imports(name):
    importlib.import_module(name)
