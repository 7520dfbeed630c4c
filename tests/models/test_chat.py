"""Fine-tuning data as practitioners bring it: chat records formatted with a chat template as transformers
formats them (its ids, and its assistant mask where the template marks one), the dataset shapes TRL reads found
from the fields, records tokenized exactly as inference tokenizes them (a Llama-style BOS), and the silent wrongs
of the Hugging Face data path made loud. A BPE tokenizer trained here on CPython's pydoc text,
with BOS/EOS and a chat template, saved as transformers saves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_close_weights, cli_in_process, one_line_error, run_cli, train, weights

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

# A template in the style of the chat models': each turn between role markers, ended by </s>; the prompt for a
# reply is the assistant's marker.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from pydoc_data.topics import topics

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([topics[key] for key in sorted(topics)], trainer)
    # As a Llama tokenizer does: BOS before every text it encodes with its special tokens.
    bpe.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    directory = tmp_path_factory.mktemp("tokenizer")
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                         chat_template=TEMPLATE).save_pretrained(directory)
    return directory


def words(n: int, offset: int = 0) -> list[str]:
    from pydoc_data.topics import topics

    return " ".join(topics[key] for key in sorted(topics)).split()[offset:offset + n]


def conversation(i: int) -> list[dict[str, str]]:
    """A system line, a question, its answer (the question's words reversed), a follow-up and its answer."""
    question = " ".join(words(3 + i % 4, i * 7))
    follow = " ".join(words(2, i * 7 + 50))
    return [{"role": "system", "content": "reverse the words"},
            {"role": "user", "content": question}, {"role": "assistant", "content": " ".join(reversed(question.split()))},
            {"role": "user", "content": follow}, {"role": "assistant", "content": " ".join(reversed(follow.split()))}]


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(96)))
    return path


# ChatML as TRL's *_training.jinja templates mark it: each reply and its <|im_end|> inside {% generation %}, the
# newline after it outside; CHATML is the same template unmarked.
CHATML_MARKED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
                 "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML = CHATML_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# What Llama 3.2's, cohere2's and gpt-oss's templates use: today's date, the tools as JSON, loop controls, a
# namespace, the reasoning read as `thinking`, the special tokens.
FEATURES = ("{{ bos_token }}<|system|>Today is {{ strftime_now('%d %b %Y') }}.{% if tools is not none %} Tools: "
            "{{ tools | tojson }}{% endif %}</s>{% set ns = namespace(turns=0) %}{% for m in messages %}"
            "{% if m['role'] == 'system' %}{% continue %}{% endif %}{% set ns.turns = ns.turns + 1 %}"
            "<|{{ m['role'] }}|>{% if m.thinking is defined %}({{ m.thinking }}){% endif %}{{ m['content'] }}"
            "{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}{{ eos_token }}"
            "{% if ns.turns > 6 %}{% break %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
            "{% endif %}")
FEATURES_MARKED = FEATURES.replace("{{ m['content'] }}", "{% if m['role'] == 'assistant' %}{% generation %}"
                                   "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}"
                                   "{% endif %}")
