"""The worked examples run as their docs say (examples/)."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, run_python

transformers = pytest.importorskip("transformers")


def test_the_finetune_hf_example_teaches_lora_adapters_to_answer_held_out_chat_questions(tmp_path):
    """examples/finetune_hf.py at its defaults: LoRA adapters trained on 2 processes on chat records answer
    questions no training record asked (the base model answers none of them: with --lr 0 this test fails), and
    RUN_DIR/adapter holds what a user loads with peft and transformers: the adapter and the tokenizer with its
    chat template."""
    pytest.importorskip("peft")
    run_dir = tmp_path / "finetune"
    proc = run_python([str(REPO / "examples" / "finetune_hf.py"), "--run_dir", str(run_dir)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    score = next(line for line in proc.stdout.splitlines() if line.startswith("held-out answers right:"))
    right, asked = map(int, score.split()[-1].split("/"))
    assert asked == 32 and right >= 24, proc.stdout[-2000:]
    logs = run_dir / "logs"
    assert "world size 2" in (logs / "rank-0.log").read_text() and (logs / "rank-1.log").is_file()
    adapter = run_dir / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_dict=False)
    assert prompt[0] == tokenizer.bos_token_id and tokenizer.decode(prompt).endswith("<|assistant|>")
