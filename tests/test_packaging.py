"""The built wheel, installed into a fresh virtualenv, runs on its own: `kvroute --version`, `kvroute
sim` on the packaged trace and `kvroute demo` on the packaged tokenizer, from a directory outside
the repository, with no PYTHONPATH.  It installs one package, kvroute, and every module and data
file of the checkout's packages is in it.

Nothing is downloaded: the wheel is built without isolation (`build`, `setuptools` and `wheel` come
with the test extra) from a copy of the sources (the checkout stays clean), and installed with
``--no-deps --no-index``; the dependencies come from this interpreter's site-packages through a
.pth file (a path line: the .pth files there, such as the checkout's editable install, stay inert).
The copy's version gets a local suffix, so `--version` can only come from the wheel's metadata.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# package -> its folder in the repository (kvroute.router -> router)
PACKAGE_DIRS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", *PACKAGE_DIRS.values())
WHEEL_VERSION = metadata.version("kvroute") + "+wheel.test"


@dataclass
class Installed:
    venv: Path
    cwd: Path  # outside the repository
    env: dict[str, str]
    record: list[str]  # the files the wheel installed (its RECORD), relative to site-packages
    wheel: Path

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True,
                              timeout=timeout, cwd=self.cwd, env=self.env)


def run_checked(cmd: list[str], **kwargs) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, **kwargs)
    assert done.returncode == 0, f"{' '.join(cmd[:4])} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    if importlib.util.find_spec("build") is None:
        pytest.fail("the wheel test needs `build` (the test extra): pip install -e '.[test]'")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    pyproject = src / "pyproject.toml"
    text = pyproject.read_text()
    assert f'version = "{metadata.version("kvroute")}"' in text
    pyproject.write_text(text.replace(f'version = "{metadata.version("kvroute")}"', f'version = "{WHEEL_VERSION}"', 1))
    run_checked([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)])
    (wheel,) = (tmp / "dist").glob("kvroute-*.whl")

    venv = tmp / "venv"
    run_checked([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    venv_python = str(venv / "bin" / "python")
    site = subprocess.run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "kvroute-deps.pth").write_text("".join(f"{p}\n" for p in deps))
    run_checked([sys.executable, "-m", "pip", "--python", venv_python, "install", "--no-deps", "--no-index", str(wheel)])
    (record_file,) = Path(site).glob("kvroute-*.dist-info/RECORD")
    with record_file.open(newline="") as f:
        record = [row[0] for row in csv.reader(f)]

    cwd = tmp / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return Installed(venv, cwd, env, record, wheel)


def test_the_installed_package_is_imported_not_the_checkout(installed):
    packages = sorted(PACKAGE_DIRS)
    done = installed.run("python", "-c", f"import sys, {', '.join(packages)}; "
                         f"print('\\n'.join([{', '.join(p + '.__file__' for p in packages)}, *sys.path]))")
    assert done.returncode == 0, done.stderr
    modules = done.stdout.splitlines()[:len(packages)]
    assert all(Path(m).is_relative_to(installed.venv) for m in modules), modules
    assert str(REPO) not in done.stdout.splitlines()[len(packages):], "the checkout is on sys.path"


def test_the_wheel_installs_kvroute_alone(installed):
    """One top-level name in site-packages: the kvroute namespace (and the wheel's own metadata)."""
    tops = {Path(path).parts[0] for path in installed.record if not path.startswith("../")}
    (dist_info,) = tops - {"kvroute"}
    assert dist_info.startswith("kvroute-") and dist_info.endswith(".dist-info"), tops
    assert all(not path.startswith("kvroute/__init__") for path in installed.record), "kvroute is a namespace package"
    assert [p for p in installed.record if p.startswith("../")] == ["../../../bin/kvroute"], "the console script alone"


def test_the_wheel_holds_every_module_and_data_file_of_the_checkout(installed):
    """pyproject.toml lists the packages one by one: a folder of modules left out of that list,
    or data left out of package-data (the index's Lua scripts), would be missing here."""
    shipped = set(installed.record)
    for package, folder in PACKAGE_DIRS.items():
        tracked = subprocess.run(["git", "ls-files", folder], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.split()
        assert tracked, folder
        wanted = {package.replace(".", "/") + path[len(folder):] for path in tracked
                  if path.endswith((".py", ".lua", ".json", ".jsonl.gz")) or path.endswith("data/README.md")}
        assert wanted <= shipped, sorted(wanted - shipped)


def test_python_m_kvroute_cli_runs_the_command(installed):
    done = installed.run("python", "-m", "kvroute.cli", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kvroute {WHEEL_VERSION}"


def test_version_comes_from_the_wheel(installed):
    done = installed.run("kvroute", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kvroute {WHEEL_VERSION}"


def test_sim_runs_the_packaged_trace(installed):
    done = installed.run("kvroute", "sim", "--workload", "trace", "--requests", "40", "--replicas", "2",
                         "--policy", "cost_model,round_robin", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["workload"] == "trace"
    assert {name: p["requests"] for name, p in result["policies"].items()} == {"cost_model": 40, "round_robin": 40}


def test_demo_runs_on_the_packaged_tokenizer(installed):
    done = installed.run("kvroute", "demo", "--replicas", "2", "--sessions", "6", "--session-rate", "8",
                         "--time-scale", "0.05", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    served = {name: p["requests"] for name, p in result["policies"].items()}
    assert set(served) == {"round_robin", "cost_model"}
    assert served["cost_model"] == served["round_robin"] == result["requests_sent"] > 0


def test_plot_without_matplotlib_says_how_to_install_it(installed, tmp_path):
    """matplotlib is the `plot` extra: hide it (a package that fails to import first on the path)
    and `kvroute sim --plot` stops before simulating, naming the extra."""
    hidden = tmp_path / "no-matplotlib" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = installed.env | {"PYTHONPATH": str(hidden.parent)}
    done = subprocess.run([str(installed.venv / "bin" / "kvroute"), "sim", "--workload", "random", "--requests", "10",
                           "--plot", str(tmp_path / "x.png")], capture_output=True, text=True, timeout=60,
                          cwd=installed.cwd, env=env)
    assert done.returncode != 0
    assert "kvroute sim --plot needs matplotlib" in done.stderr and "kvroute[plot]" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "x.png").exists()


def test_the_wheel_carries_the_licence_and_its_metadata(installed):
    """PEP 639: the licence as an SPDX expression and its file in the wheel (vLLM's licence,
    Apache-2.0, the standard text); classifiers that PyPI accepts (trove-classifiers' list)."""
    import zipfile
    from email.parser import HeaderParser

    import trove_classifiers

    with zipfile.ZipFile(installed.wheel) as whl:
        names = whl.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = HeaderParser().parsestr(whl.read(meta_name).decode())
        (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        text = whl.read(licence).decode()
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    assert text == (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 201
    classifiers = meta.get_all("Classifier")
    assert classifiers and not [c for c in classifiers if c not in trove_classifiers.classifiers]
    assert not [c for c in classifiers if c.startswith("License ::")]  # superseded by License-Expression
    assert meta["Author"] == "kvroute maintainers"
    assert {"vllm", "router"} <= set(meta["Keywords"].split(","))


def test_the_wheel_demo_installs_the_lock_and_the_wheel_outside_the_checkout(tmp_path):
    """`make wheel-demo` (scripts/wheel-demo.sh) as a user runs it: `pip wheel --no-deps`, a fresh
    virtualenv in a temporary directory with the lock's dependencies (hashes required) and the
    wheel, `pip check`, then `kvroute demo` from there; the temporary directory is gone after."""
    before = set(Path(tempfile.gettempdir()).glob("kvroute-wheel.*"))
    done = subprocess.run([str(REPO / "scripts" / "wheel-demo.sh"), str(tmp_path / "wheel")], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=os.environ | {"PY": sys.executable})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"kvroute {metadata.version('kvroute')}" in done.stdout
    assert re.search(r"kvroute demo from the installed wheel: [1-9]\d* requests, all served under each policy", done.stdout)
    assert [p.name for p in (tmp_path / "wheel").iterdir()] == [f"kvroute-{metadata.version('kvroute')}-py3-none-any.whl"]
    assert set(Path(tempfile.gettempdir()).glob("kvroute-wheel.*")) == before


# ---------------------------------------------------------------------------------------------
# deploy/requirements.lock: the runtime dependencies the router image installs (`make lock`)

LOCK = REPO / "deploy" / "requirements.lock"


@dataclass
class Locked:
    version: str
    hashes: list[str]
    via: list[str]


def read_lock(text: str) -> dict[str, Locked]:
    """uv's `pip compile --generate-hashes` format: `name==version \\`, `--hash=sha256:...` lines,
    then `# via` annotations (one name on the line, or one per following comment line)."""
    import re

    from packaging.utils import canonicalize_name

    entries: dict[str, Locked] = {}
    current: Locked | None = None
    in_via = False
    for line in text.splitlines():
        if m := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
            current = entries[canonicalize_name(m.group(1))] = Locked(m.group(2), [], [])
            in_via = False
        elif current and (m := re.match(r"^\s+--hash=sha256:([0-9a-f]{64})", line)):
            current.hashes.append(m.group(1))
        elif current and (m := re.match(r"^\s+# via(.*)$", line)):
            in_via = True
            if m.group(1).strip():
                current.via.append(m.group(1).strip())
        elif current and in_via and (m := re.match(r"^\s+#\s+(\S.*)$", line)):
            current.via.append(m.group(1).strip())
        elif line.strip() and not line.startswith("#"):
            raise AssertionError(f"a lock line read as nothing: {line!r}")
    return entries


# the extras the router image carries: Kubernetes discovery (the chart's k8s.selector) and
# --tracing (the chart's router.tracing), so that a value of the chart never needs another image
IMAGE_EXTRAS = ("k8s", "otel")


def runtime_requirements() -> list:
    """pyproject.toml's dependencies and those of IMAGE_EXTRAS (the router image installs them all)."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]
            + [r for extra in IMAGE_EXTRAS for r in project["optional-dependencies"][extra]]]


def test_make_lock_resolves_the_extras_the_image_carries():
    """`make lock` passes exactly IMAGE_EXTRAS to uv, so the lock it writes is the one checked here."""
    import re

    makefile = (REPO / "Makefile").read_text()
    command = " ".join(makefile.split("\nlock: install\n", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ").split())
    assert "uv pip compile pyproject.toml" in command
    assert tuple(re.findall(r"--extra (\S+)", command)) == IMAGE_EXTRAS


def extra_requirements(requirement) -> list:
    """What ``requirement``'s extras (redis[hiredis]) add, from the installed distribution's metadata."""
    from packaging.requirements import Requirement

    out = []
    for text in metadata.requires(requirement.name) or []:
        r = Requirement(text)
        if r.marker and any(r.marker.evaluate({"extra": e}) for e in requirement.extras) \
                and not r.marker.evaluate({"extra": ""}):
            out.append(r)
    return out


def missing_from_lock(lock: dict[str, Locked], requirements: list) -> list[str]:
    from packaging.utils import canonicalize_name

    bad = []
    for r in requirements:
        entry = lock.get(canonicalize_name(r.name))
        if entry is None:
            bad.append(f"{r.name}: not in the lock")
        elif not r.specifier.contains(entry.version, prereleases=True):
            bad.append(f"{r.name}=={entry.version}: outside {r.specifier}")
    return bad


def test_the_lock_pins_every_runtime_dependency_in_its_declared_range():
    lock = read_lock(LOCK.read_text())
    requirements = runtime_requirements()
    extras = [e for r in requirements for e in extra_requirements(r)]
    assert any(e.name == "hiredis" for e in extras)  # redis[hiredis]: the extra is read, not skipped
    assert missing_from_lock(lock, requirements + extras) == []


def test_the_lock_check_catches_a_missing_or_out_of_range_pin():
    from packaging.requirements import Requirement

    lock = read_lock(LOCK.read_text())
    assert missing_from_lock({k: v for k, v in lock.items() if k != "aiohttp"}, [Requirement("aiohttp>=3.9")])
    low = lock | {"pyzmq": Locked("24.0.0", ["0" * 64], ["kvroute (pyproject.toml)"])}
    assert missing_from_lock(low, [Requirement("pyzmq>=25")]) == ["pyzmq==24.0.0: outside >=25"]


def test_every_locked_package_is_pinned_hashed_and_needed():
    """Each entry has an exact version and sha256 hashes (pip --require-hashes), and is there
    because kvroute or another locked package needs it; the header names the make target."""
    text = LOCK.read_text()
    assert text.splitlines()[:2] == ["# This file was autogenerated by uv via the following command:", "#    make lock"]
    lock = read_lock(text)
    assert len(lock) >= len(runtime_requirements())
    for name, entry in lock.items():
        assert entry.hashes, name
        assert entry.via, name
        for parent in entry.via:
            assert parent == "kvroute (pyproject.toml)" or parent in lock, (name, parent)


def test_the_lock_holds_what_its_packages_need():
    """The closure: for each locked package installed here at the locked version, every
    requirement of its metadata that applies on Linux / CPython 3.11 is locked in its range (the
    image's `pip check` checks the whole set when it is built)."""
    from packaging.requirements import Requirement

    lock = read_lock(LOCK.read_text())
    environment = {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                   "python_version": "3.11", "python_full_version": "3.11.9", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "platform_machine": "x86_64", "extra": ""}
    checked, bad = 0, []
    for name, entry in lock.items():
        try:
            if metadata.version(name) != entry.version:
                continue
        except metadata.PackageNotFoundError:
            continue
        checked += 1
        needs = [Requirement(t) for t in metadata.requires(name) or []]
        bad += [f"{name} -> {m}" for m in
                missing_from_lock(lock, [r for r in needs if not r.marker or r.marker.evaluate(environment)])]
    assert checked >= len(lock) // 2, f"only {checked} of {len(lock)} locked packages installed at their version"
    assert bad == []
