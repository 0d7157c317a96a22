"""Kill a rank mid-epoch and keep training: an elastic job on one machine.

Run: python examples/elastic_kill_and_continue.py

It starts itself on 3 ranks under `python -m asynclock.launch --elastic --min-np 2
--max-np 3` with a host discovery script; the "hosts" are names of this machine
(`localhost`, `127.0.0.1`, `127.1`), one rank each. In epoch 1 rank 2 SIGKILLs
itself; ranks 0 and 1 keep their processes, roll back to the last commit and go on
as a 2-rank job; rank 0 then adds a host to the discovery script's output, and a
new rank joins at the next commit. Every line says which world it was in.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOSTS = ("localhost", "127.0.0.1", "127.1")
EPOCHS, BATCH, COMMIT_EVERY = 3, 16, 4


def launch() -> int:
    """Write the hosts file and its discovery script, then start the job."""
    with tempfile.TemporaryDirectory(prefix="elastic-example-") as tmp:
        work = Path(tmp)
        (work / "hosts").write_text("".join(f"{h}:1\n" for h in HOSTS))
        script = work / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {work / 'hosts'}\n")
        script.chmod(0o755)
        return subprocess.call([
            sys.executable, "-m", "asynclock.launch", "--elastic", "-n", "3",
            "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script),
            "--launcher-arg=--network-interface", "--launcher-arg=lo",  # one machine
            "--timeout", "600", __file__, str(work)])


def train(work: Path) -> None:
    import torch

    import asynclock.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    y = x @ torch.randn(16, 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(len(x)), seed=1)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, batches=0)
    state.register_reset_callbacks([lambda: print(
        f"[pid {os.getpid()}] reset: now rank {hvd.rank()} of {hvd.size()}", flush=True)])

    def react(epoch: int, batches: int) -> None:
        """Rank 2 dies once in epoch 1; afterwards rank 0 adds a host once."""
        if epoch == 1 and hvd.rank() == 2 and not (work / "killed").exists():
            (work / "killed").write_text("")
            print(f"[pid {os.getpid()}] rank 2: SIGKILL after batch {batches}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if hvd.size() == 2 and hvd.rank() == 0 and not (work / "added").exists():
            (work / "added").write_text("")
            with (work / "hosts").open("a") as hosts:
                hosts.write("127.0.1:1\n")
            print("rank 0: added host 127.0.1 to the discovery output", flush=True)

    @hvd.elastic.run
    def epochs(state: hvd.elastic.TorchState) -> None:
        while state.epoch < EPOCHS:
            # as many whole batches on every rank: the shards differ by one sample at most
            per_rank = (len(x) - state.sampler.processed_num) // hvd.size()
            indices = list(state.sampler)[:per_rank]
            for start in range(0, per_rank - BATCH + 1, BATCH):
                batch = torch.tensor(indices[start:start + BATCH])
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
                loss.backward()
                optimizer.step()
                state.batches += 1
                state.sampler.record_batch(state.batches, BATCH)
                if state.batches % COMMIT_EVERY == 0:
                    react(state.epoch, state.batches)
                    state.commit()  # the in-memory checkpoint; hosts may join here
                    time.sleep(0.05)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch} done at {hvd.size()} ranks, loss {loss.item():.4f}",
                      flush=True)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    epochs(state)
    print(f"[pid {os.getpid()}] finished as rank {hvd.rank()} of {hvd.size()}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    if "HOROVOD_RANK" in os.environ:
        train(Path(sys.argv[1]))
    else:
        sys.exit(launch())
