"""The CPU backends a test compares: the C++ backend, and the Triton interpreter where the
test run set it up (`TRITON_INTERPRET=1`, as CI does; a GPU run of the suite does not)."""
import os

CPU_BACKENDS = ["cpu"] + (["interpret"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
