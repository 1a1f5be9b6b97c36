"""`memtrain eval` on N ranks consolidates the checkpoint's fp32 weights on rank 0 only and
broadcasts them (consolidation reads every ZeRO optimizer partition: on every rank it would
read the checkpoint N times at once); a failure on rank 0 reaches every rank instead of
leaving them waiting in the broadcast. Two gloo ranks."""

import json
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model import ModelConfig, build_model
from train import export

CFG = dict(mechanism="xl", vocab_size=16, n_layer=2, d_model=32, n_head=4, d_head=8,
           d_inner=64, tgt_len=4, mem_len=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, port, out, fail):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    calls = []

    def load_weights(info, model_cfg):  # stands in for the consolidation
        calls.append(rank)
        if fail:
            raise ValueError("the checkpoint was trained with d_model 64")
        torch.manual_seed(1234)
        return build_model(model_cfg)

    export.load_weights = load_weights
    torch.manual_seed(rank)  # rank 1 would build other weights on its own
    result = {"calls": calls}
    try:
        model = export.load_weights_once(type("Info", (), {"path": Path("ckpt")})(),
                                         ModelConfig(**CFG), torch.device("cpu"))
        result["sum"] = [float(t.double().sum()) for t in model.state_dict().values()]
    except ValueError as err:
        result["error"] = str(err)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _run(tmp_path, fail):
    mp.start_processes(_rank_main, args=(_free_port(), str(tmp_path), fail), nprocs=2,
                       join=True, start_method="spawn")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_only_rank_0_consolidates_and_every_rank_gets_its_weights(tmp_path):
    r0, r1 = _run(tmp_path, fail=False)
    assert r0["calls"] == [0] and r1["calls"] == []
    assert r0["sum"] == r1["sum"]
    torch.manual_seed(1234)
    expected = [float(t.double().sum()) for t in build_model(ModelConfig(**CFG)).state_dict()
                .values()]
    assert r0["sum"] == expected


def test_a_failure_on_rank_0_is_raised_on_every_rank(tmp_path):
    r0, r1 = _run(tmp_path, fail=True)
    for r in (r0, r1):
        assert "d_model 64" in r["error"] and "rank 0 could not load" in r["error"]
