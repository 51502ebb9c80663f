#!/usr/bin/env bash
# Installs everything deepmetric needs on a fresh Debian machine (run as root or with sudo):
#   - apt: the Fashion-MNIST IDX files and the CJK fonts the glyph benchmark is rendered from;
#     Debian's chromium (+ Latin fonts) for the browser tests of report.html and the search page;
#     PostgreSQL's server binaries, which the shared-study test of `deepmetric tune` starts on
#     127.0.0.1 in a temporary directory (the package's own cluster is not used);
#   - python3-venv (stock Debian leaves it out) and a virtual environment in .venv with deepmetric
#     (editable) and its test tools;
#   - the emoji benchmark's artwork: pinned npm packages (Node.js and npm from apt if missing),
#     only the files used extracted into the deepmetric cache (see docs/offline-data.md).
# Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")"

APT_PACKAGES=(
  dataset-fashion-mnist fontconfig
  fonts-noto-cjk fonts-noto-cjk-extra fonts-arphic-ukai fonts-arphic-uming
  fonts-wqy-zenhei fonts-wqy-microhei fonts-lxgw-wenkai fonts-babelstone-han
  chromium fonts-dejavu-core fonts-liberation
  postgresql
  python3-venv
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
# torch/torchvision are pinned in pyproject.toml (2.14.1 / 0.29.1).  The dev extra includes the
# optional extras (serve, export, tracking: TensorBoard and MLflow for train.loggers), so the tests of
# every feature run here and in CI.
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'

# Emoji benchmark: emoji-datasource-{apple,google,twitter,facebook}@16.0.0, emojione-assets@4.5.0,
# openmoji@17.0.0 from the npm registry (sha512-checked), extracted once into
# ${DEEPMETRIC_CACHE:-~/.cache/deepmetric}/emoji/packages/; skipped when already there.
if ! command -v npm >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "install.sh: apt-get install nodejs npm (for the emoji packages)"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends nodejs npm
fi
.venv/bin/deepmetric emoji install
echo "install.sh: ready (.venv/bin/deepmetric)"
