"""Shared by the tool-parser tests: the tools, what each model format's reply looks like, the calls in
it, and a tiny random model whose context fits the real chat templates (their tool prompts are long)."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).parent / "chat_templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "detailed": {"type": "boolean"},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLS = [("get_weather", {"city": "Paris", "days": 3, "detailed": True}), ("get_time", {"zone": "CET"})]

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# parser -> (a reply in the model's format holding CALLS, the content the parser finds before the calls)
REPLIES: dict[str, tuple[str, str | None]] = {
    "qwen3_coder": (
        "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
        "I will check.\n",
    ),
    "mistral": (
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "detailed": true}}, '
        '{"name":"get_time","arguments":{"zone":"CET"}}]',
        "Sure. ",
    ),
    "pythonic": ("[get_weather(city='Paris', days=3, detailed=True), get_time(zone=\"CET\")]", None),
    "deepseek_v3": (
        f"Let me look.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
        f'{{"city": "Paris", "days": 3, "detailed": true}}\n```{DS_CALL_END}\n'
        f'{DS_CALL_BEGIN}function{DS_SEP}get_time\n```json\n{{"zone": "CET"}}\n```{DS_CALL_END}{DS_CALLS_END}',
        "Let me look.",
    ),
}
# The newer Mistral spelling (tokenizers v11+): one [TOOL_CALLS] per call, NAME[ARGS]{...} or NAME{...}.
MISTRAL_NAMED = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3, "detailed": true}[TOOL_CALLS]get_time{"zone":"CET"}'
)
TEMPLATE_FILES = {
    "qwen3_coder": "qwen3_coder.jinja",
    "mistral": "mistral_7b_instruct_v0.3.jinja",
    "pythonic": "llama3.2_pythonic.jinja",
    "deepseek_v3": "deepseek_v3.jinja",
}
NEW_PARSERS = list(REPLIES)
MAX_MODEL_LEN = 4096


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    """(name, arguments) of OpenAI tool calls, as dicts or client objects."""
    result = []
    for call in tool_calls:
        function = call["function"] if isinstance(call, dict) else call.function
        name = function["name"] if isinstance(function, dict) else function.name
        arguments = function["arguments"] if isinstance(function, dict) else function.arguments
        result.append((name, json.loads(arguments)))
    return result


def build_tool_model(path: str) -> None:
    """A tiny random Llama with a byte-level BPE trained on the templates (so their prompts stay short)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [(TEMPLATES / name).read_text() for name in TEMPLATE_FILES.values()]
    corpus += [reply for reply, _ in REPLIES.values()] + [json.dumps(TOOLS)] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=["<s>", "</s>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<s>",
                                        pad_token="<s>")
    tokenizer.chat_template = (TEMPLATES / TEMPLATE_FILES["qwen3_coder"]).read_text()
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=len(tokenizer), initializer_range=0.2, max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)