# Gemma's way with a system turn: the template's own raise_exception.
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             + CHATML)
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def tool_conversation(i: int) -> list[dict]:
    """A question answered through a tool call, the call's result, and the answer; the reply reasons first."""
    city = words(1, i)[0]
    return [{"role": "user", "content": f"weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "weather", "arguments": {"city": city}}}]},
            {"role": "tool", "content": "sunny", "name": "weather"},
            {"role": "assistant", "content": f"sunny in {city}", "reasoning_content": "the tool said so"}]


def tokenized(tokenizer_dir: Path, data: Path, *flags: str) -> list[dict]:
    """The records as ddptrain tokenizes them for training (its cache beside the data)."""
    from ddptrain.config import TrainConfig
    from ddptrain.models import hf

    cfg = TrainConfig(task="language_model", model="gpt", dataset=f"hf:{data}", tokenizer=str(tokenizer_dir),
                      seq_len=256, **dict(zip(flags[::2], flags[1::2])))
    train_ds, _ = hf.build_datasets(cfg.section("data"), data.parent)
    return [{k: v.tolist() for k, v in train_ds[i].items()} for i in range(len(train_ds))]


def test_chat_records_are_formatted_by_the_tokenizers_template_and_learn_only_the_assistants_turns(tokenizer_dir,
                                                                                                    chats):
    """The ids are transformers' apply_chat_template's, bitwise; the labelled tokens are exactly the assistant
    turns with their </s> (what the model must learn to say and where to stop); --train_on all labels every one."""
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = tokenized(tokenizer_dir, chats)
    for i, row in enumerate(rows[:8]):
        messages = conversation(i)
        assert row["input_ids"] == reference.apply_chat_template(messages, tokenize=True, return_dict=False)
        learnt = [token for token, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert [label for label in row["labels"] if label != -100] == learnt
        answers = [m["content"] + "</s>" for m in messages if m["role"] == "assistant"]
        assert reference.decode(learnt) == "".join(answers)
    everything = tokenized(tokenizer_dir, chats, "train_on", "all")
    assert everything[0]["labels"] == everything[0]["input_ids"]


def test_training_rows_are_tokenized_as_inference_tokenizes_a_prompt(tokenizer_dir, tmp_path):
    """A prompt/response record's ids begin with exactly what the tokenizer gives the prompt at inference (BOS
    first), and a text record's are the tokenizer's own encoding of the text, ended by </s>."""
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    data = tmp_path / "pairs.jsonl"
    prompt, response, text = " ".join(words(6)), " ".join(words(4, 40)), " ".join(words(9, 80))
    data.write_text(json.dumps({"q": prompt, "a": response, "text": text}) + "\n")
    [pair] = tokenized(tokenizer_dir, data, "prompt_field", "q", "response_field", "a")
    at_inference = reference(prompt)["input_ids"]
    assert at_inference[0] == reference.bos_token_id
    assert pair["input_ids"][:len(at_inference)] == at_inference
    assert pair["labels"][:len(at_inference)] == [-100] * len(at_inference)
    [plain] = tokenized(tokenizer_dir, data)
    assert plain["input_ids"] == reference(text)["input_ids"] + [reference.eos_token_id]


@pytest.mark.parametrize("case", ["null", "all-cut-off", "no-template", "not-messages", "task-fields",
                                  "template-refuses"])
def test_silent_wrongs_of_the_data_are_one_line_exit_2(case, tokenizer_dir, chats, tmp_path):
    data = tmp_path / "records.jsonl"
    flags = ["--prompt_field", "q", "--response_field", "a"]
    task = ["--task", "language_model", "--model", "gpt", "--vocab_size", "320", "--seq_len", "32"]
    tokenizer = str(tokenizer_dir)
    if case == "template-refuses":  # Gemma's template on a conversation with a system turn: its own raise_exception
        data.write_text(chats.read_text())
        (tmp_path / "gemma.jinja").write_text(NO_SYSTEM)
        flags = ["--chat_template", str(tmp_path / "gemma.jinja")]
    elif case == "null":
        data.write_text(json.dumps({"q": "a", "a": "b"}) + "\n" + json.dumps({"q": "c", "a": None}) + "\n")
    elif case == "all-cut-off":
        data.write_text("".join(json.dumps({"q": " ".join(words(40, i)), "a": "x"}) + "\n" for i in range(4)))
        task[-1] = "16"
    elif case == "no-template":
        data.write_text(chats.read_text())
        flags, tokenizer = [], str(tmp_path / "plain")
        reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        reference.chat_template = None
        reference.save_pretrained(tokenizer)
        (Path(tokenizer) / "chat_template.jinja").unlink(missing_ok=True)
    elif case == "not-messages":
        data.write_text(json.dumps({"messages": [{"role": "user", "text": "hi"}]}) + "\n")
        flags = []
    else:
        data.write_text(chats.read_text())
        flags, task = [], ["--task", "classification", "--model", "gpt", "--vocab_size", "320"]
    line = one_line_error(cli_in_process(["train", "--run_dir", str(tmp_path / "run"), *task, "--dataset", f"hf:{data}",
                                          "--tokenizer", tokenizer, *flags, "--no-progress", "--num_workers", "0"]))
    expected = {"null": ["record 1", "a", str(data)], "all-cut-off": ["--seq_len 16", "cut off", "prompt is"],
                "no-template": ["chat template", "--tokenizer"], "not-messages": ["record 0", "string content"],
                "task-fields": ["--text_field text", "--task classification reads"],
                "template-refuses": [f"--dataset {data}: record 0: the chat template refused it: System role not "
                                     "supported"]}[case]
    assert all(part in line for part in expected), line


def test_some_cut_off_records_and_blank_lines_are_counted_in_one_line_each(tokenizer_dir, tmp_path):
    data = tmp_path / "records.jsonl"
    long, short = " ".join(words(40)), " ".join(words(2))
    lines = [json.dumps({"q": long if i % 4 == 0 else short, "a": "x y"}) for i in range(8)]
    data.write_text("\n".join(lines[:3] + ["", "  "] + lines[3:]) + "\n\n")
    proc = run_cli(["train", "--run_dir", str(tmp_path / "run"), "--task", "language_model", "--model", "gpt",
                    "--vocab_size", "320", "--seq_len", "24", "--dataset", f"hf:{data}", "--tokenizer",
                    str(tokenizer_dir), "--prompt_field", "q", "--response_field", "a", "--max_steps", "1",
                    "--batch_size", "2", "--no-progress", "--num_workers", "0"])
    assert proc.returncode == 0, proc.stderr
    assert "2 of 8 records" in proc.stdout and "cut off by --seq_len 24" in proc.stdout
    assert f"--dataset {data}: 3 blank lines skipped (first: line 4)" in proc.stdout


def test_lora_on_chat_records_on_two_processes_learns_what_one_process_learns(tokenizer_dir, chats, tmp_path):
    """The fine-tuning path end to end: a Llama from a config, chat records, LoRA adapters; 2 processes with
    accumulation, under ddp and under fsdp (built on the meta device), equal 1 process on the whole batch
    (1e-5), and the training loss (assistant tokens only) falls."""
    pytest.importorskip("peft")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=320,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    base = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    job = ["--task", "language_model", "--model", f"hf:{base}", "--dataset", f"hf:{chats}", "--tokenizer",
           str(tokenizer_dir), "--seq_len", "64", "--lora_rank", "4", "--epochs", "2", "--lr", "0.01",
           "--optimizer", "adamw", "--save_every", "0", "--eval_size", "0"]
    train(tmp_path / "one", *job, "--batch_size", "16", timeout=300)
    train(tmp_path / "two", *job, "--batch_size", "4", "--grad_accum_steps", "2", nproc=2, timeout=300)
    train(tmp_path / "fsdp", *job, "--batch_size", "4", "--grad_accum_steps", "2", "--strategy", "fsdp", nproc=2,
          timeout=300)
    assert "fsdp: built on the meta device" in (tmp_path / "fsdp" / "logs" / "rank-0.log").read_text()
    for run in ("two", "fsdp"):
        assert_close_weights(weights(tmp_path / "one" / "model.safetensors"),
                             weights(tmp_path / run / "model.safetensors"), rel=1e-5)
    assert (tmp_path / "two" / "adapter" / "tokenizer.json").is_file(), "the tokenizer beside the adapter"
    losses = [json.loads(line)["loss"] for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("split") == "train"]
    assert losses[-1] < losses[0], losses


def test_a_tokenizer_retrained_in_the_same_directory_is_refused_on_resume(tokenizer_dir, tmp_path):
    """The checkpoint records the tokenizer's files' digest: the same --tokenizer path holding a retrained
    tokenizer (other merges, other ids) is a changed setting, exit 2 with one line, like any other."""
    import shutil

    mine = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, mine)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"q": " ".join(words(3, i)), "a": "x"}) + "\n" for i in range(16)))
    job = ["train", "--run_dir", str(tmp_path / "run"), "--task", "language_model", "--model", "gpt",
           "--vocab_size", "320", "--seq_len", "32", "--width", "16", "--num_layers", "1", "--num_heads", "2",
           "--dataset", f"hf:{data}", "--tokenizer", str(mine), "--prompt_field", "q", "--response_field", "a",
           "--batch_size", "4", "--save_every_steps", "2", "--no-progress", "--num_workers", "0"]
    assert run_cli([*job, "--max_steps", "2"]).returncode == 0
    config = json.loads((mine / "tokenizer.json").read_text())
    config["model"]["merges"] = config["model"]["merges"][:-5]  # retrained: the last merges differ
    (mine / "tokenizer.json").write_text(json.dumps(config))
    line = one_line_error(run_cli([*job, "--max_steps", "4"]))
    assert "tokenizer" in line and "files changed" in line and "--accept_config_change" in line


