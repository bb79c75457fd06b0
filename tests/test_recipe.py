"""Recipes: strict loading, overrides, env vars, layer resolution, and every shipped YAML."""

import re
from pathlib import Path

import pytest
import yaml
from transformers import AutoConfig

from expertize.conversion.recipe import (
    LayerConfig,
    Recipe,
    RecipeError,
    load_recipe,
    recipe_from_dict,
    recipe_to_dict,
    resolve_layer_spec,
    resolve_layers,
    save_recipe,
)
from expertize.conversion.recipe.layer_config import DEFAULT_MATCH_TRANSCODER
from expertize.modeling import FAMILIES, MlpShape, MxdSpec, SkipTranscoderSpec, TranscoderSpec
from tests.conftest import shared_data_dir

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SHIPPED = sorted(RECIPES.rglob("*.yaml"))

# The MLPs and depths of the base models the shipped recipes name (no download needed).
BASE_MODELS = {
    "gpt2": (MlpShape(768, 3072, "gelu_new", False), 12),
    "EleutherAI/pythia-410m": (MlpShape(1024, 4096, "gelu", False), 24),
    "EleutherAI/pythia-1.4b": (MlpShape(2048, 8192, "gelu", False), 24),
    "meta-llama/Llama-3.2-3B": (MlpShape(3072, 8192, "silu", True), 28),
    "tiny-gpt2-shakespeare": (MlpShape(128, 512, "gelu_new", False), 4),
    "stories260k": (MlpShape(64, 172, "silu", True), 5),
    "google/gemma-2-2b": (MlpShape(2304, 9216, "gelu_pytorch_tanh", True), 26),
    "google/gemma-3-1b-pt": (MlpShape(1152, 6912, "gelu_pytorch_tanh", True), 26),
    "Qwen/Qwen3-0.6B-Base": (MlpShape(1024, 3072, "silu", True), 28),
    "allenai/OLMo-2-0425-1B": (MlpShape(2048, 8192, "silu", True), 16),
}
GPT2_SHAPE = BASE_MODELS["gpt2"][0]
LLAMA_SHAPE = BASE_MODELS["meta-llama/Llama-3.2-3B"][0]

# MxD paper Table 2: N of an MxD parameter-matched to a 32x transcoder.
PAPER_NUM_EXPERTS = {"gpt2": 21490, "pythia410m": 28658, "pythia1.4b": 57330, "llama3.2-3b": 86015}


@pytest.fixture
def data_dir(monkeypatch) -> Path:
    """EXPERTIZE_DATA for the shipped recipes: the real data folder (tests/data, or EXPERTIZE_TEST_DATA)."""
    root = shared_data_dir()
    monkeypatch.setenv("EXPERTIZE_DATA", str(root))
    return root


def minimal(**sections) -> dict:
    """Smallest valid recipe tree (a hub dataset, so that no file has to exist); `sections` replace top-level keys."""
    tree = {
        "base_model": "gpt2",
        "layers": [8],
        "layer": {"kind": "mxd", "k": 32, "match_transcoder": 32},
        "data": {"source": "hub", "name": "Skylion007/openwebtext"},
        "output_dir": "runs/test",
    }
    tree.update(sections)
    return tree


def write(tmp_path: Path, tree_or_text, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    text = tree_or_text if isinstance(tree_or_text, str) else yaml.safe_dump(tree_or_text, sort_keys=False)
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------------------------------------------
# Shipped recipes


def test_recipes_are_shipped():
    names = {p.relative_to(RECIPES).as_posix() for p in SHIPPED}
    assert {"quickstart.yaml", "stories260k-mxd.yaml"} <= names
    for model in ("gpt2-l8", "pythia410m-l15", "pythia1.4b-l12", "llama3.2-3b-l12"):
        for kind in ("mxd", "transcoder", "skip_transcoder"):
            assert f"paper/mxd-{model}-{kind}.yaml" in names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(RECIPES).as_posix())
def test_shipped_recipe_loads_resolves_and_round_trips(path, data_dir, tmp_path):
    text = path.read_text()
    assert text.startswith("#"), "every shipped recipe starts with a header comment"
    assert "expertize upcycle" in text and "--set" in text, "the header gives the launch and an override line"

    recipe = load_recipe(path)
    model_key = recipe.base_model if recipe.base_model in BASE_MODELS else Path(recipe.base_model).name
    shape, num_layers = BASE_MODELS[model_key]
    if (Path(recipe.base_model) / "config.json").is_file():  # real data (EXPERTIZE_TEST_DATA): check the table
        config = AutoConfig.from_pretrained(recipe.base_model)
        fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}
        assert FAMILIES[config.model_type].config_class(**fields).mlp_shape() == shape
        assert config.num_hidden_layers == num_layers
    layers = resolve_layers(recipe, num_layers)
    assert layers and all(0 <= i < num_layers for i in layers)
    spec = resolve_layer_spec(recipe.layer, shape)
    assert spec.kind == recipe.layer.kind and spec.d_in == spec.d_out == shape.d_model

    dumped = tmp_path / "recipe.resolved.yaml"
    save_recipe(recipe, dumped)
    assert load_recipe(dumped) == recipe
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe


