#!/usr/bin/env bash
# looprl's Python dependencies on a machine without a package index (a GPU node with its
# own CUDA torch): installs every wheel in the folder WHEELS into PYTHON's packages, from
# that folder alone (pip --no-index: nothing is downloaded), then names each module
# that `bench/checks/gpu_check.sh` needs and that is still missing.
#   WHEELS=DIR PYTHON=python3 bash bench/checks/gpu_wheels.sh
# Make the folder on a machine with an index, for the GPU machine's Python version and
# platform, without dependencies (they would bring another torch); the usual set where
# only torch and numpy are there (a missing one is named by the check below):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 -d wheels transformers tokenizers huggingface_hub \
#     safetensors regex kernels peft accelerate xgrammar apache-tvm-ffi pydantic \
#     pydantic-core annotated-types typing-inspection pyyaml typer click shellingham rich \
#     markdown-it-py mdurl pygments jsonschema jsonschema-specifications referencing \
#     rpds-py attrs psutil tqdm packaging filelock fsspec hf-xet httpx httpcore h11 anyio \
#     idna certifi sniffio
# (tensorboard, matplotlib, fastapi, uvicorn and openai too where the check names them).
set -euo pipefail
PYTHON=${PYTHON:-python3}
if [ -n "${WHEELS:-}" ]; then
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "WHEELS=$WHEELS holds no .whl files" >&2
    exit 1
  fi
  "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" "${wheels[@]}"
fi
"$PYTHON" - <<'PY'
import importlib.util
import sys

# import names: looprl's dependencies (pyproject.toml), those of transformers, peft and
# xgrammar, and psutil (bench/harness.py); gguf only converts GGUF files (not needed
# with SMOLLM2_DIR)
needed = """torch numpy transformers tokenizers huggingface_hub safetensors regex kernels peft
accelerate xgrammar tvm_ffi pydantic yaml typer rich jsonschema psutil tqdm packaging
tensorboard matplotlib fastapi uvicorn openai""".split()
missing = [name for name in needed if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(
        "missing Python modules: " + " ".join(missing) + "\ncarry their wheels in a folder "
        "and run again with WHEELS=that folder (bench/checks/gpu_wheels.sh says how)"
    )
print("Python modules: all present")
PY
