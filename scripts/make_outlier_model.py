#!/usr/bin/env python
"""Make a copy of a Llama-family model whose activations carry large-magnitude outlier
feature dimensions, the way big LLMs' do (Dettmers et al. 2022), without changing the
float function.

How: pick ``--channels`` residual-stream dimensions (seeded) and, in every decoder block,
multiply those channels of the attention-norm and MLP-norm RMSNorm weights by
``--factor`` while dividing the same input columns of the linears they feed
(q/k/v and gate/up) by ``--factor``. RMSNorm's output is ``weight * x / rms(x)``, so the
magnitude moves into the activations that the linears read, and
``(f * a) @ (W / f)^T = a @ W^T`` keeps the model's outputs (up to float rounding).
Like real outlier features, the same few dimensions are large in every layer and on
every token. ``--down-channels`` does the same for down_proj's input (up_proj rows x f,
down_proj columns / f).

  python scripts/make_outlier_model.py --input models/pydoc-llama --output /tmp/pydoc-llama-outliers
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from compress.model_loading import load_model_for_compression  # noqa: E402
from quantizers.awq_search import fold_scale_into_linear, fold_scale_into_norm  # noqa: E402


@torch.no_grad()
def plant_outliers(model, arch, channels: list[int], factor: float, down_channels: list[int] = ()) -> None:
    """In place: make ``channels`` of the norm outputs (and ``down_channels`` of down_proj's
    input) ``factor`` times larger, compensated in the consumers' weights."""
    blocks = model.get_submodule(arch.layers)
    hidden = model.config.hidden_size
    s = torch.ones(hidden)
    s[list(channels)] = 1.0 / factor            # fold divides prev by s: prev * factor
    for block in blocks:
        for group in arch.scale_groups:
            if group.prev_kind != "norm":
                continue
            linears = [block.get_submodule(n).weight.data for n in group.linears]
            fold_scale_into_norm(block.get_submodule(group.prev).weight.data, linears, s)
        if down_channels:
            up, down = block.get_submodule(arch.up_proj), block.get_submodule(arch.down_proj)
            sd = torch.ones(up.out_features)
            sd[list(down_channels)] = 1.0 / factor
            fold_scale_into_linear(up.weight.data, up.bias.data if up.bias is not None else None,
                                   [down.weight.data], sd, sd)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", default=str(REPO / "models/pydoc-llama"))
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--channels", type=int, default=4, help="residual dims made outliers")
    p.add_argument("--down-channels", type=int, default=4, help="down_proj input dims made outliers")
    p.add_argument("--factor", type=float, default=80.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model, tok, arch, model_dir = load_model_for_compression(args.input)
    gen = torch.Generator().manual_seed(args.seed)
    channels = sorted(torch.randperm(model.config.hidden_size, generator=gen)[:args.channels].tolist())
    down = sorted(torch.randperm(model.config.intermediate_size, generator=gen)[:args.down_channels].tolist())
    ids = tok("Return the number of items in a container.", return_tensors="pt").input_ids
    with torch.no_grad():
        before = model(ids).logits
    plant_outliers(model, arch, channels, args.factor, down)
    with torch.no_grad():
        after = model(ids).logits
    rel = float((after - before).norm() / before.norm())
    print(f"planted residual channels {channels} and down_proj input channels {down} x{args.factor}; "
          f"logits relative change {rel:.2e}")
    args.output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output, safe_serialization=True)
    tok.save_pretrained(args.output)
    for extra in ("special_tokens_map.json",):
        if (model_dir / extra).exists() and not (args.output / extra).exists():
            shutil.copy(model_dir / extra, args.output / extra)
    (args.output / "OUTLIERS.md").write_text(
        f"Made by `python scripts/make_outlier_model.py --input {args.input} --output {args.output} "
        f"--channels {args.channels} --down-channels {args.down_channels} --factor {args.factor} "
        f"--seed {args.seed}`\nresidual channels {channels}, down_proj input channels {down}, "
        f"factor {args.factor}; logits relative change {rel:.2e}\n")
    print(f"saved to {args.output}")


if __name__ == "__main__":
    main()
