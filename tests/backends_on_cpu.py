"""The CPU backends a test compares: on a CPU run of the suite (TILEFUSE_TEST_DEVICE unset or
"cpu") the C++ backend and the Triton interpreter, which tilefuse scopes to its own kernels
(no TRITON_INTERPRET needed); a GPU run compares the C++ backend only."""
import os

CPU_BACKENDS = ["cpu", "interpret"] if os.environ.get("TILEFUSE_TEST_DEVICE", "cpu") == "cpu" else ["cpu"]
