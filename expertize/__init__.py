"""expertize: sparse-expert replacements for the dense MLPs of pretrained language models.

`expertize.modeling` is the Hub bundle (what travels with a saved model); `expertize.conversion` is everything else
(recipes, activation capture, training, splicing, evaluation, CLI).
"""

__version__ = "0.1.0"
