"""`hf-deep-nmt convert-marian`: a transformers `MarianMTModel` (an OPUS-MT model: a folder or a Hub id) as a model of
this package that computes the same thing.

What MarianMTModel computes, read from its code in transformers 5.24, and how it maps here:

* post-norm layers (`x <- LN(x + Drop(F(x)))`), no final LayerNorm on either stack, no LayerNorm on the embeddings:
  `pre_norm=False`, residual layers; the parameter names of the layers are the same on both sides;
* token embeddings times sqrt(d_model) when `scale_embedding` (else 1), plus sinusoidal positions counted from 0 with
  sin in the first half and cos in the second, frequencies 10000^(-2i/d): `sinusoid_frequencies="marian"`. The
  conversion compares this package's table with the source's position table row by row;
* the feed-forward activation by name (`swish` is SiLU), in both packages taken from transformers' table;
* `final_logits_bias` added to the logits: `output_bias=True` when it is not all zeros;
* embeddings: one matrix for source and target when the source's encoder and decoder embeddings are one matrix
  (`share_encoder_decoder_embeddings`, and equal), else two; the output layer tied to the target embeddings when the
  source's is (`tie_word_embeddings`, and equal), else a matrix of its own. Under transformers 5, a Marian model with
  a shared vocabulary but `tie_word_embeddings=False` unties its encoder and decoder embeddings too: it converts to
  separate embeddings of the same size, as it computes;
* special ids (pad, eos, bos, decoding starts from pad) and the generation config (beam size, length penalty, output
  cap, bad words, forced end token, ...) are carried over as they are; the tokenizer is saved into the folder.

Refused before anything is written, by name: a source that is not a `MarianMTModel` (another model type or head), a
position table that is not the sinusoid above, an odd `d_model`, parameters without a place in this package's model.
Not carried over: `encoder_layerdrop` / `decoder_layerdrop` (layer drop in training; a warning says so), and the
position limit `max_position_embeddings` (this package computes positions for any length).

Before writing, the converted model is run next to the source on a probe batch and must give the same logits.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from hf_deep_nmt import registration  # noqa: F401  (the converted model is saved with its `auto_map` and model code)
from hf_deep_nmt.fingerprints import record_tokenizer_fingerprint
from hf_deep_nmt.folders import check_export_folder, write_marked_folder
from hf_deep_nmt.hub import settle_output_cap
from hf_deep_nmt.model_folders import check_model_folder
from hf_deep_nmt.modeling.configuration_deep_nmt import DeepNMTConfig
from hf_deep_nmt.modeling.modeling_deep_nmt import CODE_VERSION, DeepNMTForConditionalGeneration

logger = logging.getLogger(__name__)

MARIAN_MODEL_TYPE = "marian"
MARIAN_ARCHITECTURE = "MarianMTModel"
OVERWRITE_FLAG = "`overwrite=True`, or `--overwrite` on the command line"
# Largest difference of the probe logits (fp32) that the conversion accepts before writing anything.
PROBE_TOLERANCE = 1e-4
# Difference allowed between the source's stored position table and this package's sinusoids (float32 rounding).
POSITION_TOLERANCE = 1e-6
# Source tensors recomputed on this side rather than copied: the position tables.
RECOMPUTED = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")


def _load_marian(source: str | Path):
    """The source `MarianMTModel` in float32, eval mode; `ValueError` / `FileNotFoundError` naming what is wrong with
    a source that is not one."""
    from transformers import AutoConfig, MarianMTModel

    check_model_folder(
        source,
        "Marian model folder",
        config_hint="name a MarianMTModel folder or a Hub id such as Helsinki-NLP/opus-mt-en-de",
    )
    config = AutoConfig.from_pretrained(source)
    if config.model_type != MARIAN_MODEL_TYPE:
        raise ValueError(
            f"{str(source)!r} is a {config.model_type!r} model, not a Marian one (`model_type` "
            f"{MARIAN_MODEL_TYPE!r}): convert-marian converts MarianMTModel folders and Hub ids (OPUS-MT)."
        )
    architectures = getattr(config, "architectures", None) or [MARIAN_ARCHITECTURE]
    if MARIAN_ARCHITECTURE not in architectures:
        raise ValueError(
            f"`architectures={architectures!r}`: {str(source)!r} is not a {MARIAN_ARCHITECTURE} (a translation model "
            "with encoder and decoder); only that one converts."
        )
    if config.d_model % 2:
        raise ValueError(
            f"`d_model={config.d_model}` is odd: Marian's position table then has one more sine than cosine column, "
            "which this package's sinusoids do not express."
        )
    marian, info = MarianMTModel.from_pretrained(source, dtype=torch.float32, output_loading_info=True)
    missing = [key for key in info["missing_keys"] if key not in (*RECOMPUTED, "final_logits_bias")]
    if missing:
        raise ValueError(
            f"{str(source)!r} lacks weights of a {MARIAN_ARCHITECTURE}: {sorted(missing)[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; it would convert to a model that is partly random."
        )
    return marian.eval()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def deep_nmt_config(marian):
    """The `DeepNMTConfig` that computes what `marian` (a loaded `MarianMTModel`) computes."""
    source = marian.config
    for field in ("encoder_layerdrop", "decoder_layerdrop"):
        if getattr(source, field, 0.0):
            logger.warning(
                f"`{field}={getattr(source, field)!r}` is not carried over: this package has no layer drop (it only "
                "acts in training; the converted model computes what the source computes at inference)."
            )
    encoder_embed = marian.model.encoder.embed_tokens.weight
    decoder_embed = marian.model.decoder.embed_tokens.weight
    head = marian.lm_head.weight
    share = bool(getattr(source, "share_encoder_decoder_embeddings", True)) and _same(encoder_embed, decoder_embed)
    tie = bool(getattr(source, "tie_word_embeddings", True)) and _same(decoder_embed, head)
    norm = marian.model.encoder.layers[0].self_attn_layer_norm if source.encoder_layers else None
    return DeepNMTConfig(
        vocab_size=encoder_embed.shape[0],
        decoder_vocab_size=head.shape[0],
        d_model=source.d_model,
        encoder_layers=source.encoder_layers,
        decoder_layers=source.decoder_layers,
        encoder_attention_heads=source.encoder_attention_heads,
        decoder_attention_heads=source.decoder_attention_heads,
        encoder_ffn_dim=source.encoder_ffn_dim,
        decoder_ffn_dim=source.decoder_ffn_dim,
        activation_function=source.activation_function,
        dropout=float(source.dropout),
        attention_dropout=float(source.attention_dropout),
        activation_dropout=float(source.activation_dropout),
        scale_embedding=bool(source.scale_embedding),
        sinusoid_frequencies="marian",
        output_bias=bool(marian.final_logits_bias.any()),
        share_embeddings=share,
        tie_word_embeddings=tie,
        pre_norm=False,
        layer_aggregation="residual",
        layer_norm_eps=norm.eps if norm is not None else 1e-5,
        pad_token_id=source.pad_token_id,
        # Marian has no beginning-of-sentence token (None): its decoder starts from `decoder_start_token_id`, which
        # is what a start token means to the exports (CTranslate2 needs an id of the vocabulary there)
        bos_token_id=source.bos_token_id if source.bos_token_id is not None else source.decoder_start_token_id,
        eos_token_id=source.eos_token_id,
        decoder_start_token_id=source.decoder_start_token_id,
    )


def _check_positions(marian, model) -> None:
    """The source's position tables are the sinusoids this model computes, row for row."""
    for side in ("encoder", "decoder"):
        table = getattr(marian.model, side).embed_positions.weight.detach()
        ours = getattr(model.model, side).embed_positions(torch.arange(table.shape[0]))
        difference = (table - ours).abs().max().item()
        if difference > POSITION_TOLERANCE:
            raise ValueError(
                f"`model.{side}.embed_positions.weight` of the source is not Marian's sinusoid table (it differs from "
                f"it by up to {difference:.3g}): learned or altered positions do not convert."
            )


