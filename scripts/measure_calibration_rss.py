#!/usr/bin/env python3
"""Peak RSS of layer-by-layer calibration capture vs one whole-model forward.

    python scripts/measure_calibration_rss.py blocks   # iterate_blocks (what the quantizers use)
    python scripts/measure_calibration_rss.py full     # the whole model's hidden states at once

Run each mode in its own process (peak RSS only grows).
"""
import argparse
import resource

import torch

from compress.calibration import iterate_blocks, load_calibration_ids
from compress.model_loading import load_model_for_compression


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["blocks", "full"])
    ap.add_argument("--model", default="models/pydoc-llama")
    ap.add_argument("--calib", default="data/pydoc/calib.txt")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    model, tok, arch, _ = load_model_for_compression(args.model)
    ids = load_calibration_ids([args.calib], tok, args.samples, args.seq_len, 0)
    before = peak_mib()
    if args.mode == "blocks":
        for _ in iterate_blocks(model, arch, ids, batch_size=8):
            pass
    else:
        with torch.no_grad():
            model(ids, output_hidden_states=True)
    print(f"{args.mode}: {args.samples}x{args.seq_len} calibration tokens, peak RSS {before:.0f} MiB "
          f"after loading, {peak_mib():.0f} MiB after capture (+{peak_mib() - before:.0f} MiB)")


if __name__ == "__main__":
    main()
