"""A trial's parameters, a core value: the split, the ridge lambda and the protected-row policy.

Core (not `search`), so the steps that fit a trial (`ridgefill.steps.fit_trial`) take it without an upward
import; `ridgefill.search` re-exports it as `search.Params`."""

from __future__ import annotations

from dataclasses import dataclass

from ridgefill.rows import ROWS, RowPolicy


@dataclass(frozen=True)
class Params:
    """A trial's configuration: the split, the ridge lambda and its protected-row policy."""

    split: int
    lam: float
    rows: RowPolicy = ROWS

    def as_dict(self) -> dict:
        """Flat, as Optuna's user attributes and DuckDB keep it: split, lam and the row policy's fields."""
        return {"split": self.split, "lam": self.lam} | self.rows.as_dict()

    @classmethod
    def of(cls, d: dict) -> Params:
        """The parameters `as_dict` (or an older trial's subset of the row fields) names."""
        return cls(int(d["split"]), float(d["lam"]), RowPolicy.of({k: v for k, v in d.items() if v is not None}))