def test_the_digest_a_checkpoint_checks_covers_the_chat_template_file(tokenizer_dir, tmp_path):
    """--chat_template FILE formats the records in the tokenizer's place: an edited file is other token ids, so the
    digest a checkpoint records (and a resume compares) changes with it; without one it is the tokenizer's."""
    from ddptrain.models import hf

    template = tmp_path / "chat.jinja"
    template.write_text(CHATML)
    plain, with_file = hf.tokenizer_digest(tokenizer_dir), hf.tokenizer_digest(tokenizer_dir, str(template))
    template.write_text(CHATML.replace("<|im_end|>", "<|im_end|>\n\n"))
    assert len({plain, with_file, hf.tokenizer_digest(tokenizer_dir, str(template))}) == 3
    assert hf.tokenizer_digest(tokenizer_dir, "") == plain


def llama_config(directory: Path, vocab: int, positions: int = 128) -> Path:
    transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=positions
                             ).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("case", ["vocab", "positions", "typo", "tokens-vocab"])
def test_a_model_that_cannot_hold_the_data_is_one_line_before_training(case, tokenizer_dir, chats, tmp_path):
    """A tokenizer of 320 tokens on a model of 64, --seq_len past the model's positions, a mistyped local path
    (not the Hub's repo-id error), token files of 320 tokens on a model of 64 (its own vocabulary, not the
    gpt-only --vocab_size): each exit 2, one line naming both numbers (or the path)."""
    small = llama_config(tmp_path / "small", vocab=64, positions=32)
    data = ["--dataset", f"hf:{chats}", "--tokenizer", str(tokenizer_dir)]
    args = {"vocab": ["--model", f"hf:{small}", *data, "--seq_len", "32"],
            "positions": ["--model", f"hf:{llama_config(tmp_path / 'wide', vocab=512, positions=32)}", *data,
                          "--seq_len", "64"],
            "typo": ["--model", f"hf:{tmp_path}/no/such/model", *data],
            "tokens-vocab": ["--model", f"hf:{small}", "--dataset", "tokens", "--data_dir", str(tmp_path / "tokens"),
                             "--seq_len", "16"]}[case]
    if case == "tokens-vocab":
        text = tmp_path / "text.txt"
        text.write_text(" ".join(words(300)))
        assert cli_in_process(["prepare-text", str(tmp_path / "tokens"), str(text), "--tokenizer",
                               str(tokenizer_dir)]).returncode == 0
    line = one_line_error(cli_in_process(["train", "--run_dir", str(tmp_path / "run"), "--task", "language_model",
                                          *args, "--no-progress", "--num_workers", "0"]))
    expected = {"vocab": ["320 tokens", "64"], "positions": ["--seq_len 64", "32 positions"],
                "typo": ["no such directory"], "tokens-vocab": ["320 tokens", "64", "--model"]}[case]
    assert all(part in line for part in expected), line
    assert "--vocab_size" not in line


