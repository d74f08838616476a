"""A small Llama-style transformer block: forward and one training step match eager."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import tilefuse  # noqa: F401  (registers the backend)

DEVICE = os.environ.get("TILEFUSE_TEST_DEVICE", "cpu")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(nn.Module):
    def __init__(self, dim=32, heads=4, hidden=48):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), nn.Linear(dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), 1)
        attn = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _inputs(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(2, 7, 32, device=DEVICE)
    pos = torch.arange(7, device=DEVICE)[:, None] / (10000 ** (torch.arange(4, device=DEVICE) / 4))
    ang = torch.cat([pos, pos], -1)
    return x, ang.cos(), ang.sin()


def test_block_forward_matches_eager():
    torch.manual_seed(1)
    block = Block().to(DEVICE)
    x, cos, sin = _inputs()
    ref = block.double()(x.double(), cos.double(), sin.double())
    block = block.float()
    eager = block(x, cos, sin)
    out = torch.compile(block, backend="tilefuse")(x, cos, sin)
    assert (out.double() - ref).abs().max() <= 2 * (eager.double() - ref).abs().max() + 1e-5


def test_block_training_step_matches_eager():
    torch.manual_seed(2)
    block = Block().to(DEVICE)
    compiled_block = Block().to(DEVICE)
    compiled_block.load_state_dict(block.state_dict())
    x, cos, sin = _inputs(3)
    target = torch.randn_like(x)

    def step(model, fn):
        loss = F.mse_loss(fn(x, cos, sin), target)
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    loss_e, grads_e = step(block, block)
    loss_c, grads_c = step(compiled_block, torch.compile(compiled_block, backend="tilefuse"))
    torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-4)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], atol=1e-4, rtol=1e-3, msg=name)
