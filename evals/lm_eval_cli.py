"""lm-eval's own command line with our ``compress`` model registered.

``main(argv)`` registers the model, then hands every argument to lm-eval's CLI unchanged,
so ``compress lm-eval --model compress --model_args pretrained=PATH --tasks ...`` is
``lm-eval --model compress ...``. The one addition: when a command names no
``--include_path``, our offline task folder (``pydoc_ppl``, ``pydoc_cloze``) is offered.
"""

from __future__ import annotations

import sys


def _with_task_dir(argv: list[str]) -> list[str]:
    from evals.tasks import task_dir
    has_include = any(a == "--include_path" or a.startswith("--include_path=") for a in argv)
    if argv and not has_include and not any(a in ("-h", "--help") for a in argv):
        return [*argv, "--include_path", str(task_dir())]
    return argv


def main(argv: list[str] | None = None) -> int:
    import evals.lm_eval_adapter  # noqa: F401  registers "compress"
    from lm_eval.__main__ import cli_evaluate

    from evals.lm_eval_quiet import quiet_lm_eval

    argv = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["lm-eval", *_with_task_dir(argv)]
    from compress.errors import UserError

    try:
        with quiet_lm_eval():
            cli_evaluate()
    except ValueError as exc:
        if isinstance(exc, UserError):
            raise
        # lm-eval's own refusals ("Tasks not found: ...", a bad --model_args): one line,
        # as compress's other commands print theirs
        raise UserError(f"lm-eval: {exc}") from None
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
