"""Quick start with a model that is not a transformer: a ResNet-18-shaped CNN through RoundPipe.

Runs on CPU workers anywhere (no download: CIFAR-shaped generated data), or on GPUs:

    python examples/cnn_quickstart.py                        # 2 CPU workers, width 16, 30 steps
    python examples/cnn_quickstart.py --devices cuda:0 cuda:1 --width 64 --steps 200

BatchNorm layers normalise each microbatch with its own statistics and update their running
statistics once per microbatch (README, Semantics: BatchNorm); the evaluation at the end
uses those running statistics (model.eval()).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import roundpipe as rp  # noqa: E402
from roundpipe.models.resnet import resnet18_layers, synthetic_cifar  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", nargs="+", default=["cpu", "cpu"])
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    layers = resnet18_layers(num_classes=10, width=args.width)
    x_eval, y_eval = synthetic_cifar(256, seed=1)
    losses = []
    with rp.RoundPipe(layers, devices=args.devices, num_microbatches=args.microbatches) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
        for step in range(args.steps):
            x, y = synthetic_cifar(args.batch_size, seed=100 + step)
            losses.append(float(model.forward_backward(x, labels=y, loss_fn=F.cross_entropy)))
            model.step(opt)
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {losses[-1]:.4f}")
        model.synchronize()
        for layer in layers:
            layer.eval()
        accuracy = float((model(x_eval).argmax(1) == y_eval).float().mean())
    print(f"held-out accuracy {accuracy:.3f} (chance 0.100)")
    return {"losses": losses, "accuracy": accuracy}


if __name__ == "__main__":
    main()
