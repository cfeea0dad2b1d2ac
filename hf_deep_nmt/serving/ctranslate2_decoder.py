"""Decoding with CTranslate2, for the families it expresses: `CTranslate2Decoder` runs the model that
`hf-deep-nmt export-ctranslate2` wrote (`hf_deep_nmt.serving.ctranslate2`) with `ctranslate2.Translator`, greedy or
with beam search, on the CPU; `int8` decodes with CTranslate2's int8 compute type, converted as the model loads (no
second export). It is a `Decoder`: `translate` runs it in a model's place (`load_ctranslate2_model`,
`hf-deep-nmt translate --backend ctranslate2`).

The model lives in a model folder's `ctranslate2/` subfolder (`export-ctranslate2 --into-model`), where `push`
uploads it with the model, or in a folder of its own (`export-ctranslate2 --output`); `ctranslate2_folder` finds
either. The `ctranslate2` package is imported only when a decoder is made, so that naming this backend costs nothing.
Decoding imports neither torch nor transformers: the settings it takes from the folder's files are read as JSON
(`hf_deep_nmt.serving.ctranslate2_layout`), and its tokenizer is a `PlainTokenizer` where the folder's tokenizer
files allow; a file that holds what the plain reading does not reproduce is read by transformers, as before.

What matches the torch backend: the tokens of greedy search, and each sentence's output cap (`translate` caps every
sentence by its own length; CTranslate2 takes one cap per call, so a batch is decoded under its largest cap, greedy
outputs cut to their own, and beam search run again, under its own cap, for a sentence whose hypothesis outran it).
Beam search is CTranslate2's own: the same fairseq length penalty and scores, and a stopping rule (its `patience`)
chosen to follow the model's `early_stopping`, so that most sentences, not always all, agree with `generate()`'s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from hf_deep_nmt.fingerprints import check_tokenizer_matches
from hf_deep_nmt.serving.ctranslate2_layout import (
    CTRANSLATE2_SUBFOLDER,
    IDENTITY_FILE,
    UNSUPPORTED_GENERATION,
    SavedGenerationConfig,
    ctranslate2_blockers,
    read_generation_config,
    read_identity,
    require_ctranslate2,
    servable_by_plain_reading,
)
from hf_deep_nmt.serving.decoder import Decoder
from hf_deep_nmt.serving.options import DecodingOptions
from hf_deep_nmt.serving.plain_tokenizer import load_tokenizer
from hf_deep_nmt.serving.threads import check_threads

PURPOSE = "decoding with CTranslate2"
# Settings of a saved generation config that CTranslate2 applies the same way, under its own names (`bad_words_ids`
# and `suppress_tokens`, which converted Marian models set, become its `suppress_sequences`; `min_length` counts the
# start token, CTranslate2's `min_decoding_length` does not).
MAPPED_GENERATION = {"repetition_penalty": "repetition_penalty", "no_repeat_ngram_size": "no_repeat_ngram_size"}


def _translator_settings(saved) -> dict:
    """The options of `Translator.translate_batch` that the generation config `saved` decides, as `generate()`
    applies them; `suppress_sequences` as token ids (made token strings per batch, with the tokenizer)."""
    settings = {ours: getattr(saved, theirs) for theirs, ours in MAPPED_GENERATION.items() if getattr(saved, theirs)}
    # CTranslate2's defaults differ from generate()'s: at least one token before `</s>`, inputs cut at 1024 tokens
    settings["min_decoding_length"] = max(0, (saved.min_length or 0) - 1)
    settings["max_input_length"] = 0  # no cut: `check_fits` refuses what the position table cannot hold
    banned = [list(ids) for ids in saved.bad_words_ids or []] + [[token] for token in saved.suppress_tokens or []]
    settings["suppress_sequences"] = banned or None
    # generate()'s stopping rule, as near as CTranslate2's patience comes: `early_stopping=True` ends a sentence once
    # it has `num_beams` finished hypotheses (patience 1); otherwise (transformers' default) it goes on while a
    # running one may still win, which patience 2 (2 x num_beams finished) followed on every sentence tried
    settings["patience"] = 1 if saved.early_stopping is True else 2
    return settings


def _is_ctranslate2_model(folder: Path) -> bool:
    return (folder / "model.bin").is_file() and (folder / "config.json").is_file()


def export_command(model) -> str:
    return f"`hf-deep-nmt export-ctranslate2 --model {model} --into-model`"


def ctranslate2_folder(model: str | Path) -> Path:
    """The CTranslate2 model that `model` names: an `export-ctranslate2` folder itself, or a model folder's
    `ctranslate2/` subfolder; a name that is no local path is taken as a Hub repository id, and its `ctranslate2/`
    folder downloaded. `FileNotFoundError` naming the model when it is written as a path that does not exist or is no
    Hub id either (before any Hub lookup, as `onnx_folder` does), and naming the command that writes it when there is
    none."""
    from hf_deep_nmt.model_folders import check_model_name

    path = check_model_name(model, "Model", check_hub_id=False)
    if path is None:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(model), allow_patterns=[f"{CTRANSLATE2_SUBFOLDER}/*"]))
    found = next((folder for folder in (path, path / CTRANSLATE2_SUBFOLDER) if _is_ctranslate2_model(folder)), None)
    if found is None:
        raise FileNotFoundError(
            f"{model} holds no CTranslate2 model (no model.bin in it or in its {CTRANSLATE2_SUBFOLDER}/ folder); "
            f"write it with {export_command(model)}."
        )
    return found


def _saved_config(path: Path) -> dict | None:
    """The parsed config.json of a local model folder; None for a Hub id, or a file that is not a JSON object."""
    try:
        values = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return values if isinstance(values, dict) else None


def _family_blockers(model: str | Path) -> list[str]:
    """`ctranslate2_blockers` of the config of `model` (a model folder or Hub id); none for a CTranslate2 folder
    itself, which an export already passed, nor for a config.json that `servable_by_plain_reading` passes without
    transformers. The rest (a refusal to word, a Hub id, a config only its class can read) goes through transformers,
    which also names a config.json it cannot read."""
    path = Path(str(model)).expanduser()
    if _is_ctranslate2_model(path):
        return []
    values = _saved_config(path)
    if values is not None and servable_by_plain_reading(values):
        return []
    from transformers import AutoConfig

    from hf_deep_nmt import registration  # noqa: F401  (AutoConfig reads this package's model types)

    return ctranslate2_blockers(AutoConfig.from_pretrained(str(model)))


class CTranslate2Decoder(Decoder):
    """Greedy and beam search with `ctranslate2.Translator` over an `export-ctranslate2` folder, on the CPU with
    `threads` threads (CTranslate2's intra_threads, one translation at a time); `int8`: int8 compute."""

    def __init__(self, folder: str | Path, int8: bool = False, threads: int = 1):
        ctranslate2 = require_ctranslate2(PURPOSE)
        self.folder, self.int8 = Path(folder), int8
        self.translator = ctranslate2.Translator(
            str(self.folder),
            device="cpu",
            compute_type="int8" if int8 else "float32",
            intra_threads=threads,
            inter_threads=1,
        )
        # a folder exported before the identity file (`IDENTITY_FILE`) was written: checked on what a config without a
        # fingerprint allows (`check_tokenizer_matches` warns that the tokenizer itself was not)
        fields = read_identity(self.folder)
        self.max_positions = fields.pop("max_positions", None)
        self.identity = SimpleNamespace(config=SimpleNamespace(_name_or_path=str(self.folder), **fields))
        self.settings = _translator_settings(self.generation_config)

    @classmethod
    def check_settings(cls, *, device: str | None = None, compile: bool = False, int8: bool = False) -> None:
        super().check_settings(device=device, compile=compile, int8=int8)
        if compile:
            raise ValueError(
                "`compile=True` (`--compile`) compiles the torch model; the CTranslate2 backend runs its own C++ "
                "decoder: drop it."
            )
        if device not in (None, "cpu"):
            raise ValueError(
                f"--device {device} is for --backend torch; --backend ctranslate2 decodes on the CPU: drop it."
            )

    @classmethod
    def unavailable_reason(cls, model: str | Path, *, int8: bool = False) -> str | None:
        """Why this backend cannot run `model` here (None: it can): no ctranslate2 package, a family CTranslate2
        cannot express (each setting named), no exported model (naming the command that writes it), or, with `int8`,
        a CPU CTranslate2 has no int8 compute type for (the weights themselves are converted as they load)."""
        try:
            ctranslate2 = require_ctranslate2(PURPOSE)
            if int8 and "int8" not in ctranslate2.get_supported_compute_types("cpu"):
                return "CTranslate2 has no int8 compute type on this CPU: drop --int8."
            blockers = _family_blockers(model)
            if blockers:
                return f"CTranslate2 cannot express this model: {'; '.join(blockers)}."
            ctranslate2_folder(model)
        except (OSError, ValueError, RuntimeError) as error:
            return str(error)
        return None

    @classmethod
    def load(cls, model: str | Path, *, int8: bool = False, threads: int | None = None, device: str | None = None):
        """`load_ctranslate2_model`: the model of `ctranslate2_folder(model)`, on the CPU (what `serve` makes)."""
        cls.check_settings(device=device, int8=int8)
        return load_ctranslate2_model(model, int8, threads)

    @property
    def generation_config(self):
        """The generation config saved beside the CTranslate2 model (`export_ctranslate2`), else transformers'
        defaults: read as JSON (`read_generation_config`), or by transformers where it holds what that reading does
        not reproduce."""
        saved = read_generation_config(self.folder)
        if saved is not None:
            return saved
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(self.folder)

    def check(self, tokenizer, options: DecodingOptions) -> None:
        """Refuse the GNMT penalty (CTranslate2 applies the fairseq form while it searches), a saved generation
        setting CTranslate2 has no counterpart for, and a tokenizer that is not the model's (its fingerprint)."""
        if options.gnmt:
            raise ValueError(
                '`length_penalty_form="gnmt"` (`--length-penalty-form gnmt`) rescores every final beam, and the '
                "CTranslate2 backend applies the fairseq form while it searches: use the fairseq form, or the torch "
                "backend."
            )
        saved = self.generation_config
        if isinstance(saved, SavedGenerationConfig):
            defaults = SavedGenerationConfig({})
        else:
            from transformers import GenerationConfig

            defaults = GenerationConfig()
        end = saved.eos_token_id if isinstance(saved.eos_token_id, list) else [saved.eos_token_id]
        allowed = {name: [getattr(defaults, name, None)] for name in UNSUPPORTED_GENERATION}
        allowed["forced_eos_token_id"] += end  # what the output cap forces anyway
        unsupported = [
            f"{name}={getattr(saved, name)!r}"
            for name in UNSUPPORTED_GENERATION
            if getattr(saved, name, None) not in allowed[name]
        ]
        if unsupported:
            raise ValueError(
                f"The model's generation config sets {', '.join(unsupported)}, which CTranslate2's decoding has no "
                "counterpart for: use --backend torch, or remove the setting from "
                f"{self.folder / 'generation_config.json'}."
            )
        check_tokenizer_matches(self.identity, tokenizer)

    def check_fits(self, batches: Sequence[tuple[int, int]], options: DecodingOptions) -> None:
        """Refuse, before the first batch, a source or an output cap the export's position table has no rows for
        (CTranslate2 would stop mid-translation: "No position encodings are defined for positions >= N"). Memory is
        not estimated: CTranslate2 allocates its own."""
        if self.max_positions is None or not batches:  # an export from before the table's size was recorded
            return
        source = max(longest for _, longest in batches)
        output = options.output_cap(source) + 2  # the start token and `</s>`, as the exporter counts
        for what, needed in (("its longest source", source), ("the start token, its output cap and </s>", output)):
            if needed > self.max_positions:
                raise ValueError(
                    f"A batch needs {needed} positions ({what}), and the CTranslate2 export's position table has "
                    f"{self.max_positions} rows: export again with a larger --max-positions, or lower "
                    "--max-source-tokens, --max-length-a/b or --max-output-tokens."
                )

    def _search(self, tokenizer, tokens: list[list[str]], cap: int, options: DecodingOptions) -> list[list[str]]:
        """The best hypothesis of each source (tokens, without `</s>`), at most `cap` tokens long."""
        settings = dict(self.settings)
        if settings["suppress_sequences"]:
            settings["suppress_sequences"] = [
                tokenizer.convert_ids_to_tokens(ids) for ids in settings["suppress_sequences"]
            ]
        results = self.translator.translate_batch(
            tokens,
            beam_size=options.num_beams,
            length_penalty=options.length_penalty,
            max_decoding_length=cap,
            return_scores=False,
            **settings,
        )
        return [result.hypotheses[0] for result in results]

    def translate_batch(self, tokenizer, sources: list[list[int]], options: DecodingOptions) -> list[str]:
        """Decoded under `options.output_limits` of each source's length (see the module docstring), the fairseq
        length penalty `options.length_penalty`."""
        limits = options.output_limits(np.array([len(ids) for ids in sources], dtype=np.int64)).tolist()
        tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in sources]
        outputs = self._search(tokenizer, tokens, max(limits), options)
        if options.num_beams > 1:
            for cap in sorted({cap for cap, output in zip(limits, outputs) if len(output) > cap}):
                again = [i for i, output in enumerate(outputs) if limits[i] == cap and len(output) > cap]
                for index, output in zip(again, self._search(tokenizer, [tokens[i] for i in again], cap, options)):
                    outputs[index] = output
        ids = [tokenizer.convert_tokens_to_ids(output[:cap]) for output, cap in zip(outputs, limits)]
        return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def load_ctranslate2_model(model: str | Path, int8: bool = False, threads: int | None = None):
    """(`CTranslate2Decoder`, tokenizer) of `ctranslate2_folder(model)`, on `threads` CTranslate2 threads (None:
    `threads.default_threads()`). The decoder takes the place of the model in `hf_deep_nmt.serving.translate`'s
    `translate`, `write_translations` and `translate_file`. The tokenizer is `plain_tokenizer.load_tokenizer`'s:
    without transformers where the folder's tokenizer allows."""
    from hf_deep_nmt.model_folders import TOKENIZER_JSON_FILES, check_saved_json_files

    require_ctranslate2(PURPOSE)
    threads = check_threads(threads)
    folder = ctranslate2_folder(model)
    # its tokenizer files, named here when damaged: transformers' message names neither the file nor the way out (its
    # config.json is CTranslate2's own)
    way_out = f"write it again with {export_command(model)}"
    names = (*TOKENIZER_JSON_FILES, "generation_config.json", IDENTITY_FILE)
    check_saved_json_files(folder, "CTranslate2 folder", way_out, names=names)
    return CTranslate2Decoder(folder, int8=int8, threads=threads), load_tokenizer(folder)
