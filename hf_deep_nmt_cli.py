"""The `hf-deep-nmt` command's entry point, outside the package on purpose.

`import hf_deep_nmt` registers the models with the Auto classes (torch, transformers and the model code, seconds to
import), as users of the Python API expect. The command line must not pay that before it has even read its arguments:
while this module is being imported, the package sees it in `sys.modules` and leaves the registration to the first
use of one of its names, or to the command that loads or builds a model."""

from hf_deep_nmt.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    import sys

    sys.exit(main())
