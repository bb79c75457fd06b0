"""Regenerate the offline lm-eval tasks shipped in conversion/harness/lm_eval_tasks/ (a development-time script).

    stories:      NEW stories sampled from a TinyStories-style model (seeded; not the corpus the recipes distil on)
    shakespeare:  speeches from the last 10% (by characters) of tinyshakespeare, the part tiny-gpt2-shakespeare was
                  not trained on (public-domain text)

Usage (the data folder is only read here, never by the library):
    python scripts/make_offline_tasks.py --stories-model DATA/models/stories260k \
        --shakespeare-text DATA/corpora/tinyshakespeare.txt
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from expertize.conversion.harness.offline_tasks import bundled_tasks_dir, split_documents, split_units, write_task_folder

STORIES, STORY_SEED, STORY_TOKENS = 48, 1234, 256
SPEECHES, SHAKESPEARE_HELD_OUT = 120, 0.9


def sample_stories(model_dir: str, n: int, seed: int, max_new_tokens: int) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    bos = torch.full((n, 1), tokenizer.bos_token_id)  # (n, 1): every story starts from BOS alone
    with torch.no_grad():
        out = model.generate(
            input_ids=bos, attention_mask=torch.ones_like(bos), do_sample=True, temperature=1.0, top_k=0,
            max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id,
        )  # (n, 1 + new)
    # A story cut by the token limit ends mid-sentence: keep its complete sentences only.
    return [" ".join(split_units(tokenizer.decode(row, skip_special_tokens=True), "sentence")) for row in out]


def shakespeare_speeches(path: str, n: int) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    held_out = text[int(len(text) * SHAKESPEARE_HELD_OUT) :]
    held_out = held_out[held_out.index("\n\n") + 2 :]  # start at a speech boundary
    return split_documents(held_out, "blank")[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stories-model", required=True)
    parser.add_argument("--shakespeare-text", required=True)
    args = parser.parse_args()
    out = bundled_tasks_dir()
    stories = sample_stories(args.stories_model, STORIES, STORY_SEED, STORY_TOKENS)
    write_task_folder(
        stories, out, "expertize_stories", source=f"{STORIES} stories sampled from stories260K (seed {STORY_SEED})",
        unit="sentence", tags=["expertize_offline"], overwrite=True,
    )
    speeches = shakespeare_speeches(args.shakespeare_text, SPEECHES)
    write_task_folder(
        speeches, out, "expertize_shakespeare", source="held-out speeches of tinyshakespeare (public domain)",
        unit="line", tags=["expertize_offline"], overwrite=True,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
