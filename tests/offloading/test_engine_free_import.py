"""Import layering of the OffloadingConnector: it imports no engine module at run time (another
engine that supplies objects with the same attributes can load and drive it), and its worker
half does not import its scheduler half."""

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
        import kvport.connectors.offloading.worker.half, kvport.connectors.offloading.scheduler.half
        assert not [m for m in sys.modules if m.startswith("kvport.engine.")], sys.modules
        print(connector.OffloadingConnector.__name__)
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "OffloadingConnector"


def test_the_worker_half_does_not_import_the_scheduler_half() -> None:
    script = textwrap.dedent("""
        import sys
        import kvport.connectors.offloading.worker.half
        print("kvport.connectors.offloading.scheduler.half" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
