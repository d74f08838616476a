"""The benchmark's `models` group on CPU at test sizes: every model runs through tilefuse with
no eager fallback (`fallback="error"` in the benchmark) and agrees with the float64 reference
as well as eager does; a library that is missing (transformers) makes its models n/a with the
reason, never a crash. These runs are also the CPU correctness tests of the zoo."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tilefuse.bench import main
from tilefuse.bench.runner import BenchOptions, run, workload_size
from tilefuse.bench.workloads import WORKLOADS, get_workloads

FAST = dict(device="cpu", sizes="quick", dtype="float32", budget_s=0.02, quiet=True,
            sweep=False, memory=False, layers=1,
            ceilings={"copy_gbps": 10.0, "matmul_tflops": 0.1, "how": "fixed for tests"})
MODELS = [w.name for w in get_workloads() if w.group == "models"]
HF = [name for name in MODELS if name.startswith("hf_")]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def test_group_selects_the_models_and_layers_override_their_depth():
    opts = BenchOptions(group="models", **FAST).resolved()
    assert opts.group == "models"
    assert {"nanogpt", "nanogpt_train", "gptfast_prefill", "gptfast_decode", "hf_llama",
            "hf_gemma2", "hf_gpt2", "hf_bert", "hf_t5", "hf_vit", "resnet50"} <= set(MODELS)
    assert workload_size(WORKLOADS["nanogpt"], opts)[2] == 1
    assert workload_size(WORKLOADS["resnet50"], opts) == list(WORKLOADS["resnet50"].sizes["quick"])
    with pytest.raises(ValueError, match="group"):
        BenchOptions(group="nope", **FAST).resolved()


#: models whose steps draw random numbers: eager, the reference and tilefuse draw different masks
#: (BERT trains with its configuration's dropout 0.1)
STOCHASTIC = {"nanogpt_train_dropout", "hf_bert_train"}


@pytest.mark.parametrize("name", [m for m in MODELS if m not in HF and m not in STOCHASTIC])
def test_model_through_tilefuse_matches_the_reference(name):
    report = run(BenchOptions(workloads=[name], backends=["eager", "tilefuse"], **FAST))
    eager, ours = report["results"]
    assert eager["status"] == "ok", eager["reason"]
    assert ours["status"] == "ok", (ours["reason"], ours["detail"])  # no eager fallback either
    assert ours["correct"] is True, (ours["max_abs_err"], ours["eager_max_abs_err"])
    assert math.isfinite(ours["max_abs_err"]) and ours["eager_max_abs_err"] < 1e-3
    assert ours["throughput"] > 0 and ours["throughput_unit"] in ("tokens/s", "images/s")
    assert ours["kernels"] is not None and ours["kernels"] > 0


def test_training_with_dropout_runs_through_tilefuse():
    """nanoGPT with dropout 0.1 trains through tilefuse with no fallback; its masks differ from
    eager's, so the loss is only as close as two draws are (the exact check of the masks and
    gradients is tests/frontend/test_attention_chains.py and test_random.py)."""
    report = run(BenchOptions(workloads=["nanogpt_train_dropout"], backends=["eager", "tilefuse"], **FAST))
    eager, ours = report["results"]
    assert eager["status"] == "ok" and ours["status"] == "ok", (ours["reason"], ours["detail"])
    assert math.isfinite(ours["max_abs_err"]) and ours["max_abs_err"] < 0.5
    assert ours["kernels"] > 0


@pytest.mark.skipif(HAS_TRANSFORMERS, reason="checks the report without transformers")
def test_hugging_face_models_are_na_with_the_reason_without_transformers():
    report = run(BenchOptions(workloads=HF[:2], backends=["eager", "tilefuse"], **FAST))
    for r in report["results"]:
        assert r["status"] == "n/a" and "transformers" in r["reason"]


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("name", HF)
def test_hugging_face_model_through_tilefuse(name):
    report = run(BenchOptions(workloads=[name], backends=["eager", "tilefuse"], **FAST))
    ours = report["results"][1]
    assert ours["status"] == "ok", ours
    if name in STOCHASTIC:  # (only as close as two draws of the dropout masks are)
        assert math.isfinite(ours["max_abs_err"]) and ours["max_abs_err"] < 0.5, ours
    else:
        assert ours["correct"] is True, ours


def test_training_step_repeats_the_same_loss_and_updates_nothing():
    """lr 0: every step computes the same loss and gradients, so steps can be timed and compared."""
    w = WORKLOADS["nanogpt_train"]
    torch.manual_seed(0)
    inputs = w.make_inputs(tuple(w.sizes["quick"]), torch.device("cpu"), torch.float32)
    before = [p.detach().clone() for p in inputs[0].parameters()]
    step = w.program(w.fn)
    first, second = step(*inputs), step(*inputs)
    assert torch.equal(first, second) and first[0] > 0 and all(first > 0)
    assert all(torch.equal(a, p) for a, p in zip(before, inputs[0].parameters()))


def test_cli_models_group(capsys):
    code = main(["--group", "models", "--workloads", "nanogpt", "--layers", "1", "--backends",
                 "eager", "--device", "cpu", "--no-sweep", "--no-memory", "--quiet",
                 "--budget", "0.02"])
    assert code == 0
    out = capsys.readouterr().out
    assert "nanogpt" in out and "tokens/s" in out
