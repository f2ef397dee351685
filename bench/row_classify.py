"""Host time per vLLM step spent classifying rows: the plugin's classifier vs the per-request loop it replaced.

Every step of a RidgeFill engine is classified before the model runs, decodes included, so this time
is added to every decode step. The baseline is the earlier classifier (commit 62b046c), kept here
verbatim in spirit: a torch loop over every request of the step, reading positions from a tensor.

    python bench/row_classify.py --batches 8 64 256
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import Tensor

from ridgefill.rows import ROWS, RowPolicy, protected_mask
from ridgefill.vllm_plugin.batch import RowClassifier


def loop_classify(masks: dict, req_ids, qsl, prompt_lens, prompt_ids, positions, sink: int, tail: int) -> Tensor:
    """The earlier classifier: one torch pass per request, decodes included (runs omitted: they cost the same)."""
    num_tokens = int(qsl[-1])
    pos = positions[:num_tokens].cpu().long()
    protected = torch.ones(positions.shape[0], dtype=torch.bool)
    req_of_token = torch.zeros(positions.shape[0], dtype=torch.long)
    for r, req_id in enumerate(req_ids):
        a, b = int(qsl[r]), int(qsl[r + 1])
        req_of_token[a:b] = r
        p, plen = pos[a:b], int(prompt_lens[r])
        in_prompt = p < plen
        if bool(in_prompt.any()):
            if req_id not in masks:
                ids = torch.from_numpy(np.asarray(prompt_ids(r, plen), dtype=np.int64))
                masks[req_id] = protected_mask(ids, sink, tail, 0.0, None)
            protected[a:b] = torch.where(in_prompt, masks[req_id][p.clamp_max(plen - 1)], True)
    return protected


def timed(fn, repeats: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk scheduled beside the decodes")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    sink, tail = ROWS.sink, ROWS.tail
    print("| requests | step | earlier loop ms | classifier ms | ratio |")
    print("|---|---|---|---|---|")
    for b in args.batches:
        ids = [f"r{i}" for i in range(b)]
        prompt = np.arange(8192)
        # decode-only: every request one token past its 1000-token prompt
        dec = (np.arange(b + 1), np.full(b, 1000), np.full(b, 1000 + b))
        # mixed: b - 1 decodes and one request prefilling a chunk of its 8192-token prompt
        counts = np.append(np.ones(b - 1, dtype=np.int64), args.chunk)
        mix_computed = np.append(np.full(b - 1, 1000 + b), 4096)
        mix = (np.concatenate([[0], np.cumsum(counts)]), np.append(np.full(b - 1, 1000), 8192), mix_computed)
        for name, (qsl, plens, computed) in [("decode only", dec), ("decodes + prefill chunk", mix)]:
            positions = torch.from_numpy(np.repeat(computed - qsl[:-1], np.diff(qsl)) + np.arange(qsl[-1]))
            clf, masks = RowClassifier(RowPolicy(sink, tail, 0.0), None), {}
            old = timed(
                lambda: loop_classify(masks, ids, qsl, plens, lambda r, n: prompt[:n], positions, sink, tail),  # noqa: B023
                args.repeats,
            )
            new = timed(lambda: clf.classify(ids, qsl, computed, plens, lambda r, n: prompt[:n]), args.repeats)  # noqa: B023
            print(f"| {b} | {name} | {old:.3f} | {new:.3f} | {old / new:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
