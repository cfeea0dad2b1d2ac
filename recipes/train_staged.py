"""Shallow-to-deep training (SDT): train the first depth, grow by copying the top layers, restart the learning rate,
repeat up to the last depth, then evaluate and export. Resumable: run it again after an interruption.

    python recipes/train_staged.py recipes/configs/sdt_sample_staged.json
    hf-deep-nmt train-staged recipes/configs/sdt_sample_staged.json --stage_max_steps 50

Every step is a library call (hf_deep_nmt.staged.run_staged).
"""

import json
import sys

from hf_deep_nmt.staged import run_staged

if __name__ == "__main__":
    summary = run_staged(sys.argv[1:])
    print(json.dumps({key: value for key, value in summary.items() if key != "examples"}, indent=2))
