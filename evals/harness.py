"""Run lm-eval on a checkpoint with our task folder on the include path."""

from __future__ import annotations

from pathlib import Path


def flatten_results(results: dict) -> dict[str, dict[str, float]]:
    """``simple_evaluate`` output -> ``{task: {metric: value}}`` (the ``,none`` filter dropped)."""
    out = {}
    for task, metrics in results["results"].items():
        row = {}
        for key, value in metrics.items():
            if key in ("alias", "sample_len") or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            row[metric if filt in ("", "none") else key] = float(value)
        out[task] = row
    return out


def run_lm_eval(path: str | Path, tasks: list[str] | str, limit: int | float | None = None,
                batch_size: int = 8, model: str = "compress", dtype: str = "float32",
                kernels: str = "native", threads: int | None = None,
                num_fewshot: int | None = None, llm=None, seed: int = 1234,
                raw: bool = False) -> dict:
    """lm-eval scores of the checkpoint at ``path`` as ``{task: {metric: value}}``.

    ``model="hf"`` runs lm-eval's own HF model on the same checkpoint (for comparison);
    ``llm`` reuses an already opened runtime model. ``raw=True`` returns lm-eval's dict.
    """
    import lm_eval
    import evals.lm_eval_adapter  # noqa: F401  registers "compress"
    from evals.lm_eval_quiet import quiet_lm_eval
    from evals.tasks import TASKS, task_manager

    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",") if t]
    if model == "compress":
        from evals.lm_eval_adapter import CompressLM
        args = dict(pretrained=str(path), dtype=dtype, kernels=kernels,
                    batch_size=batch_size, threads=threads, llm=llm)
        lm, model_args = CompressLM(**args), None
    elif model == "hf":
        from evals.backend import quiet_bitsandbytes_import
        quiet_bitsandbytes_import(path)
        lm, model_args = "hf", f"pretrained={path},dtype={dtype}"
    else:
        raise ValueError(f"unknown lm-eval model {model!r} (use 'compress' or 'hf')")
    with quiet_lm_eval():
        results = lm_eval.simple_evaluate(
            model=lm, model_args=model_args, tasks=list(tasks), limit=limit,
            batch_size=batch_size, device="cpu", num_fewshot=num_fewshot,
            # indexing lm-eval's ~14k built-in task files takes a minute: skip it when only ours run
            task_manager=task_manager(not set(tasks) <= set(TASKS)),
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed, log_samples=False)
    return results if raw else flatten_results(results)