def test_token_files_train_an_hf_model_without_the_gpt_only_vocab_size(tokenizer_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words(400)))
    assert run_cli(["prepare-text", str(tmp_path / "tokens"), str(text), "--tokenizer", str(tokenizer_dir)]
                   ).returncode == 0
    model = llama_config(tmp_path / "llama", vocab=320, positions=32)
    proc = run_cli(["train", "--run_dir", str(tmp_path / "run"), "--task", "language_model", "--model", f"hf:{model}",
                    "--dataset", "tokens", "--data_dir", str(tmp_path / "tokens"), "--seq_len", "16", "--max_steps",
                    "2", "--batch_size", "4", "--no-progress", "--num_workers", "0"])
    assert proc.returncode == 0, proc.stderr


def test_a_chat_with_no_assistant_turn_is_named_as_such_not_as_cut_off(tokenizer_dir, tmp_path, capsys):
    """A conversation with no assistant turn has nothing to learn, however long --seq_len: it was counted as "cut off
    by --seq_len" and, when all were so, the advice was to raise --seq_len. In this process: the tokenizing step."""
    from ddptrain.errors import UsageError

    data = tmp_path / "records.jsonl"
    asked = [{"role": "user", "content": " ".join(words(3, i))} for i in range(3)]
    answered = [json.dumps({"messages": conversation(i)}) for i in range(3)]
    data.write_text("\n".join([json.dumps({"messages": [m]}) for m in asked[:1]] + answered) + "\n")
    rows = tokenized(tokenizer_dir, data)
    assert len(rows) == 4
    said = capsys.readouterr().out
    assert "1 of 4 records" in said and "have no assistant turn" in said and "first: record 0" in said, said
    assert "cut off" not in said, said
    only_asked = tmp_path / "asked.jsonl"
    only_asked.write_text("".join(json.dumps({"messages": [m]}) + "\n" for m in asked))
    with pytest.raises(UsageError) as refused:
        tokenized(tokenizer_dir, only_asked)
    assert "every record has no assistant turn" in str(refused.value) and "--seq_len" not in str(refused.value)


