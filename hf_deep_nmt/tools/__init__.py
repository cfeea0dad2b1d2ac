"""The tool shed: commands around the three journeys. `doctor` checks a machine, `diagnostics` and `inspection` look
inside a model, `marian` converts OPUS-MT models, `upgrade_code` mends the model code inside saved folders."""
