"""Every module of the package imports: with the versions installed here, and in `make
test-lowest` with the lowest version pyproject.toml allows of each direct dependency (a floor
that does not hold fails here first: `aiohttp>=3.9` was declared while router/edge/access_log.py used
aiohttp 3.12's RequestKey)."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# package -> its folder (pyproject.toml's package-dir: kvroute.router -> router/)
PACKAGE_DIRS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
# Importing these is running them: vllm_cpu_site's sitecustomize runs in vLLM's processes (it asks
# the kernel for AMX tiles), a __main__ module runs its command.
NOT_IMPORTED = {"kvroute.replica.vllm_cpu_site.sitecustomize", "kvroute.cli.__main__"}
# Modules of an optional extra that `make test-lowest` does not install (its venv has the k8s
# extra only): imported where the extra is, skipped where it is not.
EXTRA_ONLY = {"kvroute.router.otel": "opentelemetry.sdk"}


def modules() -> list[str]:
    """Every .py file under the packages' folders, as a module name (from the files: walking the
    packages would import them, and a package that fails to import would hide its modules)."""
    names = set()
    for package, folder in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            names.add(".".join((package, *parts)).removesuffix(".__init__"))
    return sorted(names - NOT_IMPORTED)


def test_the_modules_are_found():
    found = modules()
    assert {"kvroute.router", "kvroute.router.app", "kvroute.router.edge.server", "kvroute.router.edge.access_log",
            "kvroute.replica.cli", "kvroute.bench.sim", "kvroute.cli"} <= set(found)
    assert len(found) > 100 and all((REPO / folder).is_dir() for folder in PACKAGE_DIRS.values())


@pytest.mark.parametrize("name", modules())
def test_module_imports(name):
    if name in EXTRA_ONLY:
        pytest.importorskip(EXTRA_ONLY[name])
    importlib.import_module(name)
