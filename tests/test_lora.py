"""LoRA through peft with its defaults (`LoraConfig(task_type="SEQ_2_SEQ_LM")`, no `target_modules`) on every family:
what is adapted, a few training steps, an adapter saved and loaded back with identical outputs (README recipe)."""

import pytest
import torch
from conftest import method_families
from torch import nn
from transformers import AutoModelForSeq2SeqLM, Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_deep_nmt import DlclConfig, MscConfig
from hf_deep_nmt.adapters import GRU_PARAMETERS

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402

# every registered method's tiny variants (`METHODS`): plain pre- and post-norm, the AAN with its FFN, DLCL both
# ways, DS-Init with MAtt, SDT's sparse blocks with relative keys, MSC (GRU parameters), DeepNorm
FAMILIES = method_families(every_check=True)


def batch(padded_batch):
    return {key: padded_batch[key] for key in ("input_ids", "attention_mask", "labels", "decoder_attention_mask")}


def train(model, inputs, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", FAMILIES)
def test_default_lora_adapts_every_linear_map_inside_the_layers(family, tiny_config, random_model):
    config_class, overrides = FAMILIES[family]
    model = random_model(tiny_config(config_class, **overrides))
    linear = {name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name != "lm_head"}
    peft_model = get_peft_model(model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=2))
    adapted = {
        name.removeprefix("base_model.model.")
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer)
    }
    assert adapted == linear
    trainable = {name for name, parameter in peft_model.named_parameters() if parameter.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_lora_trains_saves_and_reloads_with_identical_outputs(
    family, tiny_config, random_model, padded_batch, tmp_path
):
    config_class, overrides = FAMILIES[family]
    random_model(tiny_config(config_class, **overrides)).save_pretrained(tmp_path / "base")
    model = get_peft_model(
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "base"),
        LoraConfig(task_type="SEQ_2_SEQ_LM", r=4, lora_alpha=8),
    )
    inputs = batch(padded_batch)
    losses = train(model, inputs)
    assert losses[-1] < losses[0], losses
    model.save_pretrained(tmp_path / "adapter")
    assert sorted(path.name for path in (tmp_path / "adapter").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "base").eval()
    reloaded = PeftModel.from_pretrained(
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    )
    model.eval(), reloaded.eval()
    source = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    with torch.no_grad():
        logits = model(**inputs).logits
        torch.testing.assert_close(reloaded(**inputs).logits, logits, rtol=0, atol=1e-5)
        generated = model.generate(**source, num_beams=2, max_length=7)
        assert torch.equal(reloaded.generate(**source, num_beams=2, max_length=7), generated)
        torch.testing.assert_close(reloaded.merge_and_unload()(**inputs).logits, logits, rtol=0, atol=1e-5)
        assert (base(**inputs).logits - logits).abs().max() > 1e-2  # the adapter changed the model
    # and only the adapter: without it, the trained model is the saved base again
    unloaded, saved = model.unload().state_dict(), base.state_dict()
    assert unloaded.keys() == saved.keys() and all(torch.equal(unloaded[key], saved[key]) for key in saved)


@pytest.mark.parametrize(
    ("settings", "trained"),
    [
        # lora_A and lora_B for each of the two weight matrices of the one shared cell
        ({"target_parameters": list(GRU_PARAMETERS)}, 4),
        # a trained copy of the cell's two weight matrices and two biases
        ({"modules_to_save": ["context"]}, 4),
    ],
    ids=["lora-on-gru-weights", "gru-in-full"],
)
def test_the_msc_gru_context_cell_trains_and_reloads(
    settings, trained, tiny_config, random_model, padded_batch, tmp_path
):
    random_model(tiny_config(MscConfig, msc_block_layers=[2, 1])).save_pretrained(tmp_path / "base")
    model = get_peft_model(
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "base"), LoraConfig(task_type="SEQ_2_SEQ_LM", r=4, **settings)
    )
    gru = {name for name, parameter in model.named_parameters() if parameter.requires_grad and ".cells." in name}
    assert len(gru) == trained, gru
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters() if name in gru}
    inputs = batch(padded_batch)
    train(model, inputs)
    assert any(not torch.equal(parameter, before[name]) for name, parameter in model.named_parameters() if name in gru)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    )
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**inputs).logits, model.eval()(**inputs).logits, rtol=0, atol=1e-5)


def test_readme_lora_recipe_with_seq2seq_trainer(tiny_config, random_model, padded_batch, tmp_path):
    random_model(tiny_config(DlclConfig)).save_pretrained(tmp_path / "base")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "base")
    model = get_peft_model(model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=8, lora_alpha=16, lora_dropout=0.1))
    inputs = batch(padded_batch)
    rows = [{key: value[row] for key, value in inputs.items()} for row in range(2)] * 4
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=2,
        max_steps=4,
        learning_rate=1e-2,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        save_strategy="no",
    )
    Seq2SeqTrainer(model=model, args=args, train_dataset=rows).train()
    model.save_pretrained(tmp_path / "adapter")
    base = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "base")
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model.eval()(**inputs).logits, rtol=0, atol=1e-5)
