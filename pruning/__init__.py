"""Structural pruning (Minitron-style width and depth): ``method: prune``.

Muralidharan et al. 2024 ("Compact Language Models via Pruning and Knowledge
Distillation") and Sreenivas et al. 2024 ("LLM Pruning and Distillation in Practice:
the Minitron Approach"): rank the attention heads, MLP channels, hidden (embedding)
channels and decoder blocks by their activations on a small calibration set, and cut
the least important to a smaller *dense* model of the same architecture, which a
vanilla Hugging Face config describes.

* ``prune.py``: the recipe step's config (targets, strategy, aggregation, depth metric)
  and the checks of its targets against a model;
* ``transform.py``: the step as the stage executor runs it (a ModelTransform);
* ``importance.py``: the one calibrated pass over the blocks, block by block from files;
* ``depth.py``: Block Importance and the LM-loss increase of skipping each block;
* ``selection.py``: top-k / seeded random kept indices, GQA-shaped for heads;
* ``channel_slices.py``: what keeping some channels of a group slices in which tensor;
* ``cut.py``: the kept indices as per-tensor slices and a smaller config, streamed
  tensor by tensor into the export.

Healing the pruned model by distillation is ``distill/``.
"""
