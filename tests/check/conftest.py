"""The correctness tests exercise the Triton path (through the interpreter on CPU): verify mode
and the safe-failure tests patch the Triton launcher and code generator."""
import os

import pytest

import tilefuse

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _triton_backend():
    with tilefuse.config.patch(target="interpret" if DEVICE == "cpu" else "triton"):
        yield
