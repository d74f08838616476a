"""Test configuration: make tests/ importable for shared helpers and keep the kernel cache
inside a per-session temporary directory."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
# the checkout under test, whatever copy of tilefuse pip has installed (an editable install
# of another clone would otherwise be tested silently)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
# (each pytest-xdist worker its own: a worker inherits the controller's, marked as the tests' own; the
# marker is no TILEFUSE_ variable, which the library would warn of as an unknown knob)
if os.environ.get("TILEFUSE_CACHE_DIR", "") in ("", os.environ.get("PYTEST_TILEFUSE_OWN_CACHE_DIR")):
    os.environ["TILEFUSE_CACHE_DIR"] = os.environ["PYTEST_TILEFUSE_OWN_CACHE_DIR"] = \
        tempfile.mkdtemp(prefix="tilefuse-test-cache-")
os.environ.setdefault("TILEFUSE_FALLBACK", "error")
# tests check results, not speed: no measured tuning on a GPU (the cost model still chooses)
os.environ.setdefault("TILEFUSE_AUTOTUNE", "0")
# every test compiles what it runs: a graph loaded from the graph cache would hide the compile a
# test patches or inspects (tests/test_graph_cache.py turns it on where it is the subject)
os.environ.setdefault("TILEFUSE_GRAPH_CACHE", "0")
