#!/usr/bin/env bash
# The install a user does from a built wheel, checked end to end:
#
#   scripts/wheel-demo.sh [WHEEL_DIR]      env: PY (python3.11)
#
# 1. `pip wheel --no-deps -w WHEEL_DIR .` builds kvroute's wheel (default build/wheel);
# 2. a fresh virtualenv in a temporary directory outside the checkout gets the runtime dependencies
#    exactly as deploy/requirements.lock pins them (versions and hashes, as the router image
#    installs them), then the wheel without dependencies, then `pip check`;
# 3. from that temporary directory, with no PYTHONPATH, `kvroute --version` and `kvroute demo` in
#    its quickest mode (2 replicas, 6 conversations, 20x real time, --json): its tokenizer comes from
#    the installed package, not from the checkout.
# The temporary directory is removed at the end; the wheel stays in WHEEL_DIR.
set -euo pipefail

cd "$(dirname "$0")/.."
WHEEL_DIR=${1:-build/wheel}
PY=${PY:-python3.11}
command -v "$PY" >/dev/null || PY=python3

# setuptools builds in ./build and never empties it: a module deleted since the last build would ship
rm -rf "$WHEEL_DIR" build/lib build/bdist.*
"$PY" -m pip wheel --quiet --no-deps -w "$WHEEL_DIR" .
wheel=$(ls "$WHEEL_DIR"/kvroute-*.whl)

tmp=$(mktemp -d -t kvroute-wheel.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --no-deps --require-hashes -r deploy/requirements.lock
"${pip[@]}" install --no-deps "$wheel"
"${pip[@]}" check

cd "$tmp"
unset PYTHONPATH VIRTUAL_ENV
"$tmp/venv/bin/kvroute" --version
"$tmp/venv/bin/kvroute" demo --replicas 2 --sessions 6 --session-rate 8 --time-scale 0.05 --json >"$tmp/demo.json"
"$tmp/venv/bin/python" - "$tmp/demo.json" <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
served = {name: p["requests"] for name, p in result["policies"].items()}
sent = result["requests_sent"]
assert set(served) == {"round_robin", "cost_model"} and set(served.values()) == {sent} and sent > 0, (served, sent)
print(f"kvroute demo from the installed wheel: {sent} requests, all served under each policy")
PY
