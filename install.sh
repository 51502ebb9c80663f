#!/usr/bin/env bash
# Installs everything deepmetric needs on a fresh Debian machine (run as root or with sudo):
#   - apt: the Fashion-MNIST IDX files and the CJK fonts the glyph benchmark is rendered from;
#     Debian's chromium (+ Latin fonts) for the browser tests of report.html (headless);
#   - a virtual environment in .venv with deepmetric (editable) and its test tools.
# Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")"

APT_PACKAGES=(
  dataset-fashion-mnist fontconfig
  fonts-noto-cjk fonts-noto-cjk-extra fonts-arphic-ukai fonts-arphic-uming
  fonts-wqy-zenhei fonts-wqy-microhei fonts-lxgw-wenkai fonts-babelstone-han
  chromium fonts-dejavu-core fonts-liberation
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "install.sh: apt-get install ${missing[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch/torchvision are pinned in pyproject.toml (2.14.1 / 0.29.1).
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
echo "install.sh: ready (.venv/bin/deepmetric)"
