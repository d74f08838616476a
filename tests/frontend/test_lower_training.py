"""Training steps end to end through the frontend: forward and backward graphs of an MLP and
of a Llama-style block are lowered without Extern nodes (except the embedding gradient's
scatter-add) and give eager's loss and gradients."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lowering_harness import check_training, rand


class MLP(nn.Module):
    def __init__(self, d_in=13, d=33, n_out=7):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d_in, d), nn.Linear(d, d), nn.Linear(d, n_out)
        self.ln = nn.LayerNorm(d)

    def forward(self, x, target):
        h = F.gelu(self.l1(x))
        h = self.ln(h)
        h = torch.tanh(self.l2(h)) + F.silu(h) + torch.sigmoid(h) * F.relu(h) + F.gelu(h, approximate="tanh")
        h = F.leaky_relu(h) + F.hardtanh(h) + F.elu(h) + F.softplus(h)
        return F.cross_entropy(self.l3(h), target) + h.var() * 0.01


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


class LlamaBlock(nn.Module):
    def __init__(self, vocab=37, d=32, heads=4, hidden=48):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    @staticmethod
    def rope(x):
        t, hd = x.shape[-2], x.shape[-1]
        freqs = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.arange(t, dtype=torch.float32)[:, None] * freqs[None, :]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        q, k = self.rope(q), self.rope(k)
        att = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(y)
        h = self.n2(x)
        x = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def test_mlp_training_step():
    x, target = rand(5, 13), torch.randint(0, 7, (5,))
    check_training(MLP, x, target)


def test_mlp_training_step_dynamic():
    x, target = rand(6, 13), torch.randint(0, 7, (6,))
    rec = check_training(MLP, x, target, dynamic=True)
    assert any(not d.is_number for g in rec.graphs for n in g.nodes.values() for d in n.shape)


def test_llama_block_training_step():
    tokens = torch.randint(0, 37, (2, 9))
    targets = torch.randint(0, 37, (2, 9))
    # the embedding gradient is a scatter-add (index_put with accumulate): an extern on purpose
    check_training(LlamaBlock, tokens, targets, allow_extern=("index_put",))


@pytest.mark.parametrize("model", ["mlp"])
def test_bf16_training_step(model):
    x, target = rand(5, 13, dtype=torch.bfloat16), torch.randint(0, 7, (5,))
    check_training(lambda: MLP().to(torch.bfloat16), x, target, factor=4.0)