@pytest.mark.parametrize("model", sorted(PAPER_NUM_EXPERTS))
def test_paper_recipes_reproduce_table_2(model, data_dir):
    stem = next(p.stem for p in SHIPPED if p.stem.startswith(f"mxd-{model}-l") and p.stem.endswith("-mxd"))
    recipe = load_recipe(RECIPES / "paper" / f"{stem}.yaml")
    shape, _ = BASE_MODELS[recipe.base_model]
    spec = resolve_layer_spec(recipe.layer, shape)
    assert isinstance(spec, MxdSpec)
    assert (spec.num_experts, spec.k, spec.d_hidden) == (PAPER_NUM_EXPERTS[model], 32, shape.d_hidden)
    assert spec.encoder == ("glu" if shape.glu else "mlp")
    for kind, spec_cls in (("transcoder", TranscoderSpec), ("skip_transcoder", SkipTranscoderSpec)):
        baseline = load_recipe(RECIPES / "paper" / f"{stem[: -len('-mxd')]}-{kind}.yaml")
        spec = resolve_layer_spec(baseline.layer, shape)
        assert type(spec) is spec_cls and spec.num_latents == 32 * shape.d_model and spec.k == 32
        # Same data and optimization for the MxD and its baselines (only the layer and the output folder differ).
        assert (baseline.data, baseline.train, baseline.eval) == (recipe.data, recipe.train, recipe.eval)


def test_paper_recipe_settings(data_dir):
    recipe = load_recipe(RECIPES / "paper" / "mxd-gpt2-l8-mxd.yaml")
    assert recipe.base_model == "gpt2" and recipe.layers == [8]
    assert (recipe.data.source, recipe.data.name, recipe.data.split, recipe.data.streaming) == (
        "hub", "Skylion007/openwebtext", "train", True
    )
    assert (recipe.data.train_tokens, recipe.data.context_length) == (480_000_000, 128)
    t = recipe.train
    assert (t.lr, t.weight_decay, t.warmup_steps, t.schedule, t.tokens_per_step, t.precision, t.loss) == (
        1e-4, 0.0, 5000, "constant", 4096, "fp32", "nmse"
    )
    assert resolve_layer_spec(recipe.layer, GPT2_SHAPE).num_experts == 21490


# ----------------------------------------------------------------------------------------------------------------
# Strict loading


def test_unknown_top_level_key_names_file_valid_keys_and_suggestion(tmp_path):
    path = write(tmp_path, minimal(output_dri="runs/x"))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert str(path) in message and "'output_dri'" in message
    assert "did you mean 'output_dir'" in message and "base_model, base_revision" in message


def test_unknown_nested_key_names_dotted_key_and_suggestion(tmp_path):
    path = write(tmp_path, minimal(train={"lr": 1e-3, "warmup_stpes": 10}))
    expected = r"unknown key 'train\.warmup_stpes' \(did you mean 'train\.warmup_steps'\?\)"
    with pytest.raises(RecipeError, match=expected):
        load_recipe(path)
    path = write(tmp_path, minimal(data={"source": "hub", "name": "x", "contex_length": 64}))
    with pytest.raises(RecipeError, match=r"'data\.contex_length'.*did you mean 'data\.context_length'"):
        load_recipe(path)


