"""tools/gpu_check.py on CPU: the prepared GPU check's copy part runs here through the same code
(immediate completion instead of events), so it is known to work when a GPU is lent, and writes
its JSON and summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools import gpu_check


def test_the_copy_checks_pass_on_cpu_and_the_results_are_written(tmp_path: Path) -> None:
    results = gpu_check.run(torch.device("cpu"), tmp_path, job_mib=1, skip_engine=True,
                            peak_mib=4)
    failed = {k: v for k, v in results.items() if isinstance(v, dict) and v.get("ok") is False}
    assert results["ok"] and not failed, failed
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["copy.store_waits_for_the_forward"]["ok"]
    assert saved["bandwidth"]["blocks"] >= 1
    summary = (tmp_path / "gpu_check.md").read_text()
    assert summary.startswith("# kvport GPU check: passed") and "| store (D2H) |" in summary
