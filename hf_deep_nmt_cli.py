"""The `hf-deep-nmt` command's entry point, outside the package on purpose.

`import hf_deep_nmt` registers the models with the Auto classes (torch, transformers and the model code, seconds to
import), as users of the Python API expect. The command line must not pay that before it has even read its arguments:
while this module is being imported, the package sees it in `sys.modules` and leaves the registration to the first
use of one of its names, or to the command that loads or builds a model."""

import gc
import sys

if __name__ == "__main__":  # `python -m hf_deep_nmt_cli`: the package looks for this module under its own name
    sys.modules.setdefault("hf_deep_nmt_cli", sys.modules[__name__])

from hf_deep_nmt.cli import main as _main  # noqa: E402  (after the alias above, which decides what the package does)

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """`hf_deep_nmt.cli.main`, then the heap frozen: once the command has returned, everything it does is done (its
    files written and closed, its atexit handlers still to run), and the collections of interpreter shutdown would
    only walk the hundreds of thousands of objects torch and transformers made at import, about 1.5 CPU s that kept
    a process alive after printing its error."""
    try:
        return _main(argv)
    finally:
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