def test_key_in_the_wrong_section_is_pointed_to_its_section(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown key 'lr' \(did you mean 'train\.lr'\?\)"):
        load_recipe(write(tmp_path, minimal(lr=1e-3)))


@pytest.mark.parametrize(
    "section, value, expected",
    [
        ("train", {"lr": "fast"}, r"train\.lr: expected a number or 'auto', got 'fast' \(str\)"),
        ("train", {"warmup_steps": 1.5}, r"train\.warmup_steps: expected an integer or 'auto', got 1\.5 \(float\)"),
        ("train", {"warmup_steps": True}, r"train\.warmup_steps: expected an integer or 'auto', got True \(bool\)"),
        ("train", {"betas": 0.9}, r"train\.betas: expected a list of numbers, got 0\.9 \(float\); for a single"),
        ("eval", {"histogram": "yes please"}, r"eval\.histogram: expected true or false"),
        ("layer", {"kind": "mxd", "k": "32", "match_transcoder": 32}, r"layer\.k: expected an integer, got '32'"),
        ("data", {"source": "hub", "name": 7}, r"data\.name: expected a string or null, got 7 \(int\)"),
        ("layers", 8, r"layers: expected a list of integers or 'all', got 8 \(int\); for a single item write \[8\]"),
        ("layers", [1, "two"], r"layers\[1\]: expected an integer, got 'two' \(str\)"),
        # A word is not suggested as a one-item list of integers ([ALL]); the word it misspells is.
        ("layers", "ALL", r"layers: .*got 'ALL' \(str\) \(did you mean 'all'\? it is written in lower case\)$"),
        ("layers", "al", r"layers: .*got 'al' \(str\) \(did you mean 'all'\?\)$"),
        ("train", "fast", r"train: expected a section \(a mapping of keys\), got 'fast'"),
    ],
)
def test_bad_types_name_key_value_and_type(tmp_path, section, value, expected):
    path = write(tmp_path, minimal(**{section: value}))
    with pytest.raises(RecipeError, match=expected) as info:
        load_recipe(path)
    assert str(path) in str(info.value)


def test_numbers(tmp_path):
    text = yaml.safe_dump(minimal(), sort_keys=False) + "train:\n  lr: 3e-4\n  grad_clip: 2\n  betas: [0.9, 1e-1]\n"
    recipe = load_recipe(write(tmp_path, text))
    assert recipe.train.lr == 3e-4 and isinstance(recipe.train.lr, float)  # PyYAML alone reads 3e-4 as a string
    assert recipe.train.grad_clip == 2.0 and isinstance(recipe.train.grad_clip, float)  # int where float expected
    assert recipe.train.betas == [0.9, 0.1]
    recipe = recipe_from_dict(minimal(data={"source": "hub", "name": "x", "train_tokens": 4.8e8}))
    assert recipe.data.train_tokens == 480_000_000 and isinstance(recipe.data.train_tokens, int)


def test_choices_are_checked_with_suggestion():
    expected = r"train\.schedule: expected one of 'constant', 'cosine', 'linear', got 'cosin'.*did you mean 'cosine'"
    with pytest.raises(RecipeError, match=expected):
        recipe_from_dict(minimal(train={"schedule": "cosin"}))
    with pytest.raises(RecipeError, match=r"layer\.kind: unknown kind 'mdx' \(did you mean 'mxd'\?\)"):
        recipe_from_dict(minimal(layer={"kind": "mdx", "match_transcoder": 32}))
    with pytest.raises(RecipeError, match=r"dtype: expected one of 'float32', 'bfloat16', 'float16'"):
        recipe_from_dict(minimal(dtype="fp32"))


def test_missing_required_keys_are_named(tmp_path):
    tree = minimal()
    del tree["base_model"], tree["output_dir"]
    path = write(tmp_path, tree)
    with pytest.raises(RecipeError, match=r"missing required key\(s\): base_model .*; output_dir") as info:
        load_recipe(path)
    assert str(path) in str(info.value)
    tree = minimal()
    del tree["data"]
    with pytest.raises(RecipeError, match=r"missing required key\(s\): data"):
        recipe_from_dict(tree)


def test_value_errors_of_sections_name_key_and_file(tmp_path):
    path = write(tmp_path, minimal(train={"lr": -1.0}))
    with pytest.raises(RecipeError, match=rf"{re.escape(str(path))}: train\.lr: must be > 0 or \"auto\", got -1\.0"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"data\.source='hub' needs data\.name"):
        recipe_from_dict(minimal(data={"source": "hub"}))
    with pytest.raises(RecipeError, match=r"data\.paths: no such file 'missing\.txt'"):
        recipe_from_dict(minimal(data={"source": "text", "paths": ["missing.txt"]}))


def test_duplicate_yaml_keys_are_rejected(tmp_path):
    text = yaml.safe_dump(minimal(), sort_keys=False) + "base_model: gpt2-medium\n"
    with pytest.raises(RecipeError, match=r"duplicate key 'base_model'"):
        load_recipe(write(tmp_path, text))


def test_the_first_example_of_docs_recipes_md_parses(tmp_path):
    # The page's own example, read from the page: ${VAR} inside a YAML flow list (`paths: [${EXPERTIZE_ASSETS}/...]`)
    # used to be a YAML syntax error (its braces are flow syntax there).
    page = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text(encoding="utf-8")
    example = re.search(r"```yaml\n(.*?)```", page, re.S)[1]
    assert "paths: [${EXPERTIZE_ASSETS}/" in example
    recipe = load_recipe(write(tmp_path, example))
    assets = Path(__file__).resolve().parents[1] / "expertize" / "assets"
    assert recipe.data.paths == [str(assets / "tinyshakespeare.txt")]
    assert recipe.base_model == str(assets / "tiny-gpt2-shakespeare")
    assert recipe.layer.k == 16 and recipe.data.train_tokens == 200_000 and recipe.output_dir == "runs/quickstart"


def test_variables_inside_flow_collections_and_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("CORPORA", str(tmp_path))
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("text\n")
    text = yaml.safe_dump(minimal(), sort_keys=False).replace(
        "data:\n  source: hub\n  name: Skylion007/openwebtext\n",
        "data: {source: text, paths: [${CORPORA}/a.txt, ${CORPORA}/b.txt]}\n",
    )
    assert load_recipe(write(tmp_path, text)).data.paths == [f"{tmp_path}/a.txt", f"{tmp_path}/b.txt"]
    recipe = recipe_from_dict(minimal(), ["data={source: text, paths: [${CORPORA}/a.txt]}",
                                          "data.paths=[${CORPORA}/b.txt]"])
    assert recipe.data.paths == [f"{tmp_path}/b.txt"]
    # Quoted, and in a block list, as before; an error message shows the ${VAR} as written.
    assert recipe_from_dict(minimal(), ['data={source: text, paths: ["${CORPORA}/a.txt"]}']).data.paths == [
        f"{tmp_path}/a.txt"]
    with pytest.raises(RecipeError, match=r"(?s)not valid YAML: .*\[\$\{CORPORA\}/a\.txt"):
        recipe_from_dict(minimal(), ["data.paths=[${CORPORA}/a.txt"])


def test_yaml_merge_keys(tmp_path):
    # A sweep's variants share a layer section through an anchor and a merge key; their own keys win.
    text = yaml.safe_dump(minimal(), sort_keys=False).replace(
        "layer:\n  kind: mxd\n  k: 32\n  match_transcoder: 32\n",
        "layer: &base\n  kind: mxd\n  k: 32\n  match_transcoder: 32\n",
    ) + ("variants:\n  - {name: k8, layer: {<<: *base, k: 8}}\n"
         "  - name: k16\n    layer:\n      <<: *base\n      k: 16\n")
    recipe = load_recipe(write(tmp_path, text))
    assert [(v.name, v.layer) for v in recipe.variants] == [
        ("k8", {"kind": "mxd", "k": 8, "match_transcoder": 32}),
        ("k16", {"kind": "mxd", "k": 16, "match_transcoder": 32}),
    ]
    # A key repeated in the mapping itself is still a duplicate (not one overriding a merged key).
    with pytest.raises(RecipeError, match=r"duplicate key 'k' \(first at line"):
        load_recipe(write(tmp_path, text.replace("{<<: *base, k: 8}", "{<<: *base, k: 8, k: 4}")))


def test_empty_and_commented_out_sections(tmp_path):
    with pytest.raises(RecipeError, match="the recipe is empty"):
        load_recipe(write(tmp_path, "# nothing yet\n"))
    text = yaml.safe_dump(minimal(), sort_keys=False) + "eval:\n  # batch_sequences: 8\n"
    assert load_recipe(write(tmp_path, text)).eval == recipe_from_dict(minimal()).eval


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


# ----------------------------------------------------------------------------------------------------------------
# Overrides and environment variables


def test_overrides_are_applied(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative data paths are relative to the working directory
    (tmp_path / "a.txt").write_text("hello\n")
    path = write(tmp_path, minimal())
    recipe = load_recipe(
        path,
        [
            "train.lr=3e-4",
            "layers=[2,3]",
            "data.source=text",
            "data.name=null",
            "data.paths=[a.txt]",
            "layer.options.random_k=true",
            "eval.lm_eval_tasks=[hellaswag, arc_easy]",
            "output_dir=runs/other",
        ],
    )
    assert recipe.train.lr == 3e-4
    assert recipe.layers == [2, 3]
    assert (recipe.data.source, recipe.data.paths) == ("text", ["a.txt"])
    assert recipe.layer.options == {"random_k": True}
    assert recipe.eval.lm_eval_tasks == ["hellaswag", "arc_easy"]
    assert recipe.output_dir == "runs/other"
    assert resolve_layer_spec(recipe.layer, GPT2_SHAPE).random_k is True


def test_override_creates_an_absent_section():
    recipe = recipe_from_dict(minimal(), ["eval.batch_sequences=4", "layers=all"])
    assert recipe.eval.batch_sequences == 4 and recipe.layers == "all"


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "train.lrr=1e-3",
            r"--set train\.lrr=1e-3: unknown key 'train\.lrr' \(did you mean 'train\.lr'\?\); "
            r"valid keys under 'train': lr, warmup_steps,",
        ),
        ("trian.lr=1e-3", r"--set trian\.lr=1e-3: unknown key 'trian' \(did you mean 'train'\?\)"),
        ("train.lr.peak=1", r"'train\.lr' is a value, not a section"),
        ("train.lr", r"--set train\.lr: expected KEY=VALUE"),
        ("train.lr=fast", r"--set train\.lr=fast: train\.lr: expected a number or 'auto', got 'fast' \(str\)"),
        ("layers=[0, 0]", r"layers: index 0 appears more than once"),
        ("layer.options.rando_k=true", r"layer\.options\.rando_k: unknown option.*did you mean 'random_k'"),
        # Other tools' names for a key, and their misspellings (before: no did-you-mean, as `lerning_rate` is
        # far from `lr` by spelling); a name close to none of them still gets none.
        ("train.lerning_rate=1e-3", r"unknown key 'train\.lerning_rate' \(did you mean 'train\.lr'\?\); valid keys"),
        ("train.learning_rate=1e-3", r"unknown key 'train\.learning_rate' \(did you mean 'train\.lr'\?\)"),
        ("heal.learning_rate=1e-3", r"unknown key 'heal\.learning_rate' \(did you mean 'heal\.lr'\?\)"),
        ("learning_rate=1e-3", r"unknown key 'learning_rate' \(did you mean 'train\.lr'\?\)"),
        ("train.max_seq_length=64", r"unknown key 'train\.max_seq_length' \(did you mean 'data\.context_length'\?\)"),
        ("layer.top_k=4", r"unknown key 'layer\.top_k' \(did you mean 'layer\.k'\?\)"),
        ("train.rate=1e-3", r"unknown key 'train\.rate'; valid keys under 'train': "),
    ],
)
def test_bad_overrides(override, expected):
    with pytest.raises(RecipeError, match=expected):
        recipe_from_dict(minimal(), [override], source="r.yaml")


