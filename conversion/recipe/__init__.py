"""Recipes: the typed, strictly loaded input of `expertize upcycle RECIPE`.

    schema.py       the dataclass tree (Recipe, TrainConfig, EvalConfig)
    layer_config.py the layer: section (LayerConfig)
    heal_config.py  the heal: section (HealConfig)
    data.py         the data: section (DataConfig) and the token budget -> sequences rule
    loader.py       YAML files and bundled recipes by name, `--set` overrides, ${VAR} expansion, saving
    coerce.py       type checking with key paths and did-you-mean suggestions (shared by the loader and the schema)
    layer_spec.py   resolution against the base model: layer indices and the sparse layer spec of each MLP
    variants.py     the variants: list (several sparse layers on one activation stream, one folder each)
    param_match.py  sizing a layer to a transcoder's parameter count (layer.match_transcoder)
"""

from .coerce import RecipeError, field_docs
from .data import DataConfig
from .layer_spec import resolve_layer_spec, resolve_layers
from .loader import assets_dir, bundled_recipes, load_recipe, recipe_from_dict, recipe_to_dict, save_recipe, variant_recipes
from .schema import EvalConfig, HealConfig, LayerConfig, Recipe, TrainConfig
from .variants import VARIANT_TRAIN_KEYS, VariantConfig

__all__ = [
    "DataConfig",
    "EvalConfig",
    "HealConfig",
    "LayerConfig",
    "Recipe",
    "RecipeError",
    "TrainConfig",
    "VARIANT_TRAIN_KEYS",
    "VariantConfig",
    "assets_dir",
    "bundled_recipes",
    "field_docs",
    "load_recipe",
    "recipe_from_dict",
    "recipe_to_dict",
    "resolve_layer_spec",
    "resolve_layers",
    "save_recipe",
    "variant_recipes",
]
