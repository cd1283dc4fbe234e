"""Where a RoundPipe run departs from plain PyTorch on one device: gradients, then losses step by step.

    python scripts/gpu-diag.py --device cuda:0 --sizes small,0.8b --steps 12
    python scripts/gpu-diag.py --device cpu --sizes tiny --steps 4 --seq-len 64 --batch 4   # the same on CPU workers

1. Gradients of one forward_backward, fp32 compute (TF32 off), RoundPipe against an nn.Sequential
   on the same device: the worst relative error per parameter, for one worker and for the same
   device twice.  A wrong-gradient race shows here, before any optimizer step.
2. Training losses of every step for `roundpipe train`'s engines: torch, RoundPipe with the
   synchronous step, RoundPipe with the asynchronous one (the default compute dtype).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch


def gradient_errors(size: str, device: str, workers: int, batch: int, seq_len: int) -> list[tuple[float, str]]:
    """(relative error, name) of every parameter's gradient, RoundPipe against nn.Sequential, worst first."""
    import roundpipe as rp
    from roundpipe.commands.data import ByteCorpus
    from roundpipe.models.tiny_decoder import PRESETS, build_layers, loss_fn

    layers = build_layers(PRESETS[size], seed=0)
    ref = torch.nn.Sequential(*copy.deepcopy(layers)).to(device)
    x, y = next(iter(ByteCorpus.load(None).batches(batch, seq_len, seed=0, steps=1)))
    loss_fn(ref(x.to(device)), y.to(device)).backward()
    with rp.RoundPipe(layers, devices=[device] * workers, compute_dtype=torch.float32) as model:
        model.forward_backward(x, labels=y, loss_fn=loss_fn)
        model.synchronize()
        errors = []
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            got, want = p.grad.float().cpu(), q.grad.float().cpu()
            errors.append((((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item(), name))
    return sorted(errors, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--sizes", default="small,0.8b", help="presets for the gradient check; the last also trains")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="sequences in the gradient check")
    parser.add_argument("--seq-len", type=int, default=512, help="bytes per sequence in the gradient check")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sizes = args.sizes.split(",")
    for size in sizes:
        for workers in (1, 2):
            start = time.perf_counter()
            errors = gradient_errors(size, args.device, workers, args.batch, args.seq_len)
            worst = ", ".join(f"{name} {err:.2e}" for err, name in errors[:4])
            print(f"grad {size} {workers} worker(s): worst {worst}; median {errors[len(errors) // 2][0]:.2e} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)

    from roundpipe.commands.train import TrainConfig, train
    cpu = args.device == "cpu"
    runs = {"torch": dict(engine="torch"), "rp-sync": dict(asynchronous=False), "rp-async": dict(asynchronous=True)}
    for label, extra in runs.items():
        start = time.perf_counter()
        result = train(TrainConfig(size=sizes[-1], steps=args.steps, devices=[args.device], progress=False,
                                   eval_batches=0, seed=0, **({"batch_size": 4, "seq_len": 64} if cpu else {}),
                                   **extra))
        losses = " ".join(f"{v:.3f}" for v in result.losses)
        print(f"train {sizes[-1]} {label}: {losses}  ({result.tokens_per_s:,.0f} tokens/s, "
              f"{time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
