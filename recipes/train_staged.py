"""Shallow-to-deep training (SDT): train the first depth, grow by copying the top layers, restart the learning rate,
repeat up to the last depth, then evaluate and export. Resumable: run it again after an interruption.

    python recipes/train_staged.py recipes/configs/sdt_sample_staged.json
    hf-deep-nmt train-staged recipes/configs/sdt_sample_staged.json --stage-max-steps 50

Every step is a library call (hf_deep_nmt.training.staged.run_staged, through the command line's error reporting: an
expected failure is one line per process naming the way out, not a traceback).
"""

import sys

from hf_deep_nmt.cli import main

if __name__ == "__main__":
    sys.exit(main(["train-staged", *sys.argv[1:]]))
