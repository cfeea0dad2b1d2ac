"""The decoding options of a translation, in one place: `DecodingOptions`.

`translate` (and the file functions beside it), the final evaluation of a training run (built from the recipe by
`DecodingOptions.from_recipe`) and `hf-deep-nmt translate` (its flags are generated from the fields, and read back by
`DecodingOptions.from_arguments`) all take this one type. Its values are checked when it is built, naming the first
one out of range; `generate_kwargs` and `output_limits` turn it into the options of `generate()`, and
`generation_settings` into what a recipe's model keeps in its `generation_config`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# This module imports neither torch nor transformers: the decoding flags of `hf-deep-nmt translate` are made from
# `DecodingOptions`, and a command refused on its arguments must not wait for them.

# The positions are sinusoidal (no table, so no `max_position_embeddings`): these caps are what bounds the work.
MAX_SOURCE_TOKENS = 1024  # a longer input line is refused before anything is translated
# no translation is longer, whatever `max_length_a` and `max_length_b` allow: the model code's
# `DEFAULT_MAX_OUTPUT_TOKENS`, a new model's generate() cap (written out, not imported with the model code; a test
# holds the two equal)
MAX_OUTPUT_TOKENS = 1024
MAX_LENGTH_A = 10.0  # an output/source length ratio above this is a mistake, not a translation setting
LENGTH_PENALTY_FORMS = ("fairseq", "gnmt")  # see `length_penalty`
# A recipe's final evaluation: an output cap above this many tokens per sentence (max_length_a * max_source_length +
# max_length_b) is refused, no sentence of a translation corpus needs it, and decoding up to it would run for hours.
MAX_EVALUATION_OUTPUT_TOKENS = 4096


def length_penalty(length: int, alpha: float, form: str = "fairseq") -> float:
    """The divisor of a hypothesis' summed log-probability: `length^alpha` (fairseq, and `generate()`'s own) or
    `((5 + length) / 6)^alpha` (GNMT, Wu et al. 2016). `length` counts the output tokens including `</s>`. Here, with
    the options that choose the form, because decoding applies it and the evaluation of a training run states it."""
    if form not in LENGTH_PENALTY_FORMS:
        raise ValueError(f"Length penalty form must be one of {LENGTH_PENALTY_FORMS}, got {form!r}.")
    if length < 1:
        raise ValueError(f"`length` must be >= 1, got {length}.")
    return float(length) ** alpha if form == "fairseq" else ((5.0 + length) / 6.0) ** alpha


def _option(default, help: str, **flag):
    """A field of `DecodingOptions`; `flag` holds what the command line differs in: `cli_default` (the flag's default
    when it is not the library's; None for num_beams and length_penalty: the model's generation config decides),
    `minimum` (of an integer flag), `choices`."""
    return field(default=default, metadata={"help": help, **flag})


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DecodingOptions:
    """How sentences are batched and decoded; see `hf_deep_nmt.serving.translate.translate` for what each option does.

    Building one checks every value (`ValueError` naming the first option out of its range and the value); nothing
    is replaced by a default. The field order is the positional order of `check_translation_options`.
    """

    batch_size: int = _option(32, "most sentences in a batch", cli_default=64)
    num_beams: int = _option(4, "beams of beam search; default: the model's generation config", cli_default=None)
    length_penalty: float = _option(1.0, "alpha; default: the generation config", cli_default=None)
    max_length_a: float = _option(1.5, f"output cap: a * source tokens + b (0 <= a <= {MAX_LENGTH_A:g})")
    max_length_b: int = _option(10, "see --max-length-a", minimum=0)
    max_tokens: int | None = _option(None, "most padded source tokens in a batch", cli_default=4096)
    length_penalty_form: str = _option(
        "fairseq", "fairseq: score / |Y|**alpha; gnmt: score / ((5 + |Y|) / 6)**alpha", choices=LENGTH_PENALTY_FORMS
    )
    max_source_tokens: int | None = _option(
        MAX_SOURCE_TOKENS, "a longer input line is refused before anything is translated"
    )
    max_output_tokens: int = _option(MAX_OUTPUT_TOKENS, "absolute cap on a translation")
    buffer_size: int | None = _option(None, "input lines sorted into batches together", cli_default=1000)

    def __post_init__(self):
        for name in ("batch_size", "num_beams", "max_output_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
        for name in ("max_tokens", "max_source_tokens", "buffer_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"`{name}` must be an integer >= 1 (or None for no limit), got {value!r}.")
        if self.length_penalty_form not in LENGTH_PENALTY_FORMS:
            raise ValueError(
                f"`length_penalty_form` must be one of {LENGTH_PENALTY_FORMS}, got {self.length_penalty_form!r}."
            )
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"`length_penalty` must be a finite number, got {self.length_penalty!r}.")
        a, b = self.max_length_a, self.max_length_b
        if not isinstance(a, (int, float)) or not 0 <= a <= MAX_LENGTH_A:
            raise ValueError(
                f"`max_length_a` must be a number in [0, {MAX_LENGTH_A:g}] (output tokens per source token), "
                f"got {a!r}."
            )
        if not _is_int(b) or not 0 <= b <= self.max_output_tokens:
            raise ValueError(
                f"`max_length_b` must be an integer in [0, {self.max_output_tokens}] (`max_output_tokens`), got {b!r}."
            )
        if a == 0 and b < 1:
            raise ValueError(
                "The output cap `max_length_a * source_length + max_length_b` must allow >= 1 token; got "
                f"a={a}, b={b}."
            )

    # ---- built from ... -------------------------------------------------------------------------------------------

    @classmethod
    def build(cls, options: DecodingOptions | None = None, **settings) -> DecodingOptions:
        """`options` with the single `settings` (fields, by name) replacing its values; the defaults when `options` is
        None. `TypeError` for anything else in the place of `options`, or a setting that is no field."""
        if options is not None and not isinstance(options, DecodingOptions):
            raise TypeError(
                f"`options` must be a DecodingOptions, got {options!r}; pass single settings by name (e.g. "
                "`num_beams=4`)."
            )
        names = [item.name for item in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise TypeError(f"{', '.join(map(repr, unknown))} is no decoding option; the options are {names}.")
        if options is None:
            return cls(**settings)
        return dataclasses.replace(options, **settings) if settings else options

    @classmethod
    def from_recipe(cls, export_args, training_args=None) -> DecodingOptions:
        """The decoding of a recipe's final evaluation: every validation line is translated (no source length limit),
        outputs capped at `MAX_EVALUATION_OUTPUT_TOKENS`; batches of `per_device_eval_batch_size` sentences (of
        `training_args`; without them, the default) and `eval_max_tokens` tokens."""
        batch_size = cls.batch_size if training_args is None else training_args.per_device_eval_batch_size
        return cls(
            batch_size=batch_size,
            num_beams=export_args.num_beams,
            length_penalty=export_args.length_penalty,
            length_penalty_form=export_args.length_penalty_form,
            max_length_a=export_args.max_length_a,
            max_length_b=export_args.max_length_b,
            max_tokens=export_args.eval_max_tokens,
            max_source_tokens=None,
            max_output_tokens=MAX_EVALUATION_OUTPUT_TOKENS,
        )

    @classmethod
    def command_line_flags(cls) -> list[tuple[str, dataclasses.Field, object]]:
        """(flag, field, the flag's default) of each option: `--batch-size` for `batch_size`, ..."""
        flags = []
        for item in dataclasses.fields(cls):
            default = item.metadata.get("cli_default", item.default)
            flags.append(("--" + item.name.replace("_", "-"), item, default))
        return flags

    @classmethod
    def from_arguments(cls, args, generation_config=None) -> DecodingOptions:
        """The options of parsed `command_line_flags`. `num_beams` and `length_penalty` not given come from the
        model's `generation_config` (beams 1, penalty 1.0 where it has none); without one (before the model is
        loaded, to check the rest) they keep the defaults."""
        values = {item.name: getattr(args, item.name) for item in dataclasses.fields(cls)}
        saved = generation_config
        if values["num_beams"] is None:
            values["num_beams"] = (getattr(saved, "num_beams", None) or 1) if saved is not None else cls.num_beams
        if values["length_penalty"] is None:
            penalty = getattr(saved, "length_penalty", None) if saved is not None else cls.length_penalty
            values["length_penalty"] = 1.0 if penalty is None else penalty
        return cls(**values)

    # ---- turned into ... -----------------------------------------------------------------------------------------

    @property
    def gnmt(self) -> bool:
        """Whether the GNMT length penalty is applied by rescoring the final beam (beam search runs without one)."""
        return self.length_penalty_form == "gnmt" and self.num_beams > 1

    def output_cap(self, source_tokens: int) -> int:
        """The most tokens a translation of a `source_tokens` source may have before `</s>` (at least 1 on a model's
        decoding: see `output_limits`)."""
        return min(int(self.max_length_a * source_tokens + self.max_length_b), self.max_output_tokens)

    def output_limits(self, source_lengths):
        """`output_cap` of each source length in a tensor, at least 1; of a numpy array (the backends that run without
        torch), the same values: torch computes `a * length + b` in float32, and so does the array's version, which
        then truncates as torch's `long()` does."""
        if not hasattr(source_lengths, "long"):  # a numpy array
            import numpy as np

            a, b = np.float32(self.max_length_a), np.float32(self.max_length_b)
            limits = a * np.asarray(source_lengths).astype(np.float32) + b
            return limits.astype(np.int64).clip(1, self.max_output_tokens)
        limits = self.max_length_a * source_lengths + self.max_length_b
        return limits.long().clamp(min=1, max=self.max_output_tokens)

    def generation_settings(self, max_source_length: int) -> dict:
        """What a model's `generation_config` keeps of these options (a recipe's, for its evaluation during training
        and its export): beams, the penalty's alpha (`generate()` applies the fairseq form; a GNMT-form alpha is kept
        as given, the model card says which), and as `max_length` the output cap of the longest allowed source, the
        start token + `max_length_a * max_source_length + max_length_b` tokens + `</s>`, without `max_new_tokens`
        (beside which `Seq2SeqTrainer` evaluation would fill in transformers' default `max_length` of 20)."""
        cap = int(self.max_length_a * max_source_length + self.max_length_b)
        return dict(
            num_beams=self.num_beams, length_penalty=self.length_penalty, max_length=cap + 2, max_new_tokens=None
        )

    def generate_kwargs(self, longest: int) -> dict:
        """The options of `generate()` for a batch whose longest `output_limits` is `longest`: beam search without
        sampling, the fairseq penalty applied by `generate()` itself (no penalty, all `num_beams` hypotheses and their
        scores returned for GNMT rescoring), `max_length` the start token, `longest` tokens and `</s>`
        (`max_new_tokens` would log)."""
        return dict(
            num_beams=self.num_beams,
            num_return_sequences=self.num_beams if self.gnmt else 1,
            length_penalty=0.0 if self.gnmt else self.length_penalty,
            max_length=longest + 2,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=self.gnmt,
        )


class SavedGenerationConfig:
    """The values of a generation_config.json as attributes, read without transformers by the decoders that import
    none (ONNX Runtime's, CTranslate2's); a setting the file leaves out is None, as transformers' `GenerationConfig`
    leaves every setting these decoders and `DecodingOptions.from_arguments` read (its defaults apply when it
    generates)."""

    def __init__(self, values: dict):
        self.__dict__.update(values)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None
