"""Recipes: YAML build descriptions validated into frozen dataclasses (reference: docs/RECIPE.md).

``load_recipe(path)`` parses and validates a recipe file; ``recipe_to_dict`` / ``recipe_from_dict`` round-trip
the resolved form; ``recipe_hash`` fingerprints it. Model-dependent checks: ``llmc.recipe.checks``.
"""

from llmc.errors import RecipeError
from llmc.recipe.load import load_recipe, recipe_from_dict, recipe_hash, recipe_to_dict
from llmc.recipe.schema import (
    CalibrationSpec,
    EngineLimits,
    GateSpec,
    KVCacheSpec,
    ModelSource,
    ModelSpec,
    QuantSpec,
    Recipe,
    RuntimeDefaults,
    ServingSpec,
    TrtllmSpec,
)

__all__ = [
    "CalibrationSpec",
    "EngineLimits",
    "GateSpec",
    "KVCacheSpec",
    "ModelSource",
    "ModelSpec",
    "QuantSpec",
    "Recipe",
    "RecipeError",
    "RuntimeDefaults",
    "ServingSpec",
    "TrtllmSpec",
    "load_recipe",
    "recipe_from_dict",
    "recipe_hash",
    "recipe_to_dict",
]
