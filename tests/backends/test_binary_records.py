"""Binary records (`backends.triton.binaries`): a kernel's first launch in a new process finds
the binary an earlier process compiled without Triton's JIT (whose first compile in a process
hashes Triton's own files). Checked with stand-ins for the JIT and, for the record's round
trip, with Triton's own `CompiledKernel` over a fabricated cache group (CI has no GPU;
`test_binary_records_gpu.py` launches real kernels)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tilefuse.backends.triton import binaries
from tilefuse.backends.triton.direct_launch import DirectLaunch, recorded_specialisation
from tilefuse.cache.disk import DiskCache


class FakeCompiled:
    def __init__(self, log, tag):
        self.log, self.tag = log, tag

    def __getitem__(self, grid):  # (Triton loads the binary's handles here)
        if self.tag == "broken":
            raise RuntimeError("no such binary")

        def runner(*args):
            if self.tag == "failing":
                self.log.append(("failing", grid, args))
                raise RuntimeError("the launch itself failed")
            self.log.append((self.tag, grid, args))
        return runner


class FakeJIT:
    arg_names = ["x_ptr", "n", "XBLOCK"]
    __name__ = "kernel"

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **options):
            self.log.append(("jit", grid, args, options))
            return FakeCompiled(self.log, "compiled")
        return run


class FakeRecords:
    def __init__(self, found=None):
        self.found, self.kept, self.asked, self.forgotten = found, [], [], []

    def find(self, key):
        self.asked.append(key)
        return self.found

    def keep(self, key, compiled, options):
        self.kept.append((key, compiled, dict(options)))

    def forget(self, key, why):
        self.forgotten.append(key)


def test_a_miss_launches_through_the_jit_and_records_the_binary():
    fn, records = FakeJIT(), FakeRecords()
    launch = DirectLaunch(fn, {"XBLOCK": 64, "num_warps": 4}, {"XBLOCK": 64}, records=records)
    x = torch.randn(37)
    compiled = launch((2,), [x, 37], key=("sizes", 1))
    assert [e[0] for e in fn.log] == ["jit"]
    recorded = recorded_specialisation([x, 37])
    assert records.asked == [recorded]
    assert records.kept == [(recorded, compiled, {"XBLOCK": 64, "num_warps": 4})]
    launch((2,), [x, 37], key=("sizes", 1))  # kept in the process: no second lookup or record
    assert records.asked == [recorded] and len(records.kept) == 1


def test_new_sizes_that_triton_compiles_alike_reuse_the_binary_in_the_process():
    """A dynamic size's next value (a new caller key, the same specialisation) launches the
    binary this process already has: no second lookup, record or JIT compile."""
    fn, records = FakeJIT(), FakeRecords()
    launch = DirectLaunch(fn, {"XBLOCK": 64}, {"XBLOCK": 64}, records=records)
    x = torch.randn(64)
    launch((1,), [x, 37], key=("n", 37))
    launch((1,), [x, 53], key=("n", 53))
    assert [e[0] for e in fn.log] == ["jit", "compiled"]
    assert len(records.asked) == 1 and len(records.kept) == 1
    launch((1,), [x, 48], key=("n", 48))  # a multiple of 16: Triton's other binary
    assert [e[0] for e in fn.log] == ["jit", "compiled", "jit"] and len(records.asked) == 2


def test_records_are_kept_by_what_triton_specialises_on_and_the_dtypes():
    """Sizes that Triton compiles alike share a record; another specialisation or dtype does not."""
    x = torch.randn(64)
    # (37 and 53: neither 1 nor a multiple of 16)
    assert recorded_specialisation([x, 37]) == recorded_specialisation([torch.randn(80), 53])
    assert recorded_specialisation([x, 37]) != recorded_specialisation([x, 48])
    assert recorded_specialisation([x, 37]) != recorded_specialisation([x, 1])
    assert recorded_specialisation([x, 37]) != recorded_specialisation([x[1:], 37])  # off the 16-byte alignment
    assert recorded_specialisation([x, 37]) != recorded_specialisation([x.double(), 37])


def test_a_recorded_binary_launches_without_the_jit_and_with_its_options():
    fn = FakeJIT()
    recorded = FakeCompiled(fn.log, "recorded")
    records = FakeRecords(found=(recorded, {"XBLOCK": 64, "num_warps": 4, "num_stages": 2}))
    launch = DirectLaunch(fn, {"XBLOCK": 64, "num_warps": 4, "num_stages": 3}, {"XBLOCK": 64}, records=records)
    x = torch.randn(37)
    assert launch((5,), [x, 37], key="k") is recorded
    assert fn.log == [("recorded", (5, 1, 1), (x, 37, 64))]  # the constexpr after the arguments
    assert records.kept == []
    assert launch.options["num_stages"] == 2  # (the recording process retried with fewer stages)
    launch((5,), [x, 37], key="k")
    assert [e[0] for e in fn.log] == ["recorded", "recorded"]


def test_a_record_whose_binary_does_not_load_falls_back_to_the_jit():
    fn = FakeJIT()
    records = FakeRecords(found=(FakeCompiled(fn.log, "broken"), {"XBLOCK": 64}))
    launch = DirectLaunch(fn, {"XBLOCK": 64}, {"XBLOCK": 64}, records=records)
    args = [torch.randn(8), 8]
    launch((1,), args, key="k")
    assert [e[0] for e in fn.log] == ["jit"]
    assert records.forgotten == [recorded_specialisation(args)]  # the stale record is dropped ...
    assert len(records.kept) == 1  # ... and recorded again, pointing at the binary the JIT found


def test_an_error_of_the_recorded_launch_itself_is_raised_not_run_again():
    """Once a recorded binary launched, the kernel may have run (an accumulating kernel would
    add twice): its error is the caller's, not a reason to launch through the JIT."""
    fn = FakeJIT()
    records = FakeRecords(found=(FakeCompiled(fn.log, "failing"), {"XBLOCK": 64}))
    launch = DirectLaunch(fn, {"XBLOCK": 64}, {"XBLOCK": 64}, records=records)
    with pytest.raises(RuntimeError, match="the launch itself"):
        launch((1,), [torch.randn(8), 8], key="k")
    assert [e[0] for e in fn.log] == ["failing"]


