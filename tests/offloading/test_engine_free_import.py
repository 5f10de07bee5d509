"""The OffloadingConnector imports no engine module at run time: another engine that supplies
objects with the same attributes (requests, scheduler outputs) can load and drive it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_connector_imports_with_the_engine_unimportable() -> None:
    # sys.modules[name] = None makes every `import kvport.engine...` raise ImportError.
    script = textwrap.dedent("""
        import sys
        sys.modules["kvport.engine"] = None
        import kvport.connectors.offloading.connector as connector
        import kvport.connectors.offloading.worker, kvport.connectors.offloading.scheduler
        assert not [m for m in sys.modules if m.startswith("kvport.engine.")], sys.modules
        print(connector.OffloadingConnector.__name__)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "OffloadingConnector"
