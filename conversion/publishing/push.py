"""`expertize push MODEL_DIR --repo-id USER/NAME`: publish a saved expertize model folder on the Hugging Face Hub.

    token check (no network) ─► folder check (config.json with an expertize auto_map, weights, remote code)
        ─► HfApi.create_repo(exist_ok=False); on 409 (exists): inspect it, refuse a repo holding another kind of model
        ─► optional branch (--revision, created from main when missing)
        ─► stage the files to upload (hard links) + README.md re-rendered with the real repo id
        ─► HfApi.upload_folder(stage): one commit

Never `model.push_to_hub()`: it replaces README.md with a generic card.

What is uploaded: the model, not the workbench, by an allow-list (`is_model_file`): what a model folder holds
and nothing else. At the top level the model (config.json, generation_config.json, the safetensors weights and the
shards their index names), the remote code (the bundle's files), the tokenizer's files (`TOKENIZER_FILES`), the card
and the records (metrics.json, provenance.json, recipe*.yaml, train_log.jsonl, heal_log.jsonl); and the
`MODEL_SUBFOLDERS` (plots/, lm_eval/'s results_*.json and comparison files). Everything else is left out and named
(`left_out`): reports written into the folder, at its top level (`expertize inspect --output MODEL_DIR`'s
layer_<i>.json and index.html, `expertize specialize --json MODEL_DIR/spec.json`) or in a subfolder (an `inspect/`
report, a tracker's `tracking/`); `include_reports=True` uploads them too. Never uploaded: training leftovers and
local-only files (`EXCLUDED`: `checkpoint/`, staging and hidden files such as `.final.*`, `.*.tmp` and the run lock,
`__pycache__/`), and lm-eval's per-document logs `samples_*.jsonl` unless `include_samples=True`.
`expertize push --dry-run` lists exactly the files `files_to_upload` chooses (the staged upload's), offline.

Local paths stay local: the uploaded copies of the records (metrics.json, provenance.json, recipe*.yaml, lm_eval/
JSON and Markdown) name local files `<local>/NAME` and a base model from the Hub by its id (local_paths.py); the
folder's own files keep the real paths. A machine without the network (HF_HUB_OFFLINE, no connection) gets a
PushError saying so, not a traceback.
"""

import contextlib
import fnmatch
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError

from ..errors import ExpertizeError
from .local_paths import public_text
from .card import UNKNOWN_LICENSE
from .model_folder import (
    ModelFolderError, card_license, check_model_folder, read_provenance, recorded_base_model, render_card_from_folder,
)
from .run_folder import CHECKPOINT, HEAL_LOG, LM_EVAL, METRICS, MODEL_CARD, PLOTS, PROVENANCE, TRAIN_LOG

__all__ = [
    "EXCLUDED", "MODEL_SUBFOLDERS", "PushError", "TOKENIZER_FILES", "dry_run", "files_to_upload", "is_model_file",
    "left_out", "license_warning", "push_model",
]

EXCLUDED = (f"{CHECKPOINT}/*", ".*", "*/.*", "__pycache__/*", "*/__pycache__/*", "*.tmp", "*.pyc")
"""Relative-path patterns never uploaded (fnmatch; "*" also matches "/")."""
SAMPLES = "*samples_*.jsonl"
MODEL_SUBFOLDERS = (PLOTS, LM_EVAL)
"""The subfolders that belong to the published model (its card shows them); any other is a report, left out unless
asked for (`include_reports`)."""
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
RECORD_FILES = (MODEL_CARD, METRICS, PROVENANCE, TRAIN_LOG, HEAL_LOG, "recipe*.yaml", "recipe*.yml")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "chat_template.json",
)
"""What `save_pretrained` of transformers' tokenizers writes (fast and slow, BPE, WordPiece, SentencePiece)."""


class PushError(ExpertizeError, ValueError):
    """The push cannot go ahead (no token, name clash, ...); the message says why and what to do."""


def _code_files() -> frozenset[str]:
    """The remote-code files a saved model carries: the bundle's modules (expertize.modeling)."""
    import expertize.modeling

    return frozenset(p.name for p in Path(expertize.modeling.__file__).parent.glob("*.py") if p.name != "__init__.py")


