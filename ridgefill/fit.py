"""Closed-form centred ridge with an unpenalised bias, for every late layer of a split.

With x̄, ȳ the means and Cxx, Cxy the centred (co)variances of the split stream x and the late input y:
    W = (Cxx + λ·mean_eig(Cxx)·I)^-1 Cxy,   b = ȳ - x̄ W
λ is relative to the mean eigenvalue, so one value means the same across models and layers. One
eigendecomposition Cxx = Q Λ Qᵀ per split serves every λ and every late layer:
    W = Q diag(1/(Λ+λ')) Qᵀ Cxy
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ridgefill.capture import SplitStats


@dataclass
class RidgeSolver:
    """Everything about one split that does not depend on λ: means, eigenbasis, rotated Cxy."""

    split: int
    count: int
    x_mean: Tensor
    eigvals: Tensor
    eigvecs: Tensor
    y_mean: dict[int, Tensor]
    rotated_xy: dict[int, Tensor]  # Qᵀ Cxy per late layer

    @classmethod
    def from_stats(cls, st: SplitStats) -> RidgeSolver:
        if st.count < 2:
            raise ValueError(f"split {st.split}: need at least 2 calibration rows, have {st.count}")
        n = st.count
        x_mean = st.x_sum / n
        cxx = st.xx - n * torch.outer(x_mean, x_mean)
        eigvals, eigvecs = torch.linalg.eigh((cxx + cxx.T) / 2)
        eigvals = eigvals.clamp_min(0)
        y_mean, rotated = {}, {}
        for l, xy in st.xy.items():
            y_mean[l] = st.y_sum[l] / n
            rotated[l] = eigvecs.T @ (xy - n * torch.outer(x_mean, y_mean[l]))
        return cls(st.split, n, x_mean, eigvals, eigvecs, y_mean, rotated)

    @property
    def late_layers(self) -> list[int]:
        return sorted(self.rotated_xy)

    def absolute_lambda(self, lam: float) -> float:
        return float(lam * self.eigvals.mean())

    def solve(self, lam: float, layers: list[int] | None = None) -> dict[int, tuple[Tensor, Tensor]]:
        """Maps {l: (W [d, d], b [d])} in float64 for relative ridge strength `lam`."""
        if lam < 0:
            raise ValueError("lambda must be >= 0")
        inv = 1.0 / (self.eigvals + self.absolute_lambda(lam))
        inv = torch.where(torch.isfinite(inv), inv, torch.zeros_like(inv))
        out = {}
        for l in layers or self.late_layers:
            w = self.eigvecs @ (inv[:, None] * self.rotated_xy[l])
            out[l] = (w, self.y_mean[l] - self.x_mean @ w)
        return out


def fit_split(st: SplitStats, lam: float) -> dict[int, tuple[Tensor, Tensor]]:
    return RidgeSolver.from_stats(st).solve(lam)


def identity_maps(split: int, num_layers: int, d: int) -> dict[int, tuple[Tensor, Tensor]]:
    """Identity fill h_l = h_S as explicit maps (for tests and for engines that want matrices)."""
    eye, zero = torch.eye(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    return {l: (eye, zero) for l in range(split + 1, num_layers)}
