"""Time of `expertize tasks` against the number of documents (CPU): reading, cloze items, and the whole command.

    EXPERTIZE_DATA=/path/to/shared/data python benchmarks/tasks_scaling.py [--corpus FILE] [--model runs/quickstart]

Rows: the first 512, 1,024, 2,048 and 4,096 documents of the corpus (default: the 4,096 TinyStories samples of the
shared data), each a fresh `write_tasks_from_text` into a temporary folder (reading the file, cloze items, writing the
files); with --model the items are also fitted to that model's context (its tokenizer counts every unit once, in a
batch). A quadratic step shows as 4x per doubling of the documents; a linear one as 2x.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

from expertize.conversion.harness.offline_tasks import model_token_limit, read_documents, write_task_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    data = Path(os.environ.get("EXPERTIZE_DATA", "../shared/data"))
    parser.add_argument("--corpus", default=str(data / "corpora" / "stories260k_samples.txt"))
    parser.add_argument("--model", help="fit the items to this model folder's context")
    args = parser.parse_args()
    fit = {}
    if args.model:
        count, limit = model_token_limit(args.model)
        fit = {"count_tokens": count, "max_tokens": limit}
    documents = read_documents(args.corpus)
    print(f"corpus {args.corpus}: {len(documents):,} documents" + (f"; fitted to {args.model}" if fit else ""))
    print("| documents | cloze items | seconds | vs previous row |\n|---:|---:|---:|---:|")
    previous = None
    for n in (512, 1024, 2048, 4096):
        if n > len(documents):
            break
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            write_task_folder(documents[:n], out, "bench", **fit)
            seconds = time.perf_counter() - start
            items = sum(1 for _ in open(Path(out) / "bench_cloze.jsonl", encoding="utf-8"))
        ratio = f"{seconds / previous:.1f}x" if previous else ""
        print(f"| {n:,} | {items:,} | {seconds:.2f} | {ratio} |")
        previous = seconds


if __name__ == "__main__":
    main()
