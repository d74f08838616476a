"""In-place updates of inputs stay in the compiled graph: a scatter into an input nothing
else reads is written in place (a KV-cache update touches only the new rows), any other write
is a `copy_` that runs after every read of the old value, and verify mode checks such graphs
without applying their writes twice."""
import pytest
import torch

import tilefuse


def _kv_update(k, v, pos, k_cache, v_cache):
    k_cache.index_copy_(2, pos, k * 2)
    v_cache.index_copy_(2, pos, v)
    return k_cache.sum(-1)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 3, 2, 8, generator=g), torch.randn(2, 3, 2, 8, generator=g)
    pos = torch.tensor([5, 1])
    caches = torch.randn(2, 3, 11, 8, generator=g), torch.randn(2, 3, 11, 8, generator=g)
    return k, v, pos, *caches


def test_a_cache_update_is_an_in_place_scatter():
    args = _inputs()
    expected_args = [t.clone() for t in args]
    expected = _kv_update(*expected_args)
    k_ptr = args[3].data_ptr()
    torch._dynamo.reset()
    out = torch.compile(_kv_update, backend="tilefuse", fullgraph=True)(*args)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(args[3], expected_args[3])
    assert torch.equal(args[4], expected_args[4])
    assert args[3].data_ptr() == k_ptr
    torch._dynamo.reset()
    rep = tilefuse.explain(_kv_update, *_inputs())
    # both caches are written in place by generated kernels (k_cache's new value is then read
    # by the sum, which runs after the write)
    assert not rep.externs, str(rep)
    assert sum("in-place indexed write" in d for r in rep.reports for d in r.decisions) == 2


def test_an_input_written_and_read_keeps_the_old_value_for_its_readers():
    def fn(x, y):
        old = x * 3  # reads x before the write
        x.add_(y)
        return old + x  # and after it: the new value

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g)
    xe = x.clone()
    expected = fn(xe, y)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse", fullgraph=True)(x, y)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x, xe)


@pytest.mark.parametrize("fallback", ["error", "eager"])
def test_verify_mode_applies_a_write_once(fallback):
    def fn(x):
        x.mul_(2)
        return x + 1

    x = torch.randn(9)
    x0 = x.clone()
    torch._dynamo.reset()
    with tilefuse.config.patch(verify=True, fallback=fallback):
        out = torch.compile(fn, backend="tilefuse", fullgraph=True)(x)
    torch.testing.assert_close(x, x0 * 2)
    torch.testing.assert_close(out, x0 * 2 + 1)
