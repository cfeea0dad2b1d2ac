#!/usr/bin/env bash
# Runs every fidelity script at full size, one after the other (each about 10-15 minutes on 2 CPU cores), writing
# benchmarks/fidelity/results/*.json and *.png. Extra arguments (e.g. --threads 1) go to every script.
set -euo pipefail
cd "$(dirname "$0")"
for script in parameter_counts dsinit_gradients dlcl_deep_training sdt_growth_ablation msc_gradients; do
    echo "== $script"
    python "$script.py" "$@"
done
