#!/usr/bin/env python3
"""The mutation check's command, as README's test command and CI run it (`--list`, `--only NAME...`,
`--changed REV`, `--why`, `--jobs N`). The tool is the package tools/mutation/ (its docstring says
what it does; `python -m tools.mutation` is the same); the mutants live beside the tests that
kill them, in tests/**/mutants*.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.mutation.__main__ import main  # found through the line above

if __name__ == "__main__":
    sys.exit(main())
