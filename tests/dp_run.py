"""One rank of the data-parallel tests (gloo on loopback), or the single-process reference.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/dp_run.py CONFIG_JSON

Each rank trains on its share of every batch (rows rank*b .. (rank+1)*b of the combined batch)
and writes its masters after every step and its losses to config["out"] + f".{rank}".
"""
from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp

WIDTH = 8


def layers() -> list[nn.Module]:
    torch.manual_seed(3)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)] + [nn.Linear(WIDTH, WIDTH)]


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, WIDTH, generator=g), torch.randn(size, WIDTH, generator=g)


class Fail(nn.Module):
    """Raises in the forward of call `at` on rank `rank` (the fault test)."""

    def __init__(self, rank: int, at: int):
        super().__init__()
        self.rank, self.at, self.calls = rank, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at and int(os.environ.get("RANK", "0")) == self.rank:
            raise RuntimeError("injected failure")
        return x


def run_hf(cfg: dict, rank: int = 0, world: int = 1) -> dict:
    """A tiny Llama through rp.hf.wrap (under torchrun it picks the world group itself); rows padded
    differently, so the ranks' token counts differ and the mean must be over all ranks' tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)).float()
    model = rp.hf.wrap(hf, devices=["cpu"] * 2, num_microbatches=cfg["microbatches"])
    opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
    b = cfg["batch"] // world
    out = {"losses": [], "world": model.dp.world if model.dp is not None else 1}
    with model:
        for step in range(cfg["steps"]):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(1, 32, (cfg["batch"], 9), generator=g)
            labels = ids.clone()
            for i in range(cfg["batch"]):
                labels[i, 2 + (3 * i + step) % 7:] = -100
            out["losses"].append(float(model.forward_backward(ids[rank * b:(rank + 1) * b],
                                                              labels=labels[rank * b:(rank + 1) * b])))
            model.step(opt, asynchronous=cfg["asynchronous"])
        model.synchronize()
        out["final"] = [p.detach().clone() for p in model.parameters()]
    return out


def run_trainer(cfg: dict) -> dict:
    """transformers.Trainer (DDP) and rp.hf.Trainer on the same tiny model and data, under torchrun."""
    import copy

    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)).float()
    ref_model = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(16):
        ids = torch.randint(1, 32, (9,), generator=g)
        mask = torch.ones(9, dtype=torch.long)
        mask[8 - i % 5:] = 0
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})

    def args(out):
        return TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=3, learning_rate=0.5, max_grad_norm=1e3, optim="sgd", report_to=[],
                                 save_strategy="no",
                                 seed=0, disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, logging_steps=1,
                                 average_tokens_across_devices=cfg["average_tokens"])
    ref = transformers.Trainer(model=ref_model, args=args(cfg["out"] + ".ref"), train_dataset=rows)
    ref.train()
    with rp.hf.wrap(hf, devices=["cpu"] * 2, num_microbatches=2) as model:
        trainer = rp.hf.Trainer(model=model, args=args(cfg["out"] + ".rp"), train_dataset=rows)
        trainer.train()
        world = model.dp.world if model.dp is not None else 1
        final = [p.detach().clone() for p in model.parameters()]
    return {"final": final, "ref": [p.detach().clone() for p in ref_model.parameters()], "world": world,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "ref_losses": [h["loss"] for h in ref.state.log_history if "loss" in h]}


def run(cfg: dict, group=None, rank: int = 0, world: int = 1) -> dict:
    if cfg.get("model") == "trainer":
        return run_trainer(cfg)
    if cfg.get("model") == "hf":
        return run_hf(cfg, rank, world)
    model_layers = layers()
    if cfg.get("fail_rank") is not None:
        model_layers.insert(1, Fail(cfg["fail_rank"], cfg["fail_at"]))
    model = rp.RoundPipe(model_layers, devices=["cpu"] * 2, num_microbatches=cfg["microbatches"],
                         process_group=group, shard_optimizer=cfg.get("shard", False))
    params = list(model.parameters())
    opt = rp.optim.AdamW(params, lr=1e-2) if cfg["optimizer"] == "rp" else torch.optim.AdamW(params, lr=1e-2)
    b = cfg["batch"] // world
    out = {"masters": [], "losses": []}
    with model:
        if cfg.get("load"):
            model.load_checkpoint(cfg["load"], opt)
        for step in range(cfg.get("start", 0), cfg["steps"]):
            x, y = batch(step, cfg["batch"])
            loss = model.forward_backward(x[rank * b:(rank + 1) * b], labels=y[rank * b:(rank + 1) * b],
                                          loss_fn=F.mse_loss)
            out["losses"].append(float(loss))
            model.step(opt, asynchronous=cfg["asynchronous"], max_grad_norm=cfg.get("clip"))
            if cfg.get("save_at") == step + 1:
                model.save_checkpoint(cfg["path"], opt)
            if not cfg["asynchronous"]:   # after every step (asynchronous: at the end only, no sync point)
                out["masters"].append([p.detach().clone() for p in model.parameters()])
        model.synchronize()
        out["final"] = [p.detach().clone() for p in model.parameters()]
        out["optimizer_bytes"] = model.memory_stats(opt)["host"]["optimizer_state"]
        out["params"] = sum(p.numel() for p in model.parameters())
    return out


def main() -> None:
    import torch.distributed as dist
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.get("timeout", 60)))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = run(cfg, dist.group.WORLD, rank, world)
        torch.save(result, cfg["out"] + f".{rank}")
    except Exception as e:   # the fault test reads what each rank saw
        torch.save({"error": f"{type(e).__name__}: {e}", "notes": getattr(e, "__notes__", [])}, cfg["out"] + f".{rank}")
        raise
    finally:
        if cfg.get("fail_rank") is None:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