def apply_chat_template(tokenizer_dir: Path, template: str, messages: list[dict], tools: list | None = None,
                        **kwargs) -> dict:
    """transformers' ids (and, for a marked template, its assistant mask) of a conversation."""
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    return reference.apply_chat_template(messages, chat_template=template, tools=tools, return_dict=True,
                                         return_assistant_tokens_mask="{% generation %}" in template, **kwargs)


@pytest.mark.parametrize("template", ["CHATML_MARKED", "CHATML", "FEATURES", "FEATURES_MARKED"])
def test_templates_give_the_ids_and_assistant_mask_of_apply_chat_template(template, tokenizer_dir):
    """Templates with {% generation %} markers, {% break %}/{% continue %}, strftime_now, namespace, tojson tools
    and tool calls, reasoning under another name: the ids are transformers' apply_chat_template's; a marked
    template trains exactly the tokens of its assistant mask; an unmarked one, each reply as rendered after the
    prompt for it."""
    from ddptrain.models import chat, hf

    text = globals()[template]
    tokenizer = hf.load_tokenizer(str(tokenizer_dir))
    compiled = chat.Template(text, tokenizer.special, "test")
    assert compiled.marked == ("{% generation %}" in text)
    for record in ({"messages": conversation(0)}, {"messages": conversation(1), "tools": TOOLS},
                   {"messages": tool_conversation(2), "tools": json.dumps(TOOLS)}):
        tools = record.get("tools")
        expected = apply_chat_template(tokenizer_dir, text, record["messages"],
                                       json.loads(tools) if isinstance(tools, str) else tools)
        ids, labels, _ = chat.tokenize_record(record, ["messages"], compiled, tokenizer.encode_rendered, "assistant",
                                              "record")
        assert ids == expected["input_ids"]
        learnt = [int(label != -100) for label in labels]
        if compiled.marked:
            assert learnt == expected["assistant_masks"]
        assert [label for label in labels if label != -100] == [i for i, bit in zip(ids, learnt) if bit]
        assert sum(learnt) > 0


