"""Peak RSS of ``compress_stages`` on a recipe, measured in a fresh subprocess.

VmHWM (the process's own peak RSS) rather than ru_maxrss, which a child inherits from
its parent across the fork. The baseline is taken after the imports, so the growth is
what the run itself holds."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

MEASURE = r"""
import json, sys

def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

import torch, transformers, tqdm                          # the interpreter's own baseline
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from compress.pipeline import compress_stages
from compress.recipe import load_recipe
import compress.stage_executor, quantizers.awq, quantizers.llm_int8, pruning.transform
torch.set_num_threads(2)
baseline = peak_rss()
recipe = load_recipe(sys.argv[1])
compress_stages(recipe, recipe.path.parent / "out", progress=False, log=lambda *a: None)
print(json.dumps({"baseline": baseline, "peak": peak_rss()}))
"""


def run_measuring_rss(recipe: Path, timeout: int = 600) -> dict:
    """``{"baseline": bytes, "peak": bytes}`` of a subprocess running ``recipe``'s stages."""
    done = subprocess.run([sys.executable, "-c", MEASURE, str(recipe)], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