def test_env_vars_are_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("EXPERTIZE_DATA", str(tmp_path))
    (tmp_path / "corpus.txt").write_text("text\n")
    recipe = recipe_from_dict(
        minimal(
            base_model="${EXPERTIZE_DATA}/models/m",
            data={"source": "text", "paths": ["${EXPERTIZE_DATA}/corpus.txt"]},
        )
    )
    assert recipe.base_model == f"{tmp_path}/models/m"
    assert recipe.data.paths == [f"{tmp_path}/corpus.txt"]
    assert "${" not in yaml.safe_dump(recipe_to_dict(recipe))  # the resolved dump holds the expanded values


def test_missing_env_var_names_variable_key_and_fix(monkeypatch, tmp_path):
    monkeypatch.delenv("EXPERTIZE_DATA", raising=False)
    path = write(tmp_path, minimal(data={"source": "text", "paths": ["${EXPERTIZE_DATA}/corpora/x.txt"]}))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert str(path) in message and "data.paths[0]" in message
    assert "EXPERTIZE_DATA" in message and "is not set" in message and "export EXPERTIZE_DATA=" in message
    monkeypatch.setenv("EXPERTIZE_DATA", "")
    with pytest.raises(RecipeError, match="EXPERTIZE_DATA, which is empty"):
        load_recipe(path)


