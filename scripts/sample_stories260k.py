"""Write expertize/assets/stories260k_samples.txt: complete stories sampled from the shipped stories260k, one per line.

stories260k (llama2.c) was trained on TinyStories read with BOS before every story and no EOS, so it ends a story by
predicting BOS. The first version of this file held samples cut at a fixed length (245-255 tokens, mid-word), so the
BOS the recipes' reading inserts after each one cost the base 14 nats (the reading check warned about the shipped
recipes, issue 50): a truncated document costs that under any reading. Here every story is sampled from BOS at
temperature 1 (llama2.c's `run.c` default) until the model itself samples BOS, and a story that reaches the model's
context (512 tokens) without ending is dropped, so every line is a story the model finished.

    python scripts/sample_stories260k.py [--stories 4096] [--seed 0] [--out expertize/assets/stories260k_samples.txt]

About a minute on 2 CPU cores. The output is deterministic for a seed and a torch version.
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ASSETS = Path(__file__).resolve().parent.parent / "expertize" / "assets"


def sample(model, bos: int, batch: int, max_tokens: int) -> list[list[int] | None]:
    """`batch` stories from BOS: each the tokens after BOS up to (not including) the BOS the model sampled to end it,
    or None when it did not end it within its context of `max_tokens`."""
    start = torch.full((batch, 1), bos, dtype=torch.long)  # (B, 1)
    with torch.no_grad():
        out = model.generate(start, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_length=max_tokens,
                             eos_token_id=bos, pad_token_id=0)  # (B, <= max_tokens)
    stories = []
    for row in out[:, 1:].tolist():
        stories.append(row[: row.index(bos)] if bos in row else None)
    return stories


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stories", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", default=str(ASSETS / "stories260k_samples.txt"))
    args = p.parse_args()
    folder = ASSETS / "stories260k"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    bos, context = tokenizer.bos_token_id, model.config.max_position_embeddings
    torch.manual_seed(args.seed)
    stories, dropped = [], 0
    while len(stories) < args.stories:
        for story in sample(model, bos, args.batch, context):
            if story is None:
                dropped += 1
                continue
            text = tokenizer.decode(story).strip().replace("\n", " ")
            if text:
                stories.append(text)
    stories = stories[: args.stories]
    Path(args.out).write_text("\n".join(stories) + "\n", encoding="utf-8")
    print(f"wrote {len(stories)} complete stories to {args.out} ({dropped} unfinished at {context} tokens dropped)")


if __name__ == "__main__":
    main()