def test_measured_candidates_make_no_records():
    """The tuner's candidate kernels are mostly never launched again: no record for them."""
    from tilefuse.backends.triton.launcher import TritonKernel

    kernel = TritonKernel.__new__(TritonKernel)
    kernel._direct = DirectLaunch(FakeJIT(), {}, {}, records=FakeRecords())
    assert kernel.measured_as_is()._direct.records is None


def _cache_group(tmp_path, name="kern"):
    """A Triton cache group as Triton writes one: the metadata JSON and the binary."""
    folder = tmp_path / "triton" / "0123abcd"
    folder.mkdir(parents=True)
    meta = {"name": name, "target": {"backend": "cuda", "arch": 90, "warp_size": 32}, "num_warps": 4,
            "num_ctas": 1, "shared": 0, "num_stages": 3}
    (folder / f"{name}.json").write_text(json.dumps(meta))
    (folder / f"{name}.cubin").write_bytes(os.urandom(64))
    (folder / f"{name}.ptx").write_text("// an intermediate IR: kept, not run")
    for path in folder.iterdir():
        path.chmod(0o644)  # (as Triton leaves them: writable by this user only)
    return {f"{name}.json": str(folder / f"{name}.json"), f"{name}.cubin": str(folder / f"{name}.cubin"),
            f"{name}.ptx": str(folder / f"{name}.ptx")}


