"""transformers 5 has no translation pipeline, as the README says (it names what to use instead): this fails when the
tasks come back, so that the README is updated."""

import pytest
from transformers import pipeline

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer


@pytest.mark.parametrize("task", ["translation", "translation_es_to_en", "text2text-generation", "summarization"])
def test_the_sequence_to_sequence_pipeline_tasks_are_removed(task, tiny_config):
    tokenizer = train_joint_tokenizer([("hola mundo", "hello world"), ("gracias", "thank you")] * 5, vocab_size=40)
    model = DlclForConditionalGeneration(tiny_config(DlclConfig, vocab_size=len(tokenizer)))
    with pytest.raises(KeyError, match=f"The task {task} has been removed from transformers"):
        pipeline(task, model=model, tokenizer=tokenizer)