def _weight_shards(root: Path) -> frozenset[str]:
    """The shard files a sharded checkpoint's index names."""
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        return frozenset()
    try:
        return frozenset(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
    except (OSError, ValueError):
        return frozenset()


def is_model_file(rel: str, *, shards: frozenset[str] = frozenset(), code: frozenset[str] | None = None) -> bool:
    """Whether the relative path `rel` is part of a model folder (the allow-list): a file of `MODEL_SUBFOLDERS`, or a
    top-level model, weight shard (`shards`), remote-code (`code`, default the bundle's), tokenizer or record file."""
    if "/" in rel:
        return rel.split("/", 1)[0] in MODEL_SUBFOLDERS
    code = _code_files() if code is None else code
    allowed = (*MODEL_FILES, *TOKENIZER_FILES, *RECORD_FILES)
    return rel in shards or rel in code or any(fnmatch.fnmatch(rel, pattern) for pattern in allowed)


def _candidates(root: Path, include_samples: bool) -> list[str]:
    """Every file below `root` that may ever be uploaded (not `EXCLUDED`), sorted relative POSIX paths."""
    excluded = EXCLUDED + (() if include_samples else (SAMPLES,))
    return [rel for path in sorted(root.rglob("*")) if path.is_file()
            and not any(fnmatch.fnmatch(rel := path.relative_to(root).as_posix(), p) for p in excluded)]


def files_to_upload(
    model_dir: str | os.PathLike, *, include_samples: bool = False, include_reports: bool = False
) -> list[str]:
    """Relative paths (sorted, POSIX) of the files `push_model` uploads from `model_dir`: the model folder's own
    files (`is_model_file`), or with `include_reports` every file that is not `EXCLUDED`."""
    root = Path(model_dir)
    shards, code = _weight_shards(root), _code_files()
    return [rel for rel in _candidates(root, include_samples)
            if include_reports or is_model_file(rel, shards=shards, code=code)]


def left_out(model_dir: str | os.PathLike, *, include_samples: bool = False) -> dict[str, int]:
    """What `push_model` leaves out by default because it is not part of the model (reports, notes, anything else):
    top-level files by name, other subfolders as "NAME/", with their sizes in bytes."""
    root = Path(model_dir)
    kept = set(files_to_upload(root, include_samples=include_samples))
    sizes: dict[str, int] = {}
    for rel in _candidates(root, include_samples):
        if rel not in kept:
            name = rel.split("/", 1)[0] + "/" if "/" in rel else rel
            sizes[name] = sizes.get(name, 0) + (root / rel).stat().st_size
    return sizes



def _card_is_ours(readme: Path) -> bool:
    """True when README.md is missing or is an expertize card (tag "expertize"): those are (re)rendered on push;
    a card the user wrote is uploaded as it is."""
    if not readme.is_file():
        return True
    from huggingface_hub import ModelCard

    return "expertize" in (ModelCard.load(readme).data.tags or [])


def _is_record(rel: str) -> bool:
    """The files whose uploaded copy has its local paths replaced: expertize's own records (never the tokenizer
    or config files, whose strings are data)."""
    if rel in (METRICS, PROVENANCE) or (rel.startswith("recipe") and rel.endswith((".yaml", ".yml"))):
        return True
    return rel.startswith(f"{LM_EVAL}/") and rel.endswith((".json", ".md")) and "samples_" not in rel


def _local_roots(model_dir: Path) -> tuple[list[str], dict[str, str]]:
    """(local folders whose paths must not leave the machine, local base path -> its Hub id when recorded)."""
    roots: list[str] = [str(model_dir.resolve())]
    hub_ids = {}
    base = recorded_base_model(model_dir)
    if base is not None and os.path.isabs(base):
        roots.append(base)
        hub_id = read_provenance(model_dir).get("base_model_hub_id")
        if hub_id:
            hub_ids[base] = str(hub_id)
    return roots, hub_ids


def _stage(model_dir: Path, stage: Path, repo_id: str | None, include_samples: bool, include_reports: bool) -> None:
    """Hard-link (or copy across filesystems) the files to upload into `stage`; write public copies of the records
    (local paths replaced); re-render an expertize card with the real repo id (its loading snippet and model-index
    name), or render one when the folder has none."""
    roots, hub_ids = _local_roots(model_dir)
    for rel in files_to_upload(model_dir, include_samples=include_samples, include_reports=include_reports):
        target = stage / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        public = public_text(model_dir / rel, roots, hub_ids) if _is_record(rel) else None
        if public is not None:
            target.write_text(public, encoding="utf-8", newline="")
            continue
        try:
            os.link(model_dir / rel, target)
        except OSError:
            shutil.copy2(model_dir / rel, target)
    if _card_is_ours(model_dir / MODEL_CARD):
        try:
            card = render_card_from_folder(model_dir, repo_id=repo_id)
        except ModelFolderError:
            card = None  # no base model recorded: the folder's card (if any) goes up as it is
        if card is not None:
            (stage / MODEL_CARD).unlink(missing_ok=True)  # a hard link: never write through it
            (stage / MODEL_CARD).write_text(str(card), encoding="utf-8", newline="")


def _existing_content(api: HfApi, repo_id: str, revision: str | None) -> str:
    """"empty", "expertize" or the model_type found in an existing repo (at `revision`)."""
    try:
        files = api.list_repo_files(repo_id, revision=revision)
    except RevisionNotFoundError:
        return "empty"  # the branch does not exist yet: it will be created
    except RepositoryNotFoundError:
        raise PushError(
            f"{repo_id} exists but this token cannot read it (it belongs to someone else, or is private); choose "
            "another --repo-id under your own namespace"
        ) from None
    if "config.json" not in files:
        meaningful = [f for f in files if f not in (".gitattributes", MODEL_CARD)]
        return "empty" if not meaningful else f"files without a config.json ({', '.join(meaningful[:5])})"
    config = json.loads(Path(api.hf_hub_download(repo_id, "config.json", revision=revision)).read_text("utf-8"))
    model_type = str(config.get("model_type", ""))
    return "expertize" if model_type.startswith("expertize_") else f"a {model_type or 'model'!r} model"


def _create_repo(api: HfApi, repo_id: str, *, private: bool, revision: str | None) -> None:
    try:
        api.create_repo(repo_id, private=private, exist_ok=False, repo_type="model")
        return
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status in (401, 403):
            raise PushError(
                f"the Hub refused to create {repo_id} (HTTP {status}): the token cannot write to namespace "
                f"{repo_id.split('/')[0]!r}; use your own user or an organisation you can write to, and a token "
                "with write access"
            ) from None
        if status != 409:
            raise
    # 409: the repository already exists.
    content = _existing_content(api, repo_id, revision)
    if content not in ("empty", "expertize"):
        where = f"branch {revision!r} of {repo_id}" if revision else repo_id
        raise PushError(
            f"{where} already exists and holds {content}, not an expertize model; pushing would mix two models. "
            "Choose another --repo-id, or push to a new branch with --revision NAME"
        )


def _is_network_error(error: BaseException) -> bool:
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    # httpx / requests transport errors (no route, DNS, TLS, timeouts), whichever HTTP client the Hub library uses.
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & {"TransportError", "ConnectError", "ConnectTimeout", "NetworkError", "Timeout"})


