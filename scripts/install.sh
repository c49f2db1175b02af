#!/usr/bin/env bash
# Create .venv (or reuse it) and install spd with its dev extras.
# Torch: the CUDA build where an NVIDIA GPU is present; otherwise the CPU build (a local CPU wheel if pip
# can find one without an index, else PyTorch's CPU wheel index), so a CPU-only machine never downloads
# the multi-GB CUDA packages. Set SPD_EXTRAS (default "dev") to add extras, e.g. SPD_EXTRAS=dev,train.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${SPD_VENV:-.venv}
EXTRAS=${SPD_EXTRAS:-dev}
CPU_INDEX=${SPD_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: Python >= 3.10 is required, found " + sys.version.split()[0])'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
pip_q() { "$PY" -m pip install -q "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }

if ! "$PY" -W ignore -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "[install] NVIDIA GPU found: installing the CUDA build of torch"
        pip_q torch
    else
        echo "[install] no GPU: installing the CPU build of torch"
        if ! "$PY" -m pip install -q --no-deps --no-index "torch==${SPD_TORCH_VERSION:-2.13.0}" >/dev/null 2>&1; then
            pip_q --no-deps torch --index-url "$CPU_INDEX"
        fi
        # Now that a CPU torch is installed, pinning its exact version pulls only its small dependencies.
        # (Read the version from the package metadata: torch itself cannot import before its dependencies.)
        pip_q "torch==$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
    fi
fi
"$PY" -W ignore -c "import torch" || { echo "error: torch could not be installed into $VENV" >&2; exit 1; }
echo "[install] installing spd[$EXTRAS]"
pip_q -e ".[$EXTRAS]"
"$PY" -c "import spd, torch, transformers; print(f'[install] spd {spd.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
# The repository's own modules compiled once (Python reads these even where PYTHONDONTWRITEBYTECODE is set, so each
# of the many processes the tests start does not compile them again).
"$PY" -m compileall -q -j 0 spd data train tests >/dev/null
# DeepSpeed builds its CPU collective op (a C++ extension, about a minute on 2 cores) the first time a job uses it;
# build it here, once per machine (cached under ~/.cache/torch_extensions), rather than inside the first ZeRO job.
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)" 2>/dev/null \
    && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    DS_ACCELERATOR=cpu "$PY" -W ignore -c "
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder('ShareMemCommBuilder')
builder and builder.load(verbose=False)" >/dev/null 2>&1 || echo "[install] warning: DeepSpeed's CPU op did not build; a ZeRO job will try again"
fi
