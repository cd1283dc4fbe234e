"""Two ranks under a torchrun-like environment (gloo on loopback) that never call init_process_group:
rp.hf.wrap joins the world group itself; rp.hf.Trainer logs what transformers.Trainer + DDP logs.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/hf/test_hf_trainer_ranks.py CONFIG_JSON
runs one rank (the tests below start both).
"""
import copy
import json
import os
import sys

import pytest
import ranks
import torch
from test_hf_trainer import dataset

import roundpipe as rp

V = 32


def tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)).float()


def run_loop(cfg: dict) -> dict:
    """A hand loop: wrap (no process group yet), 3 steps on this rank's half of each batch."""
    import torch.distributed as dist
    model = rp.hf.wrap(tiny_llama(), devices=["cpu"], num_microbatches=2)
    joined = dist.is_initialized()
    rank = dist.get_rank() if joined else 0
    opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
    with model:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(1, V, (4, 9), generator=g)
            part = ids[2 * rank:2 * rank + 2]
            model.forward_backward(input_ids=part, labels=part)
            model.step(opt, asynchronous=False)
        model.synchronize()
        return {"joined": joined, "world": model.dp.world if model.dp is not None else 1,
                "final": [p.detach().clone() for p in model.parameters()]}


def run_trainer(cfg: dict) -> dict:
    """rp.hf.Trainer given a plain model (it wraps it, joining the group), then transformers.Trainer with DDP."""
    import transformers
    from transformers import TrainingArguments
    hf = tiny_llama()
    ref_model = copy.deepcopy(hf)

    def args(out):
        return TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=3, learning_rate=0.5, max_grad_norm=1e3, optim="sgd", report_to=[],
                                 save_strategy="no", seed=0, disable_tqdm=True, use_cpu=True,
                                 dataloader_num_workers=0, logging_steps=1,
                                 average_tokens_across_devices=cfg["average_tokens"])
    trainer = rp.hf.Trainer(model=hf, args=args(cfg["out"] + ".rp"), train_dataset=dataset(vocab=V),
                            devices=["cpu"], num_microbatches=2)
    trainer.train()
    world = trainer.rp_model.dp.world if trainer.rp_model.dp is not None else 1
    final = [p.detach().clone() for p in trainer.rp_model.parameters()]
    trainer.rp_model.close()
    ref = transformers.Trainer(model=ref_model, args=args(cfg["out"] + ".ref"), train_dataset=dataset(vocab=V))
    ref.train()
    return {"final": final, "ref": [p.detach().clone() for p in ref_model.parameters()], "world": world,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "ref_losses": [h["loss"] for h in ref.state.log_history if "loss" in h]}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    try:
        result = (run_trainer if cfg["mode"] == "trainer" else run_loop)(cfg)
    except Exception as e:  # noqa: BLE001 - reported to the parent as the rank's result
        result = {"error": f"{type(e).__name__}: {e}"}
    torch.save(result, cfg["out"] + f".{os.environ['RANK']}")


def launch(cfg: dict, tmp_path, world: int = 2, timeout: float = 240) -> list[dict]:
    """Runs this file as `world` ranks with torchrun's environment; what each rank saved (never an error)."""
    results = ranks.launch(__file__, cfg, world, tmp_path, timeout)
    for r in results:
        assert "error" not in r, r
    return results


needs_dist = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


@needs_dist
def test_wrap_joins_the_world_group_itself(tmp_path):
    """Wrapping before any init_process_group under WORLD_SIZE=2 joins the group: 3 steps leave equal weights."""
    pytest.importorskip("transformers")
    ranks = launch({"mode": "loop"}, tmp_path)
    assert [r["joined"] for r in ranks] == [True, True] and [r["world"] for r in ranks] == [2, 2]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["final"], ranks[1]["final"]))


@needs_dist
@pytest.mark.parametrize("average_tokens", [True, False])
def test_trainer_under_torchrun_logs_what_ddp_logs(tmp_path, average_tokens):
    """Two ranks, rp.hf.Trainer given a plain model (joining the group as it wraps it): the logged losses and the
    weights equal transformers.Trainer's with DDP (the loss was logged divided by the world size)."""
    pytest.importorskip("transformers")
    ranks = launch({"mode": "trainer", "average_tokens": average_tokens}, tmp_path)
    for r in ranks:
        assert r["world"] == 2
        assert len(r["losses"]) == len(r["ref_losses"]) == 3
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        for a, b in zip(r["final"], r["ref"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["final"], ranks[1]["final"]))


def test_wrap_under_world_size_without_rendezvous_says_how(monkeypatch):
    """WORLD_SIZE=2 without MASTER_ADDR/MASTER_PORT is a ValueError naming what is missing and how to launch."""
    pytest.importorskip("transformers")
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT are not set.*torchrun"):
        rp.hf.wrap(tiny_llama(), devices=["cpu"])


if __name__ == "__main__":
    main()
