"""The packages' layers, as pyproject.toml's import-linter contracts state them (`make lint-imports`):
kvroute.cli on top, then kvroute.bench (sim, demo, benchmarks), then kvroute.router beside
kvroute.replica (neither imports the other), then kvroute.common, which both speak; inside the
router the edge, then the request, then placement | forwarding | fleet (each independent of the
others), then the index; no circles.

The contracts are run here on a copy of the packages laid out as the kvroute namespace: as they
stand they hold, and an import that breaks each of them fails them, naming it.  The rest keeps the
namespace whole: nothing imports the repository's folders by their own names (they are importable
so whenever the checkout is on sys.path, as under pytest, and would load a second copy of a
module), and pyproject.toml lists every package there is.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]  # kvroute.router -> router
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def tracked(*paths: str) -> list[str]:
    return subprocess.run(["git", "ls-files", *paths], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Path:
    """The packages copied as the namespace they are installed as: kvroute/router/..., and the
    contracts (pyproject.toml) beside them."""
    root = tmp_path_factory.mktemp("layout")
    for package, folder in PACKAGE_DIRS.items():
        shutil.copytree(REPO / folder, root / Path(*package.split(".")),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail("lint-imports is not installed (the test extra): pip install -e '.[test]'")
    # the copy is found before this checkout's editable install: PYTHONPATH comes first on sys.path
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def with_import(layout: Path, tmp_path: Path, module: str, line: str) -> Path:
    """A copy of ``layout`` where ``module`` (kvroute.x.y) also runs ``line``."""
    root = tmp_path / "changed"
    shutil.copytree(layout, root)
    path = root / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    path.write_text(path.read_text() + f"\n{line}\n")
    return root


def test_the_contracts_hold(layout):
    done = lint_imports(layout)
    assert done.returncode == 0, done.stdout + done.stderr
    modules = sum(len([p for p in tracked(folder) if p.endswith(".py")]) for folder in PACKAGE_DIRS.values())
    assert f"Analyzed {modules} files" in done.stdout, done.stdout  # all of them, from the copy
    assert "4 kept, 0 broken" in done.stdout, done.stdout


@pytest.mark.parametrize(("module", "line", "broken", "says"), [
    # the router reaches up into the benchmarks
    ("kvroute.router.fleet.membership", "from kvroute.bench.processes import stop_all", ["Layers"],
     "kvroute.router.fleet.membership -> kvroute.bench.processes"),
    # the base imports the router: no longer below both sides, so the replica, which imports the
    # base, reaches the router through it (and the router's lower parts, which import the base, reach
    # the placement's load)
    ("kvroute.common.blocks", "import kvroute.router.placement.load", ["Layers", "Inside the router", "independent"],
     "kvroute.common.blocks -> kvroute.router.placement.load"),
    # the emulated replica parses with the router's own code
    ("kvroute.replica.emulated.handlers", "from kvroute.router.request.route import Router", ["Layers", "independent"],
     "kvroute.replica.emulated.handlers -> kvroute.router.request.route"),
    # the router service imports its process entry back: a circle within kvroute.router
    ("kvroute.router.app", "from kvroute.router.main import serve", ["Inside the router", "No circles"],
     "No cycles are allowed in kvroute.router"),
    # the placement reaches up into the edge (placement does not import the edge)
    ("kvroute.router.placement.sequence", "from kvroute.router.edge.handlers import Handlers",
     ["Inside the router", "No circles"],
     "kvroute.router.placement.sequence -> kvroute.router.edge.handlers"),
    # the proxy calls the request's accounting back (forwarding answers with values instead)
    ("kvroute.router.forwarding.proxy", "from kvroute.router.request.accounting import Accounting",
     ["Inside the router", "No circles"], "kvroute.router.forwarding.proxy -> kvroute.router.request.accounting"),
    # the fleet reaches sideways into the placement's load (placement, forwarding, fleet: independent)
    ("kvroute.router.fleet.membership", "from kvroute.router.placement.load import LoadTracker",
     ["Inside the router"], "kvroute.router.fleet.membership -> kvroute.router.placement.load"),
])
def test_a_bad_import_breaks_its_contract(layout, tmp_path, module, line, broken, says):
    done = lint_imports(with_import(layout, tmp_path, module, line))
    assert done.returncode != 0, done.stdout
    assert f"{4 - len(broken)} kept, {len(broken)} broken" in done.stdout, done.stdout
    report = done.stdout.split("Broken contracts", 1)[1]
    assert all(name in report for name in broken) and says in report, report


def test_nothing_imports_the_folders_by_their_own_names():
    """`import router.x` instead of `import kvroute.router.x`: it works wherever the checkout is on
    sys.path, and runs that module a second time, apart from the one the rest of the code uses."""
    folders = set(PACKAGE_DIRS.values())
    found = []
    for path in tracked("*.py"):
        for node in ast.walk(ast.parse((REPO / path).read_text(), path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            found += [f"{path}:{node.lineno}: {name}" for name in names if name.split(".")[0] in folders]
    assert not found, "\n".join(found)


def test_pyproject_lists_every_package():
    """A folder of modules under a package that pyproject.toml does not list would be left out of
    the wheel (the editable install would not notice)."""
    packages = set()
    for package, folder in PACKAGE_DIRS.items():
        for init in tracked(folder):
            if Path(init).name == "__init__.py":
                packages.add(package + "".join("." + part for part in Path(init).parent.parts[1:]))
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == packages
