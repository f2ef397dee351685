"""One settings module reads every RIDGEFILL_*/HF_* variable (ridgefill/settings.py)."""

from __future__ import annotations

import re
from pathlib import Path

from ridgefill import settings
from ridgefill.default_model import cache_root
from ridgefill.results import default_db, default_work

ROOT = Path(__file__).resolve().parents[1]
READ = re.compile(r"""os\.(?:environ(?:\.get)?|getenv)\s*[\[(]\s*["']((?:RIDGEFILL|HF)_\w+)""")


def test_no_module_reads_a_ridgefill_or_hub_variable_but_settings():
    found = {
        f"{p.relative_to(ROOT)}: {m}"
        for d in ("ridgefill", "registry", "tasks", "flows")
        for p in (ROOT / d).rglob("*.py")
        if p.name != "settings.py"
        for m in READ.findall(p.read_text())
    }
    assert not found


def test_every_variable_is_documented_and_read_when_asked(monkeypatch, tmp_path):
    assert all(v.doc for v in settings.VARIABLES.values())
    assert all(name in settings.describe() for name in settings.VARIABLES)
    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path / "c"))
    monkeypatch.delenv("RIDGEFILL_WORK", raising=False)
    monkeypatch.setenv("RIDGEFILL_DB", "")  # empty counts as unset
    assert cache_root() == tmp_path / "c" and default_work() == tmp_path / "c" / "tune"
    assert default_db() == tmp_path / "c" / "tune" / "ridgefill.duckdb"
    monkeypatch.setenv("RIDGEFILL_LOG_EVERY", "x")
    assert settings.log_every() == 256 and settings.get("RIDGEFILL_REGISTRY_BACKEND") == "auto"
