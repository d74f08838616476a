"""The fuzzer's numeric programs: float64 programs (judged at float64 precision), rounding round
trips and autocast regions. Generated programs contain them; hand-written ones of each kind,
and a bounded run of generated ones, match eager under the fp64 rule — through the library
matmul too."""
import random

import pytest

import tilefuse
from tilefuse.check import fuzz
from tilefuse.check.program import InputSpec, Program, generate, statement_name, without_region
from tilefuse.check.shrink import candidates, runs_eagerly

REGION = 'with torch.autocast("cpu", dtype=torch.bfloat16): '


def _numeric(p: Program) -> bool:
    return p.dtype == "torch.float64" or any(line.startswith("with ") or ".to(" in line for line in p.lines)


def test_generated_programs_have_float64_casts_and_autocast_regions():
    programs = [generate(random.Random(k)) for k in range(200)]
    assert sum(p.dtype == "torch.float64" for p in programs) >= 20
    regions = [line for p in programs for line in p.lines if line.startswith("with torch.autocast(")]
    assert len(regions) >= 5
    assert any(".bfloat16().to(" in line for p in programs for line in p.lines)
    for p in programs:
        if any(line.startswith("with ") for line in p.lines):
            assert runs_eagerly(p), p.function_source()


def test_region_statements_name_and_shrink():
    line = REGION + "v2 = v0 @ x1"
    assert statement_name(line) == "v2" and without_region(line) == "v2 = v0 @ x1"
    p = Program((InputSpec("x0", (5, 7)), InputSpec("x1", (7, 3))), ("v0 = x0 * 2", line.replace("v2", "v1")),
                ("v1",))
    assert any(c.lines == ("v0 = x0 * 2", "v1 = v0 @ x1") for c in candidates(p))


#: (program, matmul knob): a rounding feeding a library product; autocast's F.linear with a
#: bias (the CPU's ATen product + epilogue); a float64 product and an online softmax
CASES = [
    (Program((InputSpec("x0", (13, 31)), InputSpec("x1", (31, 17))),
             ("v0 = x0.bfloat16().to(x0.dtype) @ x1",), ("v0",)), "aten"),
    (Program((InputSpec("x0", (13, 31)), InputSpec("x1", (31, 17))),
             ("v0 = x0.half().to(x0.dtype) @ x1",), ("v0",), dtype="torch.float64"), "aten"),
    (Program((InputSpec("x0", (3, 37, 53)), InputSpec("x1", (29, 53))),
             (REGION + "v0 = F.linear(x0, x1, x1[:, 0])",), ("v0",)), "auto"),
    (Program((InputSpec("x0", (33, 65)), InputSpec("x1", (65, 31))), ("v0 = x0 @ x1",), ("v0",),
             dtype="torch.float64"), "generated"),
    (Program((InputSpec("x0", (3, 9001)),), ("v0 = torch.softmax(x0 * 8, -1)",), ("v0",), dtype="torch.float64"),
     "auto"),
]


@pytest.mark.parametrize("target", ["cpu", "interpret"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_numeric_programs_match_eager(target, case):
    program, matmul = CASES[case]
    with tilefuse.config.patch(target=target, matmul=matmul):
        outcome = fuzz.check_program(program)
    assert outcome.status == "ok", (outcome, program.function_source())


def test_bounded_run_of_numeric_programs():
    """Generated programs with float64, round trips or autocast regions, products through the
    library matmul (on the C++ backend)."""
    programs = [p for p in (fuzz.case_program(3, k, 4) for k in range(60)) if _numeric(p)][:10]
    assert len(programs) == 10
    with tilefuse.config.patch(target="cpu", matmul="aten"):
        outcomes = [fuzz.check_program(p) for p in programs]
    bad = [(o, p.function_source(), p.dtype) for o, p in zip(outcomes, programs) if o.failed]
    assert not bad, bad