# ----------------------------------------------------------------------------------------------------------------
# Layers


def test_resolve_layers():
    assert resolve_layers(recipe_from_dict(minimal(layers="all")), 4) == [0, 1, 2, 3]
    assert resolve_layers(recipe_from_dict(minimal(layers=[3, 1])), 4) == [1, 3]
    expected = r"layers: index 12 is out of range; gpt2 has 12 layers \(valid indices 0\.\.11\)"
    with pytest.raises(RecipeError, match=expected):
        resolve_layers(recipe_from_dict(minimal(layers=[2, 12])), 12)


@pytest.mark.parametrize(
    "layers, expected",
    [([], r"layers: empty"), ([1, 1], r"layers: index 1 appears more than once"), ([-1], r"indices count from 0")],
)
def test_bad_layer_lists(layers, expected):
    with pytest.raises(RecipeError, match=expected):
        recipe_from_dict(minimal(layers=layers))


# ----------------------------------------------------------------------------------------------------------------
# The sparse layer spec


def test_resolve_gpt2_like_shape():
    # MxD's dense hidden code defaults to half the MLP's width (3072 / 2), not the paper's full width
    spec = resolve_layer_spec(LayerConfig(kind="mxd", k=16, num_experts=1000), GPT2_SHAPE)
    assert spec == MxdSpec(d_in=768, d_out=768, d_hidden=1536, num_experts=1000, k=16, encoder="mlp",
                           activation="gelu_new")
    # μMoE keeps the MLP's width
    assert resolve_layer_spec(LayerConfig(kind="mumoe_cp", num_experts=8, options={"rank": 4}), GPT2_SHAPE).d_hidden == 3072


def test_paper_recipes_keep_the_papers_dense_width():
    """The paper's H is the MLP's full width; the default (half) must not leak into recipes/paper/."""
    for name, shape in (("gpt2-l8", GPT2_SHAPE), ("llama3.2-3b-l12", LLAMA_SHAPE)):
        recipe = load_recipe(RECIPES / "paper" / f"mxd-{name}-mxd.yaml")
        assert resolve_layer_spec(recipe.layer, shape).d_hidden == shape.d_hidden


def test_resolve_llama_like_shape():
    spec = resolve_layer_spec(LayerConfig(kind="mxd", match_transcoder=32), LLAMA_SHAPE)
    assert (spec.encoder, spec.activation, spec.d_hidden, spec.num_experts) == ("glu", "silu", 4096, 92159)
    spec = resolve_layer_spec(LayerConfig(kind="mxd", match_transcoder=32, d_hidden=8192), LLAMA_SHAPE)
    assert spec.num_experts == 86015  # the paper's Table 2 at the paper's H
    # Explicit fields beat the base model's.
    spec = resolve_layer_spec(
        LayerConfig(num_experts=64, d_hidden=256, encoder="mlp", activation="gelu_pytorch_tanh"), LLAMA_SHAPE
    )
    assert (spec.encoder, spec.activation, spec.d_hidden) == ("mlp", "gelu_new", 256)


def test_match_conventions_and_transcoders():
    exact = resolve_layer_spec(LayerConfig(match_transcoder=32), GPT2_SHAPE)
    paper = resolve_layer_spec(LayerConfig(match_transcoder=32, match_convention="paper", d_hidden=3072), GPT2_SHAPE)
    assert paper.num_experts == 21490
    transcoder = resolve_layer_spec(LayerConfig(kind="transcoder", match_transcoder=32), GPT2_SHAPE)
    assert exact.num_parameters() <= transcoder.num_parameters() < exact.num_parameters() + 768 * 2 + 1
    assert transcoder.num_latents == 24576
    skip = resolve_layer_spec(LayerConfig(kind="skip_transcoder", num_latents=100, k=8), GPT2_SHAPE)
    assert isinstance(skip, SkipTranscoderSpec) and (skip.num_latents, skip.k) == (100, 8)
    assert resolve_layer_spec(LayerConfig(kind="transcoder", match_transcoder=1.5), GPT2_SHAPE).num_latents == 1152


def test_k_above_n_is_the_specs_error_with_recipe_keys():
    with pytest.raises(RecipeError, match=r"layer: layer\.k=64 exceeds layer\.num_experts=32"):
        resolve_layer_spec(LayerConfig(k=64, num_experts=32), GPT2_SHAPE)
    tiny = MlpShape(128, 512, "gelu", False)
    with pytest.raises(RecipeError, match=r"layer\.k=200 exceeds layer\.num_latents=128.*match_transcoder"):
        resolve_layer_spec(LayerConfig(kind="transcoder", k=200, match_transcoder=1), tiny)


@pytest.mark.parametrize(
    "layer, expected",
    [
        ({"kind": "mxd", "num_experts": 8, "match_transcoder": 32}, r"at most one of layer\.num_experts.*both are"),
        ({"kind": "transcoder", "num_latents": 8, "match_transcoder": 4}, r"layer\.num_latents.*both are set"),
        ({"kind": "mxd", "num_latents": 8}, r"layer\.num_latents=8 does not apply to layer\.kind='mxd'"),
        ({"kind": "transcoder", "num_latents": 8, "encoder": "glu"}, r"layer\.encoder='glu' does not apply"),
        ({"kind": "mxd", "num_experts": 8, "activation": "tanh"}, r"layer\.activation: activation 'tanh' is not"),
        ({"kind": "mxd", "num_experts": 8, "options": {"k": 4}}, r"layer\.options\.k: not an option; set layer\.k"),
        ({"kind": "mxd", "num_experts": 8, "options": {"d_in": 4}}, r"layer\.options\.d_in: not an option"),
        ({"kind": "mxd", "match_transcoder": 0}, r"layer\.match_transcoder: must be a positive expansion factor"),
        ({"kind": "mxd", "num_experts": 0}, r"layer\.num_experts: must be >= 1, got 0"),
    ],
)
def test_bad_layer_sections(layer, expected):
    with pytest.raises(RecipeError, match=expected):
        recipe_from_dict(minimal(layer=layer))