def test_what_is_learnt_is_the_marked_span_or_all_a_reply_adds(tokenizer_dir, tmp_path):
    """Through the data path (--chat_template FILE, JSON lines whose turns differ in their fields, which the
    reader fills with nulls): ChatML marked as TRL marks it learns each reply and its <|im_end|>, exactly
    transformers' assistant mask; unmarked, also the newline the template writes after <|im_end|> (what the
    rendering adds after the prompt for the reply, as TRL's prompt/completion path trains)."""
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    data = tmp_path / "tools.jsonl"
    records = [{"messages": tool_conversation(i), "tools": json.dumps(TOOLS)} for i in range(3)] + \
              [{"messages": conversation(i), "tools": None} for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    for template in ("CHATML_MARKED", "CHATML"):
        (tmp_path / f"{template}.jinja").write_text(globals()[template])
        rows = tokenized(tokenizer_dir, data, "chat_template", str(tmp_path / f"{template}.jinja"))
        for row, record in zip(rows, records):
            tools = json.loads(record["tools"]) if record["tools"] else None
            expected = apply_chat_template(tokenizer_dir, globals()[template], record["messages"], tools)
            assert row["input_ids"] == expected["input_ids"]
            learnt = [label for label in row["labels"] if label != -100]
            end = "<|im_end|>" if template == "CHATML_MARKED" else "<|im_end|>\n"
            assert reference.decode(learnt) == "".join(m["content"] + end for m in record["messages"]
                                                       if m["role"] == "assistant")
            if template == "CHATML_MARKED":
                assert [int(label != -100) for label in row["labels"]] == expected["assistant_masks"]
    # The tokenizer written beside the trained weights formats with the template the model trained on.
    from ddptrain.config import TrainConfig
    from ddptrain.models import hf

    (tmp_path / "out").mkdir()
    hf.copy_tokenizer(TrainConfig(tokenizer=str(tokenizer_dir), chat_template=str(tmp_path / "CHATML.jinja"))
                      .section("data"), tmp_path / "out")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == CHATML


def test_prompt_completion_records_are_found_by_their_shape(tokenizer_dir, tmp_path):
    """No flags: `prompt` and `completion` strings are a prompt/response pair (as --prompt_field prompt
    --response_field completion); lists of turns are a conversation formatted with the chat template, learning
    what the rendering adds after the prompt's generation prompt."""
    texts = tmp_path / "pairs.jsonl"
    texts.write_text("".join(json.dumps({"prompt": " ".join(words(5, i)), "completion": " ".join(words(3, i + 9))})
                             + "\n" for i in range(4)))
    assert tokenized(tokenizer_dir, texts) == tokenized(tokenizer_dir, texts, "prompt_field", "prompt",
                                                        "response_field", "completion")
    turns = tmp_path / "turns.jsonl"
    chats = [conversation(i) for i in range(4)]
    turns.write_text("".join(json.dumps({"prompt": c[:4], "completion": c[4:]}) + "\n" for c in chats))
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    for row, messages in zip(tokenized(tokenizer_dir, turns), chats):
        prompt = reference.apply_chat_template(messages[:4], add_generation_prompt=True, return_dict=False)
        assert row["input_ids"] == reference.apply_chat_template(messages, return_dict=False)
        assert row["labels"] == [-100] * len(prompt) + row["input_ids"][len(prompt):]
        assert reference.decode(row["labels"][len(prompt):]) == messages[4]["content"] + "</s>"


@pytest.mark.parametrize("case", ["refused", "fails", "usr", "bot", "nothing-marked", "syntax"])
def test_a_record_the_template_or_its_roles_refuse_is_one_line_naming_it(case, tokenizer_dir, tmp_path):
    """A template's own raise_exception, a template failing on a record, a role no template knows (a user as
    "usr", the assistant as "bot": not a reply cut off by --seq_len), a marked template that marks nothing of
    any record, a template jinja cannot compile: each a UsageError naming the record (or the file) and why."""
    from ddptrain.config import TrainConfig
    from ddptrain.errors import UsageError
    from ddptrain.models import hf

    import shutil

    chats = [conversation(i) for i in range(3)]
    if case in ("usr", "bot"):
        index = 1 if case == "usr" else 2
        chats[1][index] = {**chats[1][index], "role": case}
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    flags = []  # the tokenizer's own template, or --chat_template FILE
    if case == "refused":  # a tokenizer whose own template is Gemma's way with a system turn
        shutil.copytree(tokenizer_dir, tmp_path / "gemma")
        (tmp_path / "gemma" / "chat_template.jinja").write_text(NO_SYSTEM)
        tokenizer_dir = tmp_path / "gemma"
    elif case not in ("usr", "bot"):
        (tmp_path / "t.jinja").write_text({
            "fails": "{{ messages[9]['content'] }}", "syntax": "{% for m in messages %}",
            "nothing-marked": CHATML_MARKED.replace("m['role'] == 'assistant'", "m['role'] == 'nobody'")}[case])
        flags = ["chat_template", str(tmp_path / "t.jinja")]
    with pytest.raises(UsageError) as refused:
        if case == "syntax":
            hf.check_dataset(TrainConfig(task="language_model", model="gpt", dataset=f"hf:{data}",
                                         tokenizer=str(tokenizer_dir), vocab_size=320,
                                         chat_template=str(tmp_path / "t.jinja")).section("data"))
        tokenized(tokenizer_dir, data, *flags)
    line = str(refused.value)
    expected = {"refused": [f"--dataset {data}: record 0: the chat template refused it: System role not supported"],
                "fails": [f"--dataset {data}: record 0: --chat_template", "cannot render it", "UndefinedError"],
                "usr": ["record 1: messages turn 1 has role 'usr'", "user, assistant"],
                "bot": ["record 1: messages turn 2 has role 'bot'", "assistant"],
                "nothing-marked": ["every record has no token the chat template marks", "first: record 0"],
                "syntax": [f"--chat_template {tmp_path / 't.jinja'}: jinja cannot compile it (line 1"]}[case]
    assert all(part in line for part in expected) and "\n" not in line and "cut off" not in line, line
