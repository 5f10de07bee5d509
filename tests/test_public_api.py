"""The names DESIGN.md and the README promise import from the package root."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import kvport

ROOT = Path(__file__).resolve().parents[1]


def test_every_exported_name_imports_from_the_root() -> None:
    for name in kvport.__all__:
        assert getattr(kvport, name) is not None, name
    from kvport import KVTransferConfig, RequestMetrics  # noqa: F401  (promised by DESIGN.md)

    assert set(kvport.__all__) <= set(dir(kvport))


def test_every_kvport_import_in_the_docs_works() -> None:
    """Each `from kvport... import ...` line of the README's and docs' examples runs."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    lines = sorted({m.group(0) for doc in docs
                    for m in re.finditer(r"^from kvport[\w.]* import [\w, ]+$",
                                         doc.read_text(), re.M)})
    assert lines, "no kvport imports found in the docs"
    result = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_import_kvport_does_not_import_torch() -> None:
    """`import kvport` (and the CLI's --help) stays cheap: the root exports are lazy."""
    code = "import sys, kvport; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
