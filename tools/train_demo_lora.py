"""Train the shipped demo LoRA adapter, "pirate", for the embedded model (CPU, seeded, minutes).

What it teaches: every chat reply opens with "Ahoy, matey! " and then goes on as the base model
would have. That is visible at a glance in `lmc generate --lora pirate` and in the console, and
easy to measure: tests/lora/test_demo_adapter.py asks 50 held-out questions (topics this script
never trains on) with and without it.

How (all on data made here, nothing downloaded):
1. Questions from templates x TRAIN_TOPICS (a fixed, seeded sample).
2. The base model's own greedy reply to each (lm-console's engine, the chat template, 24 tokens).
3. Targets: "Ahoy, matey! " + that reply; the loss is on the reply's tokens only.
4. A rank-8 PEFT LoRA on q/k/v/o/gate/up/down of the last LAYERS decoder layers only, so the
   backward pass stops there (the first layers run forward only): ~1 s per step on 2 cores.
5. Saved in float16 (PEFT's adapter_config.json + adapter_model.safetensors) to --out, by default
   the package's lm_console/engine/lora/adapters/pirate/.

    PYTHONPATH=$PWD .venv/bin/python tools/train_demo_lora.py      # ~3-5 min on the 2-core VM
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lm_console.engine.lora.builtin import GREETING, builtin_adapter_dir  # noqa: E402
from lm_console.engine.models.embedded import resolve_model_path  # noqa: E402

TEMPLATES = (
    "What is {}?", "Tell me about {}.", "Explain {} in simple words.", "Why does {} matter?",
    "Give me one fact about {}.", "How would you describe {} to a child?", "What do you know about {}?",
    "Write one sentence about {}.",
)
# The held-out questions (tests/lora/test_demo_adapter.py) use other topics: none of these.
TRAIN_TOPICS = (
    "the moon", "rainbows", "volcanoes", "bread", "the ocean", "music", "bicycles", "trees", "rain",
    "the sun", "coffee", "chess", "mountains", "honey bees", "snow", "electricity", "gardens",
    "the internet", "libraries", "trains", "clouds", "dolphins", "friendship", "maps", "tea",
    "deserts", "birds", "computers", "rivers", "the stars", "cheese", "football", "painting",
    "the wind", "islands", "robots", "cats", "forests", "lightning", "soap", "glass", "bridges",
    "the alphabet", "summer", "pianos", "salt", "umbrellas", "rockets", "whales", "sleep",
)
LAYERS = 6  # the last LAYERS decoder layers carry the adapter
RANK, ALPHA = 8, 16
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def questions(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    pairs = [(t, topic) for t in TEMPLATES for topic in TRAIN_TOPICS]
    rng.shuffle(pairs)
    return [template.format(topic) for template, topic in pairs[:count]]


def base_replies(model_dir: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """The base model's greedy replies through our own engine (fast, and what users run)."""
    from lm_console.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), multiprocess=False, max_model_len=512)
    try:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        return [o.outputs[0].text for o in outputs]
    finally:
        llm.shutdown()


def examples(tokenizer, prompts: list[str], replies: list[str]) -> list[tuple[list[int], int]]:  # noqa: ANN001
    """(token ids of the whole chat, where the reply starts): the loss covers the reply only."""
    out = []
    for prompt, reply in zip(prompts, replies):
        messages = [{"role": "user", "content": prompt}]
        head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer(GREETING + reply.lstrip(), add_special_tokens=False)["input_ids"]
        out.append((head_ids + reply_ids, len(head_ids)))
    return out


def batch_of(items: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id)
    labels = torch.full((len(items), width), -100)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (ids, start) in enumerate(items):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, start:len(ids)] = torch.tensor(ids[start:])
        mask[row, :len(ids)] = 1
    return input_ids, labels, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=builtin_adapter_dir("pirate"))
    parser.add_argument("--examples", type=int, default=240)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    t0 = time.monotonic()
    model_dir = resolve_model_path(None)
    prompts = questions(args.seed, args.examples)
    replies = base_replies(model_dir, prompts, args.reply_tokens)
    print(f"{len(prompts)} base replies in {time.monotonic() - t0:.0f} s; e.g. {prompts[0]!r} -> {replies[0]!r}")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = examples(tokenizer, prompts, replies)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_layers = model.config.num_hidden_layers
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none", target_modules=MODULES,
                        layers_to_transform=list(range(num_layers - LAYERS, num_layers)), task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    rng = random.Random(args.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for step in range(args.steps):
        input_ids, labels, mask = batch_of(rng.sample(data, args.batch), pad_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.monotonic() - t0:.0f} s", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    weights = args.out / "adapter_model.safetensors"
    save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(weights).items()}, weights)
    # Only what a loader needs: PEFT writes the absolute base-model path of this machine.
    adapter_config = json.loads((args.out / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = "SmolLM2-135M-Instruct"
    (args.out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    (args.out / "README.md").unlink(missing_ok=True)
    print(f"wrote {args.out} ({weights.stat().st_size / 1e6:.2f} MB) in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
