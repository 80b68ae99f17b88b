"""The vllm engine's weight push from a sharded policy (train.shard=fsdp), without a
server: two gloo processes each write the files the server would load, every tensor
gathered in turn, and those files hold the whole weights while no rank ever held more
than one gathered tensor at once (measured). The push to a real vLLM server from a
sharded run is tests/test_vllm.py's `test_a_sharded_run_pushes_to_the_server`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_distributed import TORCHRUN, finish, free_port, launch

from looprl.engine.weight_push import PushStats, save_in_turn

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "push_worker.py")


def test_two_sharded_ranks_push_whole_weights_one_tensor_at_a_time(tmp_path):
    port = str(free_port())
    rendezvous = ["--master_addr", "127.0.0.1", "--master_port", port]
    cmd = [*TORCHRUN, "--nproc_per_node", "2", *rendezvous, WORKER, str(tmp_path)]
    finish(launch(cmd), timeout=240)
    for kind, file in (("full", "weights.safetensors"), ("lora", "adapter_model.safetensors")):
        whole = torch.load(tmp_path / f"{kind}_whole.pt")
        for rank in (0, 1):
            pushed = load_file(str(tmp_path / f"{kind}_{rank}" / file))
            # LoRA: PEFT's names, without the adapter's (`.default`)
            names = {name.replace(".default", ""): name for name in whole}
            assert pushed.keys() == names.keys(), kind
            for key, name in names.items():
                assert torch.equal(pushed[key], whole[name]), (kind, key)
            measures = json.loads((tmp_path / f"{kind}_{rank}.json").read_text())
            assert measures["all_sharded"] and measures["tensors"] == measures["count"]
            # one gathered tensor at a time: the largest, never the whole model
            assert measures["peak_bytes"] == measures["largest_bytes"], (kind, measures)
            assert measures["peak_bytes"] < measures["total_bytes"], (kind, measures)
            assert measures["kept_peak_bytes"] == measures["total_bytes"]  # what it measures
        assert any(t.abs().max() > 0 for n, t in whole.items() if "lora_B" in n or kind == "full")
    config = json.loads((tmp_path / "lora_0" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["inference_mode"] is True


def test_a_push_file_is_what_safetensors_reads(tmp_path):
    """Every dtype and shape, a scalar included, read back as written; nothing gathered
    from whole tensors."""
    stats = PushStats()
    tensors = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).bfloat16()),
        ("c", torch.tensor(3)),
        ("d", torch.ones(2, 2, dtype=torch.float16)),
    ]
    save_in_turn(tmp_path / "w.safetensors", tensors, stats)
    back = load_file(str(tmp_path / "w.safetensors"))
    assert list(back) == ["a", "b", "c", "d"]
    assert all(torch.equal(back[name], t) and back[name].dtype == t.dtype for name, t in tensors)
    assert (stats.tensors, stats.total_bytes, stats.peak_bytes) == (4, 60 + 14 + 8 + 8, 0)
