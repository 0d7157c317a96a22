import torch
from torch_sharded import *
def main():
    torch.set_num_threads(1); hvd.init()
    make, tol = OPTIMIZERS["sgd"]
    want = flat(reference(make, 6)[0])
    for shard_on in (False, True):
      for gated in (False, True):
        model = mlp(seed=5)
        opt = hvd.DistributedOptimizer(make(groups(model)), named_parameters=model.named_parameters(), tuning=SMALL, shard_optimizer=shard_on, gate_forward=model if gated else None)
        train(model, opt, 6)
        print("RANK", hvd.rank(), "shard", shard_on, "gated", gated, "err", (flat(model)-want).abs().max().item(), flush=True)
    hvd.shutdown()
main()