@contextlib.contextmanager
def _network(repo_id: str) -> Iterator[None]:
    """Hub calls: offline mode and unreachable networks become a PushError naming the fix."""
    try:
        yield
    except OfflineModeIsEnabled:
        raise PushError(
            f"cannot push to {repo_id}: offline mode is on (HF_HUB_OFFLINE is set); unset HF_HUB_OFFLINE (e.g. "
            "`HF_HUB_OFFLINE=0 expertize push ...`) on a machine that can reach huggingface.co"
        ) from None
    except Exception as e:
        if not _is_network_error(e):
            raise
        raise PushError(
            f"cannot reach the Hugging Face Hub to push {repo_id} ({type(e).__name__}: {e}); check the network "
            "connection (or HF_ENDPOINT) and run the same command again"
        ) from None


def _check_repo_id(repo_id: str) -> None:
    if "/" not in repo_id or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise PushError(f"--repo-id {repo_id!r}: expected USER/NAME (or ORG/NAME), e.g. alice/gpt2-mxd-l8")


def dry_run(
    model_dir: str | os.PathLike, repo_id: str | None = None, *, include_samples: bool = False,
    include_reports: bool = False,
) -> dict[str, int]:
    """What `push_model` would upload, relative path -> bytes (sorted): the folder staged exactly as a push stages it
    (the allow-listed files, the public copies of the records, the card rendered for `repo_id`), then listed. Offline:
    no token, no network; the staging folder (hidden, inside `model_dir`) is removed."""
    model_dir = Path(model_dir)
    if repo_id is not None:
        _check_repo_id(repo_id)
    check_model_folder(model_dir)
    with tempfile.TemporaryDirectory(prefix=".push.", dir=model_dir) as tmp:
        _stage(model_dir, Path(tmp), repo_id, include_samples, include_reports)
        files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file()}
    return dict(sorted(files.items()))


def license_warning(model_dir: str | os.PathLike) -> str | None:
    """The warning push gives while the card's license is unknown (None once it is set)."""
    if card_license(model_dir) is not None:
        return None
    return (
        f"the model card's license is unknown (license: {UNKNOWN_LICENSE}): the base model's license governs this "
        f"derived model; set `license:` in {Path(model_dir) / MODEL_CARD}'s metadata (push keeps it)"
    )


def push_model(
    model_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    include_samples: bool = False,
    include_reports: bool = False,
    commit_message: str | None = None,
) -> str:
    """Upload `model_dir` to the Hub model repo `repo_id` (created when missing); returns the commit URL.

    `revision` pushes to that branch (created from main when missing) instead of main. `token` defaults to the
    logged-in token (`hf auth login` or HF_TOKEN); it is checked before anything touches the network.
    `include_reports`: also upload what is not part of the model (reports at the top level or in subfolders).
    """
    model_dir = Path(model_dir)
    _check_repo_id(repo_id)
    token = token or get_token()
    if not token:
        raise PushError(
            "no Hugging Face token: log in with `hf auth login`, set HF_TOKEN, or pass --token (a token with write "
            "access, from https://huggingface.co/settings/tokens)"
        )
    check_model_folder(model_dir)
    api = HfApi(token=token)
    with _network(repo_id):
        _create_repo(api, repo_id, private=private, revision=revision)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
    # Staged inside the folder (same filesystem: hard links work; hidden: never uploaded itself).
    with tempfile.TemporaryDirectory(prefix=".push.", dir=model_dir) as tmp, _network(repo_id):
        _stage(model_dir, Path(tmp), repo_id, include_samples, include_reports)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=tmp,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or f"Upload {model_dir.name} with expertize",
        )
    return str(getattr(commit, "commit_url", commit))
