"""A Horovod PyTorch training script, unchanged except for the import line.

Written the way Horovod's examples are (pytorch_mnist.py): DistributedSampler,
lr scaled by size, broadcast_parameters/broadcast_optimizer_state,
DistributedOptimizer with compression and op, metric averaging with
hvd.allreduce, plus the gradient-clipping pattern (synchronize +
skip_synchronize), an LR scheduler, async handles, allgather, broadcast,
broadcast_object and join. `--horovod` runs the same script on real Horovod.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812
import torch.optim as optim
import torch.utils.data.distributed
from _common import report

if "--horovod" in sys.argv:
    import os

    os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")  # Horovod's start_timeline needs it
    import horovod.torch as hvd
else:
    import asynclock.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic example")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--horovod", action="store_true", default=False)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=3)
        self.fc1 = nn.Linear(4 * 6 * 6, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 1))
        x = x.view(-1, 4 * 6 * 6)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """Four classes, each a bright quadrant on an 8x8 image, plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g) * 0.5
    for i, c in enumerate(y.tolist()):
        r, q = divmod(c, 2)
        x[i, 0, 4 * r: 4 * r + 4, 4 * q: 4 * q + 4] += 2.0
    return torch.utils.data.TensorDataset(x, y)


def metric_average(val: float, name: str) -> float:
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return float(avg_tensor.item())


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = synthetic(256, 1)
    test_dataset = synthetic(128, 2)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=64, sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    def train(epoch: int) -> None:
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            if batch_idx % 2:
                optimizer.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        scheduler.step()

    def test() -> tuple[float, float]:
        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.data.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.data.view_as(pred)).float().sum().item()
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        return metric_average(test_loss, "avg_loss"), metric_average(test_accuracy, "avg_accuracy")

    first_loss, _ = test()
    for epoch in range(1, args.epochs + 1):
        train(epoch)
    test_loss, test_accuracy = test()
    if hvd.rank() == 0:
        print(f"Test set: Average loss: {test_loss:.4f} (from {first_loss:.4f}), "
              f"Accuracy: {100.0 * test_accuracy:.1f}%", flush=True)
    assert test_loss < 0.5 * first_loss and test_accuracy > 0.9, (test_loss, test_accuracy)
    report(hvd.rank(), "trained", f"acc={test_accuracy:.3f}")

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvd.allgather(flat[None])
    assert all(torch.equal(rows[0], rows[r]) for r in range(hvd.size())), "ranks diverged"
    report(hvd.rank(), "identical")

    check_collectives()
    last = hvd.join()
    assert 0 <= last < hvd.size()
    report(hvd.rank(), "done")
    hvd.shutdown()


def check_collectives() -> None:
    rank, size = hvd.rank(), hvd.size()
    handle = hvd.allreduce_async(torch.full((5,), float(rank)), name="async", op=hvd.Sum)
    summed = hvd.synchronize(handle)
    assert torch.equal(summed, torch.full((5,), float(size * (size - 1) // 2))), summed
    avg = hvd.allreduce(torch.tensor([float(rank)]), name="avg")
    assert abs(avg.item() - (size - 1) / 2) < 1e-6, avg
    inplace = torch.ones(3)
    hvd.allreduce_(inplace, op=hvd.Sum, name="inplace")
    assert torch.equal(inplace, torch.full((3,), float(size)))
    gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="ragged")
    assert gathered.shape == (size * (size + 1) // 2, 2), gathered.shape
    root = hvd.broadcast(torch.arange(4.0) * (rank + 1), root_rank=0, name="bcast")
    assert torch.equal(root, torch.arange(4.0)), root
    obj = hvd.broadcast_object({"from": rank}, root_rank=0)
    assert obj == {"from": 0}, obj
    check_grouped(rank, size)
    check_extras(rank, size)
    report(rank, "collectives")


def check_extras(rank: int, size: int) -> None:
    """sparse_allreduce_async, the timeline switch, the error class, the build probes."""
    import os
    import tempfile

    sparse = torch.sparse_coo_tensor([[rank, size]], [float(rank + 1), 1.0], (size + 1,))
    got = hvd.sparse_allreduce_async(sparse, "sparse", hvd.Sum)()  # Horovod: a function
    want = torch.tensor([float(r + 1) for r in range(size)] + [float(size)])
    assert torch.equal(got.to_dense(), want), got
    avg = hvd.sparse_allreduce_async(sparse, "sparse.avg", hvd.Average)()
    assert torch.allclose(avg.to_dense(), want / size), avg
    assert issubclass(hvd.HorovodInternalError, Exception) and hvd.ccl_built() is False
    folder = hvd.broadcast_object(tempfile.mkdtemp() if rank == 0 else None, root_rank=0,
                                  name="folder")  # Horovod names it by type otherwise
    path = os.path.join(folder, "timeline.json")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(2), name="timed")
    hvd.stop_timeline()
    if rank == 0:
        assert os.path.getsize(path) > 0, path
        if "--horovod" not in sys.argv:  # ours: one merged Chrome trace, every rank in it
            import json

            with open(path) as trace:
                events = json.load(trace)["traceEvents"]
            timed = {e.get("pid") for e in events if "timed" in str(e.get("args", ""))}
            assert len(timed) == size, (timed, events[:5])


def check_grouped(rank: int, size: int) -> None:
    """Grouped and async variants, as Horovod 0.28 defines them (`--horovod` checks that)."""
    tri = float(size * (size - 1) // 2)
    a, b = torch.full((3,), float(rank)), torch.full((2, 2), float(rank + 1))
    got = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="g")
    assert torch.equal(got[0], torch.full((3,), tri)) and torch.equal(
        got[1], torch.full((2, 2), tri + size)), got
    got = hvd.synchronize(hvd.grouped_allreduce_async([a, b], name="ga"))  # Average
    assert torch.allclose(got[1], torch.full((2, 2), (tri + size) / size)), got
    x, y = a.clone(), b.clone()
    hvd.grouped_allreduce_([x, y], op=hvd.Sum, name="gi")
    assert torch.equal(x, torch.full((3,), tri)) and torch.equal(y, got[1] * size), (x, y)
    rows = hvd.grouped_allgather([torch.full((rank + 1, 2), float(rank)), a[None]], name="gg")
    assert rows[0].shape == (size * (size + 1) // 2, 2) and rows[1].shape == (size, 3), rows
    t = torch.arange(2.0 * size).repeat_interleave(2).reshape(2 * size, 2) + rank
    mine = hvd.synchronize(hvd.reducescatter_async(t, op=hvd.Sum, name="rs"))
    want = (torch.arange(2.0 * size).repeat_interleave(2).reshape(2 * size, 2) * size + tri)
    assert torch.equal(mine, want[2 * rank: 2 * rank + 2]), (mine, want)
    both = hvd.grouped_reducescatter([t, t * 2], op=hvd.Sum, name="grs")
    assert torch.equal(both[0], mine) and torch.equal(both[1], mine * 2), both
    out, received = hvd.synchronize(hvd.alltoall_async(torch.full((size, 2), float(rank)),
                                                       name="a2a"))
    assert torch.equal(out[:, 0], torch.arange(float(size))), out
    assert received.tolist() == [1] * size, received
    for splits in (torch.ones(size), torch.full((size,), float("nan"))):
        try:  # the dtype is refused, whatever values the splits hold
            hvd.alltoall(torch.ones(size), splits)
        except ValueError:
            continue
        raise AssertionError(f"alltoall took {splits.dtype} splits")


if __name__ == "__main__":
    main()
