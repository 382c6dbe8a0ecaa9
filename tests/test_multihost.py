"""Two torchrun nodes on one machine posing as two hosts: dist channels between them, shm within, exact training."""

from __future__ import annotations

import os
import subprocess
import sys

from ports import free_port

NODE_TIMEOUT = 180.0

# Runs on each of the 4 ranks. Which node gets ranks 0-1 is the rendezvous's choice, so the expected
# backends come from the host ids the ranks report, not from the node's name.
SCRIPT = """
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pipecomm

MICRO_BATCHES, STEPS, LR = 4, 3, 0.1


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(16, 16), nn.Tanh())])


def batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator)


def reference_losses():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, target = batch(step)
        loss = torch.stack([F.mse_loss(model(x), t) for x, t in zip(inputs.chunk(MICRO_BATCHES),
                                                                  target.chunk(MICRO_BATCHES))]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


torch.set_num_threads(1)
ctx = pipecomm.init()
assert (ctx.world_size, ctx.num_stages) == (4, 4), ctx
stage_module = pipecomm.split(make_model(), 4, ctx.stage)
pipe = pipecomm.Pipeline(stage_module, stage=ctx.stage, num_stages=4, loss_fn=F.mse_loss,
                         micro_batches=MICRO_BATCHES, group=ctx.pipeline_group)
optimizer = torch.optim.SGD(stage_module.parameters(), lr=LR)
losses = []
for step in range(STEPS):
    inputs, target = batch(step)
    losses.append(pipe.step(inputs, target=target).item())
    optimizer.step()
    optimizer.zero_grad()

hosts = [None] * 4
dist.all_gather_object(hosts, os.environ["PIPECOMM_HOST_ID"])
assert sorted(hosts) == ["a", "a", "b", "b"] and hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
backends = {}
for (peer, kind), channel in pipe._links.channels.items():
    backends[(peer, kind)] = (channel.channel if kind == "act" else channel).backend
neighbours = [peer for peer in (ctx.stage - 1, ctx.stage + 1) if 0 <= peer < 4]
expected = {(peer, kind): "shm" if hosts[peer] == hosts[ctx.stage] else "dist"
            for peer in neighbours for kind in ("act", "grad")}
assert backends == expected, (ctx.rank, backends, expected)
if ctx.stage == 3:
    want = reference_losses()
    assert all(abs(got - ref) <= 1e-5 * max(abs(ref), 1.0) for got, ref in zip(losses, want)), (losses, want)
print(f"rank {ctx.rank} host {hosts[ctx.rank]}: backends {sorted(backends.items())} losses {losses}", flush=True)
pipe.close()
dist.destroy_process_group()
"""


def test_two_nodes_train_exactly_with_dist_between_and_shm_within(tmp_path):
    script = tmp_path / "two_hosts.py"
    script.write_text(SCRIPT)
    endpoint = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "multihost",
               "--max-restarts", "0", str(script)]
    nodes = {
        host: subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "PIPECOMM_HOST_ID": host})
        for host in ("a", "b")
    }
    outputs, codes = {}, {}
    try:
        for host, node in nodes.items():
            # Both nodes run at once, so the first wait holds the whole budget and the second is short.
            outputs[host], _ = node.communicate(timeout=NODE_TIMEOUT)
            codes[host] = node.returncode
    except subprocess.TimeoutExpired:
        for host, node in nodes.items():
            if host not in codes:
                node.kill()
                outputs[host] = node.communicate()[0]
                codes[host] = f"killed after {NODE_TIMEOUT:g} s"
    report = "\n".join(f"--- node {host}: exit {codes[host]}\n{outputs[host][-4000:]}" for host in nodes)
    assert codes == {"a": 0, "b": 0}, report
    assert sum(output.count("backends") for output in outputs.values()) == 4, report