def _jit_function(tmp_path):
    """A real `triton.jit` function (Triton reads its source from a file)."""
    import importlib.util

    path = tmp_path / "kern_module.py"
    path.write_text("import triton\nimport triton.language as tl\n\n@triton.jit\n"
                    "def kern(x_ptr, n, XBLOCK: tl.constexpr):\n    pass\n")
    spec = importlib.util.spec_from_file_location("kern_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kern


class Recorded:
    """What the JIT returns, as far as a record reads it."""

    def __init__(self, fn, group, constants, attrs=None):
        from triton.compiler.compiler import ASTSource

        self.src = ASTSource(fn, {"x_ptr": "*fp32", "n": "i32", "XBLOCK": "constexpr"}, constants, attrs or {})
        self.metadata_group, self.hash = group, "0123abcd"


def _target_of(group):
    from triton.backends.compiler import GPUTarget

    meta = json.loads(open(group["kern.json"]).read())["target"]
    return GPUTarget(meta["backend"], meta["arch"], meta["warp_size"])


def _target(target):
    """This process's device target, as `find` asks Triton's driver for it (CI has no GPU)."""
    from unittest import mock

    return mock.patch.object(binaries, "_current_target", lambda: target)


def _compiled_kernel_or_skip(fn, group):
    try:
        from triton.compiler.compiler import ASTSource, CompiledKernel

        return CompiledKernel(ASTSource(fn, {"x_ptr": "*fp32"}, {}, {}), group, "h")
    except (ImportError, KeyError, TypeError, AttributeError) as err:  # another Triton's metadata
        pytest.skip(f"this Triton's CompiledKernel wants other metadata: {type(err).__name__}: {err}")


def test_a_record_round_trips_to_the_same_compiled_kernel(tmp_path):
    pytest.importorskip("triton")
    fn = _jit_function(tmp_path)
    group = _cache_group(tmp_path)
    _compiled_kernel_or_skip(fn, group)
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    data = binaries.encode(Recorded(fn, group, {(2,): 64}, attrs))
    assert data is not None
    compiled = binaries.decode(data, fn)
    assert compiled.src.constants == {(2,): 64}
    assert compiled.src.attrs == attrs
    assert compiled.src.signature == {"x_ptr": "*fp32", "n": "i32", "XBLOCK": "constexpr"}
    assert compiled.hash == "0123abcd" and compiled.name == "kern"
    assert compiled.kernel == open(group["kern.cubin"], "rb").read()


def test_records_refuse_what_they_cannot_read_back(tmp_path):
    pytest.importorskip("triton")
    fn = _jit_function(tmp_path)
    group = _cache_group(tmp_path)
    assert binaries.encode(Recorded(fn, group, {(2,): object()})) is None  # not plain data
    assert binaries.encode(object()) is None  # another Triton's layout
    data = binaries.encode(Recorded(fn, group, {(2,): 64}))
    os.remove(group["kern.cubin"])  # a cleared Triton cache
    assert binaries.decode(data, fn) is None
    assert binaries.decode(json.dumps({"format": binaries.FORMAT + 1}).encode(), fn) is None


def test_a_stale_record_is_discarded_and_written_again(tmp_path):
    """A record whose files are gone (a cleared Triton cache) or changed is discarded by the
    lookup, so that the JIT's launch records the binary it found instead."""
    pytest.importorskip("triton")
    fn = _jit_function(tmp_path)
    group = _cache_group(tmp_path)
    _compiled_kernel_or_skip(fn, group)
    root = str(tmp_path / "cache")
    records = binaries.BinaryRecords(fn, "source", {"num_warps": 4}, root)
    target = _target_of(group)
    with _target(target):
        records.keep("k", Recorded(fn, group, {(2,): 64}), {"num_warps": 4})
        assert records.find("k") is not None
        with open(group["kern.cubin"], "ab") as f:  # changed after it was recorded
            f.write(b"\0")
        assert records.find("k") is None
        assert records.cache.get(binaries.record_key("source", {"num_warps": 4}, "k")) is None  # discarded
        records.keep("k", Recorded(fn, group, {(2,): 64}), {"num_warps": 4})  # the JIT's launch records again
        assert records.find("k") is not None
        os.remove(group["kern.cubin"])  # a cleared Triton cache
        assert records.find("k") is None


def test_only_the_binary_and_its_metadata_are_hashed(tmp_path):
    """The intermediate IRs are never run: not hashed (a record reads only what a launch uses),
    but a record whose IR file is gone is not used either (Triton's kernel reads it)."""
    pytest.importorskip("triton")
    fn = _jit_function(tmp_path)
    group = _cache_group(tmp_path)
    _compiled_kernel_or_skip(fn, group)
    record = json.loads(binaries.encode(Recorded(fn, group, {(2,): 64})))
    assert sorted(record["sha256"]) == ["kern.cubin", "kern.json"]
    with open(group["kern.ptx"], "a") as f:
        f.write("// edited")
    assert binaries.decode(json.dumps(record).encode(), fn) is not None
    os.remove(group["kern.ptx"])
    assert binaries.decode(json.dumps(record).encode(), fn) is None


def test_a_binary_for_another_target_or_launch_is_not_used(tmp_path):
    pytest.importorskip("triton")
    fn = _jit_function(tmp_path)
    group = _cache_group(tmp_path)
    _compiled_kernel_or_skip(fn, group)
    data = binaries.encode(Recorded(fn, group, {(2,): 64}))
    target = _target_of(group)
    assert binaries.decode(data, fn, {"num_warps": 4, "num_stages": 3}, target) is not None
    assert binaries.decode(data, fn, {"num_warps": 8}, target) is None
    assert binaries.decode(data, fn, {"num_stages": 2}, target) is None
    from triton.backends.compiler import GPUTarget

    assert binaries.decode(data, fn, {}, GPUTarget("cuda", 80, 32)) is None


def test_triton_knobs_that_change_the_build_turn_records_off(monkeypatch):
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        pytest.skip("a Triton without knobs")
    assert binaries.knobs_in_the_way() is None
    monkeypatch.setattr(knobs.runtime, "debug", True)
    assert binaries.knobs_in_the_way() == "triton.knobs.runtime.debug"


def test_the_rebuilt_triton_check_reads_the_shared_library():
    pytest.importorskip("triton")
    found = binaries._triton_library()
    if found is not None:
        name, size, _ = found
        assert name.endswith((".so", ".pyd", ".dylib")) and size > 1 << 20  # (not a folder's size)


def test_records_are_kept_per_source_options_and_launch(tmp_path):
    pytest.importorskip("triton")
    fn = _jit_function(tmp_path)
    group = _cache_group(tmp_path)
    _compiled_kernel_or_skip(fn, group)
    root = str(tmp_path / "cache")
    first = binaries.BinaryRecords(fn, "source-a", {"XBLOCK": 64, "num_warps": 4}, root)
    first.keep(("sizes", (True,)), Recorded(fn, group, {(2,): 64}), {"XBLOCK": 64, "num_warps": 4, "num_stages": 3})
    again = binaries.BinaryRecords(fn, "source-a", {"XBLOCK": 64, "num_warps": 4}, root)  # a new process
    with _target(_target_of(group)):
        compiled, options = again.find(("sizes", (True,)))
    assert compiled.src.constants == {(2,): 64} and options["num_stages"] == 3
    assert again.find(("sizes", (False,))) is None  # another specialisation
    assert binaries.BinaryRecords(fn, "source-b", {"XBLOCK": 64, "num_warps": 4}, root).find(("sizes", (True,))) is None
    assert binaries.BinaryRecords(fn, "source-a", {"XBLOCK": 64, "num_warps": 8}, root).find(("sizes", (True,))) is None
    assert isinstance(binaries.binary_cache(root), DiskCache)


def test_a_record_that_fails_to_load_is_ignored(tmp_path):
    pytest.importorskip("triton")
    fn = _jit_function(tmp_path)
    root = str(tmp_path / "cache")
    records = binaries.BinaryRecords(fn, "source", {}, root)
    records.cache.put(binaries.record_key("source", {}, "k"), {"record.json": b"{not json", "options.json": b"{}"})
    assert records.find("k") is None
