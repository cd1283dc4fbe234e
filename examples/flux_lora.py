"""LoRA fine-tuning of a (tiny, random) Flux transformer with roundpipe, on CPU workers, in well under a minute.

    python examples/flux_lora.py [--steps 30] [--devices cpu cpu] [--out flux_lora_out]

A real run loads `FluxTransformer2DModel.from_pretrained(path, subfolder="transformer")` and feeds VAE latents
and T5/CLIP text embeddings; here the latents are generated: a fixed set of random "images" the adapter
learns to denoise, so the printed flow-matching loss falls.  The adapter is written in diffusers' LoRA format:
`FluxPipeline.load_lora_weights(out)` (or `transformer.load_lora_adapter`) reads it.
"""
import argparse
import time

import torch
from diffusers import FluxTransformer2DModel
from peft import LoraConfig

import roundpipe.diffusers as rpd

TINY_FLUX = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=16,
                 num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=False,
                 axes_dims_rope=(4, 6, 6))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--devices", nargs="+", default=["cpu", "cpu"])
    parser.add_argument("--out", default="flux_lora_out")
    args = parser.parse_args()

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(**TINY_FLUX)
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=8, lora_alpha=8, init_lora_weights="gaussian",
                                       target_modules=["to_q", "to_k", "to_v", "to_out.0"]))

    # a small "dataset": 8 latent images of 64x64 pixels (4x4 packed tokens) and their text embeddings
    data = rpd.example_inputs(transformer, 8, 64, 64, text_len=8)
    latents, text, pooled = data["hidden_states"], data["encoder_hidden_states"], data["pooled_projections"]
    ids = {"img_ids": data["img_ids"], "txt_ids": data["txt_ids"]}   # not per sample: passed whole

    model = rpd.wrap(transformer, devices=args.devices)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    start, recent = time.perf_counter(), []
    for step in range(args.steps):
        pick = torch.randint(0, latents.shape[0], (args.batch,))
        x0 = latents[pick]
        sigmas = torch.rand(args.batch)
        noisy, target = rpd.flow_matching_inputs(x0, torch.randn_like(x0), sigmas)
        loss = model.forward_backward(hidden_states=noisy, timestep=sigmas, encoder_hidden_states=text[pick],
                                      pooled_projections=pooled[pick], target=target, **ids)
        model.step(optimizer)
        recent = (recent + [loss.item()])[-5:]   # sigma is drawn per step: the mean of the last 5 shows the trend
        if step % 5 == 4 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}  mean of last 5 {sum(recent) / len(recent):.4f}  "
                  f"({time.perf_counter() - start:.1f} s)")
    model.save_lora_weights(args.out)
    model.close()
    print(f"adapter saved to {args.out}/ (diffusers LoRA format)")


if __name__ == "__main__":
    main()
