"""Shared by the torch rank programs: tiny models, sharded data, references.

Every rank builds the whole global batch from a fixed seed, so it can
compute the single-process reference gradient of the concatenated batch
itself and compare it with what the distributed run produced.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

# float32 gradients: the distributed sum and the single-process sum add the
# same numbers in a different order, so they agree to rounding only.
RTOL, ATOL = 1e-5, 1e-6


def mlp(seed: int = 0, din: int = 6, hidden: int = 8, dout: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(din, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, dout))


def batch(step: int, size: int, per_rank: int = 4, din: int = 6,
          classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size * per_rank, din, generator=g)
    y = torch.randint(0, classes, (size * per_rank,), generator=g)
    return x, y


def shard(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[0] // size
    return t[rank * n: (rank + 1) * n]


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def reference_grads(model: torch.nn.Module, size: int,
                    local_loss: Callable[[torch.nn.Module, int], torch.Tensor]
                    ) -> list[torch.Tensor | None]:
    """Gradient of the mean of every rank's loss, computed in this process."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    total = sum(local_loss(ref, r) for r in range(size)) / size
    assert isinstance(total, torch.Tensor)
    total.backward()
    return [None if p.grad is None else p.grad.clone() for p in ref.parameters()]


def assert_close(got: torch.Tensor | None, want: torch.Tensor | None, what: str,
                 rtol: float = RTOL, atol: float = ATOL) -> None:
    assert (got is None) == (want is None), f"{what}: got {got}, want {want}"
    if got is not None and want is not None:
        assert torch.allclose(got, want, rtol=rtol, atol=atol), (
            f"{what}: max error {(got - want).abs().max().item():.3g}\n{got}\n{want}")


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_same_on_all_ranks(model: torch.nn.Module, gather: Callable[[torch.Tensor],
                             torch.Tensor], what: str) -> None:
    """Bitwise equality of the parameters across ranks."""
    rows = gather(flat(model)[None])
    for r in range(1, rows.shape[0]):
        assert torch.equal(rows[0], rows[r]), f"{what}: rank {r} differs from rank 0"


class BagOfTokens(torch.nn.Module):
    """Mean of token embeddings under a head; `sparse=True`: sparse gradients."""

    def __init__(self, seed: int, sparse: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(6 + 4 * 8, 4, sparse=sparse)  # `token_loss` up to 8 ranks
        self.head = torch.nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(dim=1))


def token_loss(step: int, rank: int) -> Callable[[torch.nn.Module], torch.Tensor]:
    """Rank `rank`'s loss at `step`; its batch also uses tokens of its own range, so
    ranks touch different embedding rows."""
    def loss(model: torch.nn.Module) -> torch.Tensor:
        g = torch.Generator().manual_seed(2000 + 31 * step + rank)
        tokens = torch.cat([torch.randint(0, 6, (3, 2), generator=g),
                            torch.randint(6 + 4 * rank, 10 + 4 * rank, (3, 2), generator=g)], 1)
        y = torch.randint(0, 3, (3,), generator=g)
        return torch.nn.functional.cross_entropy(model(tokens), y)

    return loss


def hooked(model: torch.nn.Module) -> list[str]:
    """Names of `model`'s parameters that still carry gradient hooks."""
    return [n for n, p in model.named_parameters()
            if p._post_accumulate_grad_hooks or p._backward_hooks]