def convert_marian_model(marian):
    """A `DeepNMTForConditionalGeneration` holding the weights of `marian` (a loaded `MarianMTModel`), in eval mode,
    with its generation config; checked to give the same logits on a probe batch."""
    config = deep_nmt_config(marian)
    model = DeepNMTForConditionalGeneration(config).eval()
    source = marian.state_dict()
    wanted = {
        "model.shared.weight": marian.model.encoder.embed_tokens.weight,
        "model.encoder.embed_tokens.weight": marian.model.encoder.embed_tokens.weight,
        "model.decoder.embed_tokens.weight": marian.model.decoder.embed_tokens.weight,
        "lm_head.weight": marian.lm_head.weight,
    }
    if config.output_bias:
        wanted["lm_head.bias"] = marian.final_logits_bias[0]
    used = {"model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
    used |= {"lm_head.weight", "final_logits_bias", *RECOMPUTED}
    for key in model.state_dict():
        if key not in wanted:
            if key not in source:
                raise ValueError(f"The source has no tensor for {key!r} of the converted model.")
            wanted[key] = source[key]
            used.add(key)
    left = sorted(set(source) - used)
    if left:
        raise ValueError(
            f"The source has parameters without a place in this package's model: {left[:5]}"
            f"{' ...' if len(left) > 5 else ''}; it is not the MarianMTModel this conversion knows."
        )
    model.load_state_dict({key: tensor.detach().clone() for key, tensor in wanted.items()}, strict=True)
    _check_positions(marian, model)
    generation_config = copy.deepcopy(marian.generation_config)
    generation_config.use_cache = True
    model.generation_config = settle_output_cap(generation_config)
    _check_probe(marian, model)
    return model


def _check_probe(marian, model) -> None:
    """Both models give the same logits on a small batch with padding (`RuntimeError` otherwise)."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    vocab = min(config.vocab_size, config.decoder_vocab_size)
    source = torch.randint(0, vocab, (2, 7), generator=generator)
    mask = torch.ones_like(source)
    mask[1, 5:] = 0
    target = torch.randint(0, config.decoder_vocab_size, (2, 5), generator=generator)
    target[:, 0] = config.decoder_start_token_id
    with torch.no_grad():
        expected = marian(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
        got = model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits
    difference = (expected - got).abs().max().item()
    if not difference <= PROBE_TOLERANCE:
        raise RuntimeError(
            f"The converted model's logits differ from the source's by {difference:.3g} on a probe batch (at most "
            f"{PROBE_TOLERANCE:g} expected); nothing was written."
        )


def _source_tokenizer(source: str | Path):
    """The source's tokenizer, or None when it has none (a folder without tokenizer files)."""
    from transformers import AutoTokenizer

    path = Path(source).expanduser()
    if path.is_dir():
        names = {entry.name for entry in path.iterdir()}
        tokenizer_files = {"tokenizer_config.json", "tokenizer.json", "source.spm", "target.spm", "vocab.json"}
        if not names & tokenizer_files:
            logger.warning(f"{str(source)!r} has no tokenizer files: the converted folder gets none.")
            return None
    return AutoTokenizer.from_pretrained(source)


def source_licence(source: str | Path) -> str | None:
    """The `license` of the source's model card (`README.md` front matter: a folder's own file, or the Hub
    repository's), or None when it has no card, the card names none, or the Hub cannot be reached."""
    from huggingface_hub import hf_hub_download, metadata_load

    path = Path(source).expanduser()
    try:
        card = path / "README.md" if path.exists() else Path(hf_hub_download(str(source), "README.md"))
        metadata = metadata_load(card) if card.is_file() else None
    except Exception as error:  # no card in the repository, offline, ...: the licence is unknown, not an error
        logger.warning(f"No model card read from {str(source)!r} ({type(error).__name__}): its licence is unknown.")
        return None
    licence = (metadata or {}).get("license")
    return str(licence) if isinstance(licence, str) and licence.strip() else None


def origin_record(source: str | Path, marian) -> dict:
    """What `DeepNMTConfig.converted_from` records of a conversion: the source's Hub id (or a local folder's name
    only: its path on this machine is nobody else's business), revision, class and licence, and this package's
    version. The model card renders it."""
    path = Path(source).expanduser()
    local = path.exists()
    record = {
        "model": path.resolve().name if local else str(source),
        "location": "local folder" if local else "hub",
        "architecture": MARIAN_ARCHITECTURE,
        "license": source_licence(source),
        "converter": f"hf-deep-nmt {CODE_VERSION} convert-marian",
    }
    revision = getattr(marian.config, "_commit_hash", None)
    if revision and not local:
        record["revision"] = revision
    return record


def convert_marian(source: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write into `out` a model of this package that computes what the `MarianMTModel` at `source` (a folder or a Hub
    id) computes, with its tokenizer and generation config. Returns the folder.

    `out` is refused when it exists and is not empty, unless `overwrite=True`, and even then when it holds files that
    this package did not write. Everything is checked before anything is written: what cannot be converted is
    refused by name (`ValueError`), and the converted model must give the source's logits on a probe batch. The config
    records the source (`converted_from`, see `origin_record`) for the model card."""
    local = {"the Marian model folder": source} if Path(str(source)).expanduser().is_dir() else {}
    check_export_folder(out, overwrite, flag=OVERWRITE_FLAG, protected=local, sources=local)
    marian = _load_marian(source)
    model = convert_marian_model(marian)
    model.config.converted_from = origin_record(source, marian)
    tokenizer = _source_tokenizer(source)
    if tokenizer is not None:  # made by this version: `grow` and the exports check the tokenizer against it
        record_tokenizer_fingerprint(model.config, tokenizer)

    def write(staging: Path) -> None:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)

    return write_marked_folder(out, write, overwrite=overwrite, flag=OVERWRITE_FLAG)


__all__ = ["convert_marian", "convert_marian_model", "deep_nmt_config", "origin_record", "source_licence"]