def test_option_values_are_validated_by_the_spec():
    layer = recipe_from_dict(minimal(layer={"num_experts": 64, "options": {"random_k": "often"}})).layer
    with pytest.raises(RecipeError, match=r"layer: layer\.options\.random_k must be true or false, got 'often'"):
        resolve_layer_spec(layer, GPT2_SHAPE)


def test_match_transcoder_too_small_for_the_dense_part():
    with pytest.raises(RecipeError, match=r"layer\.match_transcoder=1\.0: .*raise the expansion factor"):
        resolve_layer_spec(LayerConfig(match_transcoder=1), GPT2_SHAPE)


def test_unsupported_base_activation_needs_an_explicit_one():
    with pytest.raises(RecipeError, match=r"layer\.activation: 'auto' cannot use the base MLP's activation 'quick_gelu'"):
        resolve_layer_spec(LayerConfig(num_experts=64), MlpShape(64, 256, "quick_gelu", False))


# ----------------------------------------------------------------------------------------------------------------
# Python construction and the dump


def test_python_construction_is_validated_too():
    with pytest.raises(ValueError, match=r"train\.lr: expected a number or 'auto', got 'fast'"):
        recipe_from_dict(minimal(), ["train.lr=fast"])
    from expertize.conversion.recipe import TrainConfig

    with pytest.raises(ValueError, match=r"train\.tokens_per_step: expected an integer, got 'many'"):
        TrainConfig(tokens_per_step="many")
    assert TrainConfig(lr=1).lr == 1.0


def test_round_trip_keeps_every_field(tmp_path):
    recipe = recipe_from_dict(
        minimal(
            layers="all",
            layer={"kind": "mxd", "k": 8, "num_experts": 64, "d_hidden": 128, "options": {"unit_norm_experts": True}},
            train={"lr": 3e-4, "betas": [0.8, 0.9], "grad_clip": None, "schedule": "cosine"},
            eval={"lm_eval_tasks": ["hellaswag"]},
            heal={"rest": "lora", "lora_target_modules": ["q_proj"], "objective": "lm"},
            base_revision="main",
        )
    )
    tree = recipe_to_dict(recipe)
    assert list(tree) == ["base_model", "base_revision", "dtype", "layers", "layer", "data", "train", "heal", "eval",
                          "output_dir"]
    assert tree["heal"]["lora_target_modules"] == ["q_proj"]
    assert tree["layer"]["options"] == {"unit_norm_experts": True} and tree["train"]["grad_clip"] is None
    path = tmp_path / "recipe.resolved.yaml"
    save_recipe(recipe, path)
    assert load_recipe(path) == recipe
    assert isinstance(recipe, Recipe)


@pytest.mark.parametrize(
    "sections, expected",
    [
        ({"train": {"distill": False}}, r"train\.distill is false and there is no heal: section"),
        ({"heal": {"lora_target_parameters": ["mlp.W_enc"]}}, r"heal\.lora_target_parameters: LoRA settings need "
                                                                r"heal\.rest: lora"),
        ({"heal": {"rest": "lora", "lora_target_modules": []}}, r"heal\.lora_target_modules: empty"),
        ({"heal": {"objective": "mse"}}, r"heal\.objective: expected one of 'kl', 'lm'"),
        ({"heal": {"tokens": 0}}, r"heal\.tokens: must be >= 1"),
    ],
)
def test_heal_section_errors(sections, expected):
    with pytest.raises(RecipeError, match=expected):
        recipe_from_dict(minimal(**sections))


def test_generic_parameter_matching_sizes_other_kinds_and_names_the_field():
    """match_transcoder works for every kind: routed neurons get N, μMoE (match_field = rank) gets the rank."""
    from expertize.conversion.recipe import resolve_layer_spec
    from expertize.modeling import TranscoderSpec
    from expertize.modeling.configuration_expertize import MlpShape

    shape = MlpShape(64, 256, "gelu_new", glu=False)
    budget = TranscoderSpec(d_in=64, d_out=64, num_latents=8 * 64, k=1).num_parameters()
    routed = resolve_layer_spec(recipe_from_dict(minimal(layer={"kind": "routed_neurons", "k": 8,
                                                                "match_transcoder": 8})).layer, shape)
    assert routed.num_parameters() <= budget < type(routed).from_dict({**routed.to_dict(),
                                                                      "num_experts": routed.num_experts + 1}).num_parameters()
    mumoe = resolve_layer_spec(recipe_from_dict(minimal(layer={"kind": "mumoe_cp", "num_experts": 16,
                                                               "match_transcoder": 8})).layer, shape)
    assert mumoe.num_experts == 16
    assert mumoe.num_parameters() <= budget < type(mumoe).from_dict({**mumoe.to_dict(),
                                                                    "rank": mumoe.rank + 1}).num_parameters()
    with pytest.raises(RecipeError, match=r"layer\.match_transcoder chooses rank.*remove layer\.options\.rank"):
        recipe_from_dict(minimal(layer={"kind": "mumoe_cp", "num_experts": 16, "match_transcoder": 8,
                                        "options": {"rank": 4}}))


