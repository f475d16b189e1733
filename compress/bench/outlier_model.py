"""``compress bench outlier-model SRC OUT``: a copy of a Llama-family model whose
activations carry large-magnitude outlier feature dimensions, the way big LLMs' do
(Dettmers et al. 2022), with the same float function: the model LLM.int8's outlier
path is measured and checked on.

How: pick ``--channels`` residual-stream dimensions (seeded) and, in every decoder block,
multiply those channels of the attention-norm and MLP-norm RMSNorm weights by
``--factor`` while dividing the same input columns of the linears they feed (q/k/v and
gate/up) by ``--factor``. RMSNorm's output is ``weight * x / rms(x)``, so the magnitude
moves into the activations that the linears read, and ``(f * a) @ (W / f)^T = a @ W^T``
keeps the model's outputs (up to float rounding). Like real outlier features, the same
few dimensions are large in every layer and on every token. ``--down-channels`` does the
same for down_proj's input (up_proj rows x f, down_proj columns / f)::

    compress bench outlier-model models/pydoc-llama /tmp/pydoc-llama-outliers"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from compress.errors import UserError
from compress.io.files import atomic_dir, atomic_write_text

PROBE_TEXT = "Return the number of items in a container."


class OutlierModelError(UserError):
    """A setting of ``compress bench outlier-model`` that cannot work (names the option)."""


@torch.no_grad()
def plant_outliers(model, arch, channels: list[int], factor: float, down_channels: list[int] = ()) -> None:
    """In place: make ``channels`` of the norm outputs (and ``down_channels`` of down_proj's
    input) ``factor`` times larger, compensated in the consumers' weights."""
    from quantizers.awq_search import fold_scale_into_linear, fold_scale_into_norm

    blocks = model.get_submodule(arch.layers)
    s = torch.ones(model.config.hidden_size)
    s[list(channels)] = 1.0 / factor            # the fold divides the norm by s: norm * factor
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


def pick_channels(hidden: int, intermediate: int, n_residual: int, n_down: int, seed: int):
    """The seeded residual and down_proj-input channels to make outliers (sorted)."""
    for option, n, size in (("--channels", n_residual, hidden), ("--down-channels", n_down, intermediate)):
        if not 0 <= n <= size:
            raise OutlierModelError(f"{option} {n}: the model has {size} such channels")
    gen = torch.Generator().manual_seed(seed)
    residual = sorted(torch.randperm(hidden, generator=gen)[:n_residual].tolist())
    down = sorted(torch.randperm(intermediate, generator=gen)[:n_down].tolist())
    return residual, down


def make_outlier_model(src: str, out: Path, channels: int = 4, down_channels: int = 4, factor: float = 80.0,
                       seed: int = 0, log=print) -> dict:
    """Writes the planted copy of ``src`` to ``out`` (a plain HF directory, renamed into
    place) with an OUTLIERS.md saying how; returns what was planted and the logits'
    relative change on a probe sentence."""
    from compress.model_loading import load_model_for_compression

    if not factor > 0:
        raise OutlierModelError(f"--factor {factor}: must be positive")
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "OUTLIERS.md").is_file())):
        raise OutlierModelError(f"refusing to replace {out}: it exists and was not made by this command "
                                "(no OUTLIERS.md)")
    model, tok, arch, model_dir = load_model_for_compression(src)
    residual, down = pick_channels(model.config.hidden_size, model.config.intermediate_size, channels,
                                   down_channels, seed)
    ids = tok(PROBE_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        before = model(ids).logits
        plant_outliers(model, arch, residual, factor, down)
        after = model(ids).logits
    rel = float((after - before).norm() / before.norm())
    log(f"planted residual channels {residual} and down_proj input channels {down} x{factor}; "
        f"logits relative change {rel:.2e}")
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        for extra in ("special_tokens_map.json",):
            if (model_dir / extra).exists() and not (tmp / extra).exists():
                shutil.copy(model_dir / extra, tmp / extra)
        atomic_write_text(tmp / "OUTLIERS.md",
                          f"Made by `compress bench outlier-model {src} {out} --channels {channels} "
                          f"--down-channels {down_channels} --factor {factor} --seed {seed}`\n"
                          f"residual channels {residual}, down_proj input channels {down}, factor {factor}; "
                          f"logits relative change {rel:.2e}\n")
    log(f"saved to {out}")
    return {"residual_channels": residual, "down_channels": down, "factor": factor, "logits_rel_change": rel}


def main(args) -> int:
    make_outlier_model(args.src, Path(args.out), args.channels, args.down_channels, args.factor, args.seed)
    return 0


def add_arguments(p) -> None:
    p.add_argument("src", help="a Llama-family HF model directory (e.g. models/pydoc-llama)")
    p.add_argument("out", help="where to write the copy with outlier features")
    p.add_argument("--channels", type=int, default=4, help="residual dims made outliers")
    p.add_argument("--down-channels", type=int, default=4, help="down_proj input dims made outliers")
    p.add_argument("--factor", type=float, default=80.0, help="how much larger they are made")
    p.add_argument("--seed", type=int, default=0)
