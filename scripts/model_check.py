"""The model sweeps' oracle: a compiled model's output and, for a training step, its parameters'
gradients against the same model in fp64 (or fp32 where an op has no fp64 kernel), each beside
eager fp32's own error; and the loop that tries every model and prints one line each."""
import time

import torch


def compare(model, ref, dtype, compiled, train, inputs, first=lambda out: out, stats=None):
    """(ok, message) for one call: the output within a few times eager's error of the reference;
    in training, every parameter's gradient of mean(out²) within 1e-4 of the largest reference
    gradient (or a few times eager's own error, where batch statistics over few values make
    the model ill-conditioned), and none missing. `stats` (a dict), if given, receives the
    worst gradient errors: "worst" (compiled) and "eager_worst"."""
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    ref_inputs = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    with torch.set_grad_enabled(train):
        out = first(compiled(**inputs))
        expected = first(ref(**ref_inputs))
    err = (out.double() - expected).abs().max().item()
    if train:
        out.double().square().mean().backward()
        expected.square().mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(train):
        eager = first(model(**inputs))
    eager_err = (eager.double() - expected).abs().max().item()
    msg = f"out err {err:.2e} (eager {eager_err:.2e})"
    ok = err <= max(4 * eager_err, 1e-5)
    if train:
        eager.double().square().mean().backward()
        scale = max((_finite(q.grad).abs().max().item() for q in ref.parameters()
                     if q.grad is not None and _finite(q.grad).numel()), default=1.0)
        worst, worst_name, eager_worst, unusable = 0.0, None, 0.0, 0
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if grads[n] is None and q.grad is None:
                continue
            if grads[n] is None or q.grad is None:
                ok = False
                msg += f"; no gradient for {n}"
                continue
            expected_grad = q.grad.double()
            lost = ~torch.isfinite(expected_grad)
            if lost.any() and p.grad is not None:  # the reference's own overflow: eager fp32 stands in there
                expected_grad = torch.where(lost, p.grad.double(), expected_grad)
                unusable += 1
            d = (grads[n].double() - expected_grad).abs().max().item() / scale
            if p.grad is not None:
                eager_worst = max(eager_worst, (p.grad.double() - expected_grad).abs().max().item() / scale)
            if worst == worst and not d <= worst:  # (a NaN is the worst, and stays so)
                worst, worst_name = d, n
        msg += f"; worst gradient error {worst:.2e} of the largest ({worst_name}; eager {eager_worst:.2e})"
        if unusable:
            msg += f"; the reference's gradient was not finite in {unusable} parameter(s): eager's there"
        ok = ok and worst < max(1e-4, 4 * eager_worst)  # (False for a NaN)
        if stats is not None:
            stats.update(worst=worst, eager_worst=eager_worst)
    return ok, msg


def _finite(t):
    return t[torch.isfinite(t)] if not torch.isfinite(t).all() else t


def sweep(names, modes, run):
    """`run(name, train) -> (ok, message)` for each model and mode: one line each, OK, BAD (far
    from the reference) or FAIL (raised, with the error)."""
    for name in names:
        for mode in modes:
            t = time.perf_counter()
            try:
                ok, msg = run(name, mode == "train")
                status = "OK  " if ok else "BAD "
            except Exception as err:  # noqa: BLE001 - every model is tried and reported
                status, msg = "FAIL", f"{type(err).__name__}: {str(err)[:300]}"
            print(f"{status} {name:10s} {mode:5s} {time.perf_counter() - t:5.1f}s {msg}", flush=True)