# ----------------------------------------------------------------------------------------------------------------
# Failure catalogue: non-finite numbers, warm-up longer than the run, kind switches, bundled recipes, assets


@pytest.mark.parametrize(
    "section, text, key, shown",
    [
        ("train", "lr: .inf", "train.lr", "inf"),
        ("train", "lr: .nan", "train.lr", "nan"),
        ("train", "grad_clip: -.inf", "train.grad_clip", "-inf"),  # float | None: not "expected a number or null"
        ("train", "betas: [0.9, .nan]", "train.betas[1]", "nan"),
        ("heal", "lora_alpha: 1e999", "heal.lora_alpha", "inf"),  # overflows to inf when read
        ("eval", "lm_eval_limit: .inf", "eval.lm_eval_limit", "inf"),  # int | float | None
    ],
)
def test_non_finite_numbers_are_refused_naming_the_key(tmp_path, section, text, key, shown):
    path = write(tmp_path, yaml.safe_dump(minimal(), sort_keys=False) + f"{section}:\n  {text}\n")
    expected = rf"{re.escape(str(path))}: {re.escape(key)}: must be a finite number, got {shown}$"
    with pytest.raises(RecipeError, match=expected):
        load_recipe(path)


def test_non_finite_numbers_from_overrides_and_python():
    with pytest.raises(RecipeError, match=r"^--set train\.lr=\.inf: train\.lr: must be a finite number, got inf$"):
        recipe_from_dict(minimal(), ["train.lr=.inf"], source="r.yaml")
    from expertize.conversion.recipe import TrainConfig

    with pytest.raises(ValueError, match=r"train\.lr: must be a finite number, got inf"):
        TrainConfig(lr=float("inf"))
    with pytest.raises(RecipeError, match=r"data\.eval_fraction: must be a finite number, got nan"):
        recipe_from_dict(minimal(data={"source": "hub", "name": "x", "eval_fraction": float("nan")}))


def test_run_steps_counts_each_stage():
    # minimal(): data.train_tokens 1,000,000 // train.tokens_per_step 4,096 = 244 steps. A warm-up longer than its
    # stage loads (a run made under the former 5,000-step default must still load); preflight refuses it
    # (Recipe.check_warmups, tests/test_schedule_rule.py).
    assert recipe_from_dict(minimal(train={"warmup_steps": 300})).run_steps() == {"train": 244}
    # Healing: ceil(4,096 tokens / 128 per sequence) = 32 sequences // 8 per step = 4 steps.
    recipe = recipe_from_dict(minimal(train={"distill": False}, heal={"tokens": 4096, "batch_sequences": 8}))
    assert recipe.run_steps() == {"heal": 4}
    assert recipe.distill_steps() == 0  # the one rule preflight's RunPlan.distill_steps reads too


def test_preflight_plans_the_recipes_distill_steps(tiny_run):
    """`plan_run` takes its step count from `Recipe.distill_steps` (the rule is written once)."""
    from expertize.conversion.preflight import plan_run
    from expertize.conversion.recipe import recipe_from_dict

    _, tree = tiny_run
    recipe = recipe_from_dict(tree)
    assert plan_run(recipe).distill_steps == recipe.distill_steps() == recipe.run_steps()["train"] > 0


def test_kind_switch_from_the_command_line_resets_k_with_null():
    tree = minimal(layer={"kind": "mxd", "k": 8, "match_transcoder": 8})
    expected = (r"layer\.k=8 does not apply to layer\.kind='mumoe_cp' \(it applies to kinds: .*\); remove it from the "
                r"recipe, or switch kinds on the command line with --set layer\.kind=mumoe_cp --set layer\.k=null$")
    with pytest.raises(RecipeError, match=expected):
        recipe_from_dict(tree, ["layer.kind=mumoe_cp", "layer.num_experts=16"])
    recipe = recipe_from_dict(tree, ["layer.kind=mumoe_cp", "layer.k=null", "layer.num_experts=16"])
    assert (recipe.layer.kind, recipe.layer.k) == ("mumoe_cp", 32)  # the default, which mumoe_cp ignores
    spec = resolve_layer_spec(recipe.layer, MlpShape(64, 256, "gelu_new", False))
    assert spec.kind == "mumoe_cp" and spec.num_experts == 16 and spec.rank >= 1
    # On a key that takes null, null stays a value.
    assert recipe_from_dict(minimal(base_revision="main"), ["base_revision=null"]).base_revision is None


