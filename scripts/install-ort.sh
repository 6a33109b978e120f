#!/usr/bin/env bash
# Installs the ONNX Runtime shared library hydrant loads at run time, from the official PyPI wheel.
#   scripts/install-ort.sh [cpu|gpu] [DEST]   (default: cpu, .ort/lib)
# The gpu flavour takes the onnxruntime-gpu wheel, whose CUDA provider libraries must sit beside
# libonnxruntime.so; CUDA and cuDNN themselves come from the machine.
set -euo pipefail
flavour="${1:-cpu}"
dest="${2:-.ort/lib}"
version="1.31.1"
case "$flavour" in
  cpu) pkg="onnxruntime" ;;
  gpu) pkg="onnxruntime-gpu" ;;
  *) echo "usage: $0 [cpu|gpu] [DEST]" >&2; exit 2 ;;
esac
if [ -f "$dest/libonnxruntime.so.$version" ] && [ -f "$dest/.flavour-$flavour" ]; then
  exit 0
fi
# pip fetches the wheel; on a fresh Debian machine (as root) python3 and pip come from apt.
if ! command -v python3 >/dev/null 2>&1 || ! python3 -m pip --version >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing python3 and pip from apt" >&2
    apt-get update -qq && apt-get install -y -qq python3 python3-pip >/dev/null
  else
    echo "python3 with pip is needed to fetch the $pkg wheel (apt-get install -y python3 python3-pip)" >&2
    exit 1
  fi
fi
py="$(command -v python3)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "$pkg==$version"
wheel="$(ls "$tmp"/*.whl)"
mkdir -p "$dest"
rm -f "$dest"/.flavour-*
"$py" - "$wheel" "$dest" <<'PY'
import os, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
n = 0
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if name.startswith("onnxruntime/capi/") and base.startswith("libonnxruntime") and ".so" in base:
            with z.open(name) as src, open(os.path.join(dest, base), "wb") as out:
                out.write(src.read())
            n += 1
if n == 0:
    sys.exit(f"no libonnxruntime*.so in {wheel}")
PY
touch "$dest/.flavour-$flavour"
echo "ONNX Runtime $version ($pkg) installed in $dest" >&2
