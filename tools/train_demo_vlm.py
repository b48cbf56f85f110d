"""Train demo-vlm's vision tower and connector on synthetic pictures (CPU, one thread, seeded).

The shipped lm_console/engine/models/demo_vlm_vision.safetensors came from these four runs (each seeded
and deterministic on a CPU; wall times on the shared 2-core box under heavy load):

    T=tools/train_demo_vlm.py; export PYTHONPATH=$PWD
    python $T --out /tmp/s1.safetensors                                          # 1500 steps, ~7 min
    python $T --init /tmp/s1.safetensors --steps 1000 --lr 1e-3 --mse-weight 10 --out /tmp/s2.safetensors
    python $T --init /tmp/s2.safetensors --steps 1500 --lr 5e-4 --mse-weight 30 --word-weight 10 \
              --out /tmp/s3.safetensors                                          # ~4 + ~9 min
    python $T --init /tmp/s3.safetensors --steps 0 --refit                      # 30 s: writes the weights

The language model (the embedded SmolLM2-135M-Instruct) stays frozen and is never run here.
The SigLIP tower and the Idefics3 connector are trained from scratch so that, for a picture
from lm_console/engine/models/demo_vlm_pictures.py, the connector's 16 output vectors are the LM's own
input embeddings of the picture's caption ("Two red squares on the left." then spaces): the
LM then reads the picture as if the caption were written in the prompt, and answers questions
about it ("Describe the picture." -> "Two red squares on the left."). The loss per output
vector is a cosine cross-entropy over the caption vocabulary plus a squared error to the target
embedding (weighted up in later stages: the LM misreads embeddings that are merely nearest to
the right word, e.g. purple as blue), plus training-only classification heads for the four
attributes; the last run refits the connector by weighted least squares. Teacher forcing on
answers through the 135M LM was not used: a step costs ~100x a tower step on this CPU.
Pictures go through the same Idefics3 image processor settings as demo-vlm at inference.
Training seeds are [0, pool); the tests use held-out seeds >= 1_000_000.

The tower and connector weights are saved in float16 (0.6 MB) under the names
`model.vision_model.*` / `model.connector.*` of HF's Idefics3ForConditionalGeneration;
lm_console/engine/models/demo_vlm.py copies them into the demo-vlm directory it builds.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lm_console.engine.models.demo_vlm import (  # noqa: E402
    DEMO_SCALE_FACTOR, DEMO_VISION_CONFIG, DEMO_VISION_WEIGHTS, IMAGE_TOKENS, caption_slots,
)
from lm_console.engine.models.demo_vlm_pictures import COLOURS, COUNTS, POSITIONS, SHAPES, make_picture  # noqa: E402
from lm_console.engine.models.embedded import DEFAULT_MODEL, resolve_model_path  # noqa: E402

EVAL_SEED = 10_000_000  # the training script's own held-out pictures (the tests use others)


def build_modules(text_hidden: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """HF's Idefics3 vision tower and connector with demo-vlm's shapes (default HF init)."""
    from transformers import Idefics3Config
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

    config = Idefics3Config(vision_config={"model_type": "idefics3_vision", **DEMO_VISION_CONFIG},
                            text_config={"model_type": "llama", "hidden_size": text_hidden},
                            scale_factor=DEMO_SCALE_FACTOR)
    return Idefics3VisionTransformer(config.vision_config), Idefics3Connector(config)


def attribute_labels(scenes: list) -> torch.Tensor:
    """[N, 4] class indices of (colour, shape, count, position)."""
    return torch.tensor([[list(COLOURS).index(s.colour), SHAPES.index(s.shape), COUNTS.index(s.count),
                          POSITIONS.index(s.position)] for s in scenes])


def lean_forward(tower: torch.nn.Module, connector: torch.nn.Module, pixels: torch.Tensor,
                 features: list | None = None) -> torch.Tensor:
    """HF's tower + connector forward for full (unpadded) pictures, without its per-sample position
    bucketing and mask building: the same arithmetic, several times faster on a CPU."""
    embeddings = tower.embeddings
    x = embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
    x = x + embeddings.position_embedding.weight
    for layer in tower.encoder.layers:
        attn = layer.self_attn
        h = layer.layer_norm1(x)
        batch, seq, dim = h.shape
        q, k, v = (proj(h).view(batch, seq, attn.num_heads, -1).transpose(1, 2)
                   for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, seq, dim)
        x = x + attn.out_proj(h)
        x = x + layer.mlp(layer.layer_norm2(x))
    x = tower.post_layernorm(x)
    if features is not None:
        features.append(x)
    return connector(x)


def refit_connector(tower: torch.nn.Module, connector: torch.nn.Module, pixels: torch.Tensor,
                    ids: torch.Tensor, embed: torch.Tensor, pad_id: int, ridge: float = 1e-3,
                    word_weight: float = 10.0) -> None:
    """Replace the connector's projection by the weighted least-squares fit of the target
    embeddings on the trained tower's (pixel-shuffled) features: the closest linear map, so the LM
    reads embeddings as near its own as this tower allows. The caption's words weigh word_weight
    times the padding spaces (there are more spaces, and the words carry the picture)."""
    features: list = []
    tower.eval()
    with torch.no_grad():
        for i in range(0, len(pixels), 250):
            hidden: list = []
            lean_forward(tower, connector, to_input(pixels[i:i + 250]), hidden)
            features.append(connector.pixel_shuffle(hidden[0], connector.scale_factor).flatten(0, 1))
        weight_rows = torch.where(ids.flatten() == pad_id, 1.0, word_weight).double().sqrt()[:, None]
        x = torch.cat(features).double() * weight_rows  # [N * 16, D * s^2]
        y = embed[ids.flatten()].double() * weight_rows  # [N * 16, text_hidden]
        gram = x.T @ x + ridge * len(x) * torch.eye(x.shape[1], dtype=torch.float64)
        weight = torch.linalg.solve(gram, x.T @ y).T  # [text_hidden, D * s^2]
        connector.modality_projection.proj.weight.copy_(weight.float())
    tower.train()


def render(seeds: range, processor) -> tuple[torch.Tensor, list]:
    """uint8 pixels [N, 3, H, W] as the image processor leaves them (before normalisation), and the scenes."""
    pixels, scenes = [], []
    for start in range(0, len(seeds), 256):
        batch = [make_picture(s) for s in seeds[start:start + 256]]
        out = processor(images=[[image] for image, _ in batch], return_tensors="np")
        values = out["pixel_values"][:, 0]  # [B, 3, H, W], (x / 255 - 0.5) / 0.5
        pixels.append(torch.from_numpy(np.rint((values * 0.5 + 0.5) * 255).astype(np.uint8)))
        scenes += [scene for _, scene in batch]
    return torch.cat(pixels), scenes


def to_input(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels.float() / 255 - 0.5) / 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "lm_console" / "engine" / "models" / DEMO_VISION_WEIGHTS)
    parser.add_argument("--pool", type=int, default=4000, help="training pictures (seeds 0..pool-1)")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    # One thread: on a shared 2-core box two OpenMP threads spin-wait for each other (10x slower).
    parser.add_argument("--init", type=Path, help="start from these saved weights (a second stage)")
    parser.add_argument("--mse-weight", type=float, default=1.0)
    parser.add_argument("--word-weight", type=float, default=1.0, help="squared-error weight of caption words vs spaces")
    parser.add_argument("--refit", action="store_true", help="least-squares refit of the connector at the end")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    random.seed(0)
    started = time.time()

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    lm_dir = resolve_model_path(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    pad_id = tokenizer(" ", add_special_tokens=False)["input_ids"][0]
    embed = next(t for name, t in load_file(str(next(lm_dir.glob("*.safetensors")))).items()
                 if name.endswith("embed_tokens.weight")).float()
    processor = Idefics3ImageProcessorPil(do_resize=True, size={"longest_edge": 128},
                                          max_image_size={"longest_edge": 128}, do_image_splitting=False)

    train_pixels, train_scenes = render(range(args.pool), processor)
    eval_pixels, eval_scenes = render(range(EVAL_SEED, EVAL_SEED + 200), processor)
    train_ids = torch.tensor([caption_slots(tokenizer, s) for s in train_scenes])  # [N, 16]
    eval_ids = torch.tensor([caption_slots(tokenizer, s) for s in eval_scenes])
    vocab = torch.unique(torch.cat([train_ids.flatten(), eval_ids.flatten()]))  # the caption vocabulary
    slot_class = torch.full((embed.shape[0],), -1, dtype=torch.long)
    slot_class[vocab] = torch.arange(len(vocab))
    vocab_unit = F.normalize(embed[vocab], dim=-1)
    target_scale = float(embed[vocab].pow(2).mean())
    print(f"rendered {args.pool} + 200 pictures in {time.time() - started:.0f} s; caption vocabulary "
          f"{len(vocab)} tokens", flush=True)

    tower, connector = build_modules(embed.shape[1])
    # Training-only heads on the tower's mean patch feature, one per attribute: a direct signal
    # that makes the tower learn colour/shape/count/position fast. Not saved.
    sizes = (len(COLOURS), len(SHAPES), len(COUNTS), len(POSITIONS))
    heads = torch.nn.ModuleList(torch.nn.Linear(tower.config.hidden_size, n) for n in sizes)
    train_labels = attribute_labels(train_scenes)
    if args.init is not None:
        saved = load_file(str(args.init))
        tower.load_state_dict({k.removeprefix("model.vision_model."): v.float() for k, v in saved.items()
                               if k.startswith("model.vision_model.")})
        connector.load_state_dict({k.removeprefix("model.connector."): v.float() for k, v in saved.items()
                                   if k.startswith("model.connector.")})
    params = [*tower.parameters(), *connector.parameters(), *heads.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(args.steps, 1),
                                                   pct_start=0.1)
    generator = torch.Generator().manual_seed(0)

    def forward(pixels: torch.Tensor, features: list | None = None) -> torch.Tensor:
        return lean_forward(tower, connector, to_input(pixels), features)  # [B, 16, text_hidden]

    def evaluate() -> tuple[float, float, list[float]]:
        """(slot accuracy, whole-caption accuracy, per-slot accuracy of the first 6 slots) of
        nearest-embedding decoding on held-out pictures."""
        tower.eval()
        with torch.no_grad():
            out = torch.cat([forward(eval_pixels[i:i + 250]) for i in range(0, len(eval_pixels), 250)])
        tower.train()
        decoded = vocab[(F.normalize(out, dim=-1) @ vocab_unit.T).argmax(-1)]
        relative = (out - embed[eval_ids]).norm(dim=-1) / embed[eval_ids].norm(dim=-1)
        error = float(relative[eval_ids != pad_id].mean())  # on the caption's words
        right = decoded == eval_ids
        per_slot = [round(float(v), 2) for v in right.float().mean(0)[:6]]
        return float(right.float().mean()), float(right.all(-1).float().mean()), per_slot + [round(error, 3)]

    for step in range(1, args.steps + 1):
        index = torch.randint(0, len(train_pixels), (args.batch,), generator=generator)
        features: list = []
        out = forward(train_pixels[index], features)
        ids = train_ids[index]
        pooled = features[0].mean(1)
        aux = sum(F.cross_entropy(head(pooled), train_labels[index, k]) for k, head in enumerate(heads))
        logits = 30.0 * F.normalize(out, dim=-1) @ vocab_unit.T
        loss = F.cross_entropy(logits.flatten(0, 1), slot_class[ids].flatten())
        # Squared error per embedding, the caption's words weighing word_weight times the spaces.
        weights = torch.where(ids == pad_id, 1.0, args.word_weight)
        squared = (out - embed[ids]).pow(2).mean(-1) / target_scale
        loss = loss + args.mse_weight * (squared * weights).sum() / weights.sum() + aux
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == args.steps:
            slot_acc, caption_acc, per_slot = evaluate()
            print(f"step {step}: loss {loss.item():.3f} (aux {aux.item():.3f}), held-out slots {slot_acc:.3f} "
                  f"{per_slot}, captions {caption_acc:.3f} ({time.time() - started:.0f} s)", flush=True)

    if args.refit:
        refit_connector(tower, connector, train_pixels, train_ids, embed, pad_id)
        slot_acc, caption_acc, per_slot = evaluate()
        print(f"after the least-squares connector: held-out slots {slot_acc:.3f} {per_slot}, captions {caption_acc:.3f}")
    state = {f"model.vision_model.{k}": v for k, v in tower.state_dict().items()}
    state |= {f"model.connector.{k}": v for k, v in connector.state_dict().items()}
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}, str(args.out),
              metadata={"steps": str(args.steps), "pool": str(args.pool), "seed": "0"})
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB) after {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