def test_switching_the_quickstart_to_mumoe_cp_takes_the_overrides_the_error_names():
    """`--set layer.k=null` alone was not enough (μMoE also needs its expert count) and the two errors came one at a
    time; the first now names every override, and those overrides, as docs/recipes.md gives them, load and size. (The
    quickstart's K is the default 32, which a kind without a top-k ignores; a K of 16 must be reset.)"""
    with pytest.raises(RecipeError) as info:
        load_recipe("quickstart", ["layer.k=16", "layer.kind=mumoe_cp"])
    switch = re.search(r"switch kinds on the command line with (.*?) \(", str(info.value))[1]
    assert switch == "--set layer.kind=mumoe_cp --set layer.k=null --set layer.num_experts=N"
    overrides = [part.replace("=N", "=256") for part in switch.split("--set ")[1:]]
    recipe = load_recipe("quickstart", ["layer.k=16"] + [o.strip() for o in overrides])
    spec = resolve_layer_spec(recipe.layer, BASE_MODELS["tiny-gpt2-shakespeare"][0])
    assert (spec.kind, spec.num_experts) == ("mumoe_cp", 256) and spec.rank >= 1
    page = (RECIPES.parent / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert "`--set layer.kind=mumoe_cp --set layer.k=null --set layer.num_experts=256`" in page
    # The documented switch works on the shipped quickstart as written.
    documented = load_recipe("quickstart", ["layer.kind=mumoe_cp", "layer.k=null", "layer.num_experts=256"])
    assert documented.layer.kind == "mumoe_cp"
    with pytest.raises(RecipeError, match=r"layer\.num_experts is required: layer\.match_transcoder sizes the rank of "
                                          r"layer\.kind='mumoe_cp', not its expert count; set it, e\.g\. --set "
                                          r"layer\.num_experts=256$"):
        load_recipe("quickstart", ["layer.kind=mumoe_cp", "layer.k=null"])


def test_bundled_recipes_by_name(data_dir, tmp_path, monkeypatch):
    from expertize.conversion.recipe import bundled_recipes

    monkeypatch.chdir(tmp_path)  # no file of those names here
    names = set(bundled_recipes())
    assert {p.relative_to(RECIPES).with_suffix("").as_posix() for p in SHIPPED} == names
    for name in ("quickstart", "stories260k-mxd", "paper/mxd-gpt2-l8-mxd", "stories260k-mxd.yaml"):
        assert load_recipe(name) == load_recipe(RECIPES / (name.removesuffix(".yaml") + ".yaml"))
    assert load_recipe("quickstart", ["train.lr=3e-4"]).train.lr == 3e-4
    # A file of that name wins over the bundled recipe.
    write(tmp_path, minimal(output_dir="runs/mine"), name="quickstart")
    assert load_recipe("quickstart").output_dir == "runs/mine"


def test_unknown_recipe_name_suggests_a_bundled_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as info:
        load_recipe("quikstart")
    message = str(info.value)
    assert "'quikstart' does not exist" in message and "(did you mean 'quickstart'?)" in message
    assert "give the path of a recipe YAML file or one of the bundled recipes: " in message
    assert "paper/mxd-gpt2-l8-mxd" in message


def test_expertize_assets_expands_to_the_installed_assets_folder(monkeypatch):
    import importlib.resources

    from expertize.conversion.recipe import assets_dir

    monkeypatch.delenv("EXPERTIZE_ASSETS", raising=False)
    folder = Path(str(importlib.resources.files("expertize") / "assets"))
    assert assets_dir() == folder
    recipe = recipe_from_dict(minimal(base_model="${EXPERTIZE_ASSETS}/tiny-model"))
    assert recipe.base_model == f"{folder}/tiny-model"
    monkeypatch.setenv("EXPERTIZE_ASSETS", "/elsewhere")  # an explicit setting overrides the built-in value
    assert recipe_from_dict(minimal(base_model="${EXPERTIZE_ASSETS}/tiny-model")).base_model == "/elsewhere/tiny-model"


def test_a_new_kind_needs_only_its_spec_class_and_the_registry(monkeypatch):
    """Registering a kind is all the recipe and the card need: they read its facts from the spec class."""
    import dataclasses as dc
    from typing import ClassVar

    from expertize.conversion.publishing.card import _kind_info
    from expertize.modeling import LAYER_KINDS, TranscoderLayer

    @dc.dataclass
    class WideTranscoderSpec(TranscoderSpec):
        kind = "wide_transcoder"
        title: ClassVar[str] = "wide transcoder"

    monkeypatch.setitem(LAYER_KINDS, "wide_transcoder", (WideTranscoderSpec, TranscoderLayer))
    layer = recipe_from_dict(minimal(layer={"kind": "wide_transcoder", "k": 4, "match_transcoder": 2})).layer
    spec = resolve_layer_spec(layer, GPT2_SHAPE)
    assert type(spec) is WideTranscoderSpec and spec.num_latents == 2 * 768
    assert (_kind_info("wide_transcoder").title, _kind_info("wide_transcoder").unit) == ("wide transcoder", "latent")
    with pytest.raises(RecipeError, match=r"layer\.init='split': .* implemented for moe_x, not 'wide_transcoder'"):
        recipe_from_dict(minimal(layer={"kind": "wide_transcoder", "num_latents": 8, "k": 4, "init": "split"}))


@pytest.mark.parametrize("kind", ["transcoder", "clt", "jumprelu_transcoder", "mxd", "skip_transcoder"])
def test_a_kind_without_a_size_defaults_to_the_8x_transcoders(kind):
    """`layer: {kind: clt}` (or `--set layer.kind=transcoder` on a recipe without a size) trains at the documented
    default size instead of stopping (issue 50): the same layer as `match_transcoder: 8` spelled out."""
    given = recipe_from_dict(minimal(layer={"kind": kind}, layers=[1])).layer
    spelled = recipe_from_dict(minimal(layer={"kind": kind, "match_transcoder": 8}, layers=[1])).layer
    assert given.match_transcoder == DEFAULT_MATCH_TRANSCODER == 8
    assert resolve_layer_spec(given, GPT2_SHAPE) == resolve_layer_spec(spelled, GPT2_SHAPE)
    if kind != "mxd":
        assert resolve_layer_spec(given, GPT2_SHAPE).num_latents == 8 * GPT2_SHAPE.d_model
