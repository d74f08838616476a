"""What Inductor generates for RMSNorm next to tilefuse's tuned kernel (configuration and
source), for the reduction kernels' last few percent.

    PYTHONPATH=src python scripts/probe_rmsnorm.py
"""
import torch
from torch._inductor.utils import run_and_get_code

import tilefuse
from tilefuse.bench.workloads import WORKLOADS

w = WORKLOADS["rmsnorm"]
x, wt = w.make_inputs((16384, 8192), torch.device("cuda"), torch.bfloat16)
_, codes = run_and_get_code(torch.compile(w.fn), x, wt)
for code in codes:
    keep = [ln for ln in code.splitlines() if any(k in ln for k in ("@triton", "def triton", "tl.load", "tl.store",
                                                                      "num_warps", "BLOCK", "tl.sum", "eviction",
                                                                      "reduction_hint", "triton_meta"))]
    print("\n".join(keep[:60]))
torch._dynamo.reset()
rep = tilefuse.explain(w.fn, x, wt)
for k in rep.kernels:
    print(k.notes)
    print(k.source[k.source.index("@triton.jit\ndef kernel"):])
