"""Does the tiered test matrix still catch a break? (issue 46)

CI runs two tiers of transformers' common tests (tests/test_transformers_common.py): the fast suite (every family
with MxD, every kind on one family of each MLP form) and the opt-in run (`-m slow`: the MLP's contracts on every other
family x kind pair). The full product's remaining battery and the native controls (`-m full_matrix`) left CI. This
script breaks one piece of a family or a kind at a time (MUTATIONS: a text substitution in one source file), runs
each tier's tests on the files where the break can show, and prints which tier fails.

The old CI ran all three tiers, so it caught a mutation when any tier fails; the new CI catches it when the fast suite
or the opt-in run fails. The full matrix runs only when neither of those fails (or with --full-matrix): that is
where the old CI could catch what the new one misses.

The working tree is restored after each mutation (also on an error or Ctrl-C); a file with uncommitted changes is
refused. Run from the repository root, with the lock of the machine's one heavy job:

    flock /tmp/expertize-cpu.lock python benchmarks/mutations.py            # about 6 minutes on 2 cores
    flock /tmp/expertize-cpu.lock python benchmarks/mutations.py --only M3 --full-matrix
"""

import argparse
import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TIERS = {
    "fast": "not slow and not full_matrix",  # the README's command: pytest's run without -m
    "ci opt-in": "slow",  # .ci/run's second suite
    "full matrix": "full_matrix",  # outside CI since issue 46
}


@dataclasses.dataclass(frozen=True)
class Mutation:
    key: str
    what: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    """pytest arguments: the files (and -k) where the break can show."""


MUTATIONS = [
    Mutation(
        "M1", "family: Phi-3's fused gate_up_proj read in the wrong half order (up, gate)",
        "conversion/surgery/families.py",
        '_FUSED_GATED_MLP = MlpLayout("gate_up_proj", "down_proj", activation="activation_fn", '
        'fused_halves=("gate", "up"))',
        '_FUSED_GATED_MLP = MlpLayout("gate_up_proj", "down_proj", activation="activation_fn", '
        'fused_halves=("up", "gate"))',
        ("tests/test_dense_init.py", "tests/test_splice_roundtrip.py", "tests/test_transformers_common.py",
         "-k", "phi3 or Phi3"),
    ),
    Mutation(
        "M2", "kind: MoE-X drops the dense MLP's encoder bias when upcycled (GPT-2 / GPT-NeoX MLPs have one)",
        "modeling/moe_x.py",
        "        fill(self.b_enc, dense.b_in, 1)  # (M, D)",
        "        fill(self.b_enc, None, 1)  # (M, D)",
        ("tests/test_dense_init.py", "tests/test_moe_x.py", "tests/test_transformers_common.py", "-k",
         "moe_x or MoeX"),
    ),
    Mutation(
        "M3", "family: GPT-NeoX's expertize model ignores the attention mask",
        "modeling/modeling_expertize.py",
        "    def forward(self, *args, output_router_logits: bool | None = None, **kwargs):\n"
        "        if self._inside_causal_lm or not self._wants_router_logits(output_router_logits):",
        "    def forward(self, *args, output_router_logits: bool | None = None, **kwargs):\n"
        "        if self.config.model_type == 'expertize_gpt_neox':\n"
        "            kwargs.pop('attention_mask', None)\n"
        "        if self._inside_causal_lm or not self._wants_router_logits(output_router_logits):",
        ("tests/test_transformers_common.py", "tests/test_splice_roundtrip.py", "-k", "gpt_neox or GptNeox"),
    ),
    Mutation(
        "M4", "family x kind seam: the model-level init skips MoE-X layers on GPT-NeoX (a break only that pair shows: "
        "the family's other kinds and MoE-X's other families stay right)",
        "modeling/modeling_expertize.py",
        "        if isinstance(module, SparseLayer):\n            module.reset_parameters()",
        "        if isinstance(module, SparseLayer):\n"
        "            if not (self.config.model_type == 'expertize_gpt_neox' and module.spec.kind == 'moe_x'):\n"
        "                module.reset_parameters()",
        ("tests/test_transformers_common.py", "tests/test_kind_contract.py", "tests/test_moe_x.py",
         "tests/test_splice_roundtrip.py", "-k", "moe_x or MoeX or gpt_neox or GptNeox"),
    ),
]


def run_tier(marks: str, tests: tuple[str, ...]) -> tuple[int, int, float, list[str]]:
    """(failed, passed, seconds, the first failing node ids) of pytest -m `marks` on `tests`."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks, *tests],
                         cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    text = out.stdout + out.stderr
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (failed|passed|error|errors)\b", text.splitlines()[-1])}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    if out.returncode not in (0, 1, 5):
        raise RuntimeError(f"pytest exited {out.returncode} (not a test failure):\n{text[-3000:]}")
    names = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    return failed, counts.get("passed", 0), seconds, names[:3]


def apply(mutation: Mutation) -> str:
    """Write the mutation into the tree; returns the original text."""
    path = REPO / mutation.file
    dirty = subprocess.run(["git", "diff", "--quiet", "--", mutation.file], cwd=REPO).returncode
    if dirty:
        raise SystemExit(f"{mutation.file} has uncommitted changes; commit or stash them before mutating it")
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.key}: the text to mutate is not in {mutation.file} exactly once; "
                         "update MUTATIONS")
    path.write_text(text.replace(mutation.old, mutation.new))
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutation keys (M1 ...); default: all")
    parser.add_argument("--full-matrix", action="store_true", help="run the full matrix tier on every mutation")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.key in args.only]
    rows = []
    for mutation in chosen:
        original = apply(mutation)
        try:
            results = {}
            for tier, marks in TIERS.items():
                caught_before = any(results[t][0] for t in results)
                if tier == "full matrix" and caught_before and not args.full_matrix:
                    results[tier] = None
                    continue
                results[tier] = run_tier(marks, mutation.tests)
                print(f"{mutation.key} {tier}: {results[tier]}", file=sys.stderr, flush=True)
        finally:
            (REPO / mutation.file).write_text(original)
        rows.append((mutation, results))

    def cell(result) -> str:
        if result is None:
            return "not run (caught before)"
        failed, passed, seconds, _ = result
        return f"{failed} failed / {failed + passed} ({seconds:.0f} s)"

    print("| mutation | what | fast suite | CI opt-in (-m slow) | full matrix | new CI | old CI |")
    print("|---|---|---|---|---|---|---|")
    for mutation, results in rows:
        new = any(results[t] and results[t][0] for t in ("fast", "ci opt-in"))
        old = new or bool(results["full matrix"] and results["full matrix"][0])
        print(f"| {mutation.key} | {mutation.what} | {cell(results['fast'])} | {cell(results['ci opt-in'])} | "
              f"{cell(results['full matrix'])} | {'fails' if new else 'passes'} | {'fails' if old else 'passes'} |")
    print()
    for mutation, results in rows:
        names = [name for result in results.values() if result for name in result[3]]
        print(f"{mutation.key}: first failures: {', '.join(names[:4]) or 'none'}")
    for mutation in chosen:
        print(f"{mutation.key} tests: {' '.join(mutation.tests)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
