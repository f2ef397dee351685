"""The closed-form ridge fit: recovers planted maps, and the eigen path equals a direct solve."""

import torch

from ridgefill.capture import SplitStats
from ridgefill.fit import RidgeSolver


def _stats(x: torch.Tensor, ys: dict[int, torch.Tensor]) -> SplitStats:
    st = SplitStats.zeros(0, max(ys) + 1, x.shape[1])
    for rows in torch.arange(x.shape[0]).split(97):  # streamed in uneven chunks
        st.add(x[rows], {l: y[rows] for l, y in ys.items()})
    return st


def test_recovers_planted_linear_map():
    g = torch.Generator().manual_seed(0)
    d, n = 24, 2000
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.5, 3, d, dtype=torch.float64) + 2.0
    planted = {
        l: (torch.randn(d, d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64))
        for l in (1, 2, 3)
    }
    ys = {l: x @ w + b for l, (w, b) in planted.items()}
    maps = RidgeSolver.from_stats(_stats(x, ys)).solve(0.0)
    for l, (w, b) in planted.items():
        assert (maps[l][0] - w).abs().max() < 1e-6
        assert (maps[l][1] - b).abs().max() < 1e-6


def test_eigen_path_equals_direct_solve():
    g = torch.Generator().manual_seed(1)
    d, n = 16, 500
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)
    ys = {1: torch.randn(n, d, generator=g, dtype=torch.float64) + x[:, :1], 2: x.tanh()}
    solver = RidgeSolver.from_stats(_stats(x, ys))
    xc = x - x.mean(0)
    cxx = xc.T @ xc
    mean_eig = torch.linalg.eigvalsh(cxx).mean()
    for lam in (1e-4, 1e-2, 0.3, 3.0):
        maps = solver.solve(lam)
        for l, y in ys.items():
            w = torch.linalg.solve(cxx + lam * mean_eig * torch.eye(d, dtype=torch.float64), xc.T @ (y - y.mean(0)))
            b = y.mean(0) - x.mean(0) @ w
            torch.testing.assert_close(maps[l][0], w, rtol=1e-8, atol=1e-8)
            torch.testing.assert_close(maps[l][1], b, rtol=1e-8, atol=1e-8)


def test_lambda_shrinks_towards_zero_map():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 8, generator=g, dtype=torch.float64)
    solver = RidgeSolver.from_stats(_stats(x, {1: x * 2}))
    norms = [solver.solve(lam)[1][0].norm().item() for lam in (0.0, 1.0, 100.0)]
    assert norms[0] > norms[1] > norms[2]
