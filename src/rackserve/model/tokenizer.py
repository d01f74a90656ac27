"""The embedded tokenizer written next to random-weight checkpoints (`rackserve model create`).

A byte-level BPE trained with the `tokenizers` library on ``rackserve/data/corpus.txt`` (text
shipped inside the package), so tiny models need no download. Special tokens use DeepSeek's
names and sit at fixed ids:

    0 <｜begin▁of▁sentence｜>   (BOS)
    1 <｜end▁of▁sentence｜>     (EOS, closes every assistant turn)
    2 <｜User｜>
    3 <｜Assistant｜>
    4 <｜tool▁output▁begin｜>
    5 <｜tool▁output▁end｜>
    6 <｜▁pad▁｜>
    7 .. 262  the 256 byte symbols, then the learned merges
    ..        <｜place▁holder▁no▁N｜> only if the corpus runs out of merges before `vocab_size`

The chat template puts a special token at every message boundary. Special tokens are split
off before BPE runs, so text on either side of a boundary is encoded on its own and no merge
crosses it: rendering turn k+1 (history + the reply as generated + a new message) therefore
yields exactly turn k's prompt ids + the reply ids + EOS + ..., which is what lets a
multi-turn session hit the prefix cache (see KV_CACHE.md). For the same reason the template
never rewrites earlier messages based on later ones (no stripping of reasoning, no trimming,
no closing token that depends on the next message's role). The guarantee is for the reply's
canonical encoding: a sampled reply whose tokens are not what BPE would produce for its text
re-encodes differently, and the cache hit then falls back to the end of the previous prompt.
Templates are rendered by transformers (which supplies `raise_exception`) or by any Jinja
environment that defines it.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
TOOL_OUTPUT_BEGIN_TOKEN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END_TOKEN = "<｜tool▁output▁end｜>"
PAD_TOKEN = "<｜▁pad▁｜>"

# Order is the id assignment: BOS = 0, EOS = 1 (the tiny preset's config relies on this).
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    TOOL_OUTPUT_BEGIN_TOKEN,
    TOOL_OUTPUT_END_TOKEN,
    PAD_TOKEN,
)
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
NUM_BYTE_SYMBOLS = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_BYTE_SYMBOLS

# DeepSeek-V4's tool-call markup (DSML): the model writes calls as this block, and the
# template renders earlier calls the same way, so a turn re-renders token for token.
DSML = "｜DSML｜"
TOOL_CALLS_BEGIN = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_END = f"</{DSML}parameter>"
# The tool section of the system prompt (V4's layout; set --chat-template for V4's own prose).
TOOLS_PROMPT_HEAD = (
    "## Tools\n\n"
    "You can call the tools below. To call tools, write a block like this:\n\n"
    f"{TOOL_CALLS_BEGIN}\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"{PARAMETER_END}\n"
    f"{INVOKE_END}\n"
    f"{TOOL_CALLS_END}\n\n"
    'Write string values as they are with string="true"; write numbers, booleans, arrays '
    'and objects as JSON with string="false".\n\n'
    "### Available Tool Schemas\n\n"
)
TOOLS_PROMPT_TAIL = "\n\nCall tools only by the names and with the parameters defined above.\n"


def _literal(text: str) -> str:
    """``text`` as a Jinja string expression (escapes keep newlines out of the template's
    whitespace control)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


# DeepSeek-style chat format. Each role opens with a special token and an assistant turn is
# closed by EOS, exactly the token the model emits when it stops, so a generated reply is
# re-rendered token for token. System text goes right after BOS, in place, followed by the
# tool schemas when the request has tools; an assistant's tool calls follow its content as
# a DSML block. Tool-call arguments must be a mapping (the server parses the JSON string).
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro render_tools(tools) -%}"
    "{{- " + _literal(TOOLS_PROMPT_HEAD) + " -}}"
    "{%- for tool in tools -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- (tool['function'] if tool['function'] is defined else tool) | tojson -}}"
    "{%- endfor -%}"
    "{{- " + _literal(TOOLS_PROMPT_TAIL) + " -}}"
    "{%- endmacro -%}"
    "{%- macro render_tool_calls(tool_calls) -%}"
    "{{- " + _literal("\n\n" + TOOL_CALLS_BEGIN + "\n") + " -}}"
    "{%- for call in tool_calls -%}"
    "{%- set function = call['function'] if call['function'] is defined else call -%}"
    "{{- '<" + DSML + "invoke name=\"' + function['name'] + '\">\\n' -}}"
    "{%- if function['arguments'] is mapping -%}"
    "{%- for key, value in function['arguments'].items() -%}"
    "{{- '<" + DSML + "parameter name=\"' + key + '\" string=\"' -}}"
    "{{- 'true\">' + value if value is string else 'false\">' + value | tojson -}}"
    "{{- '" + PARAMETER_END + "' -}}"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{- '<" + DSML + 'parameter name="arguments" string="true">\' -}}'
    "{{- function['arguments'] ~ '" + PARAMETER_END + "' -}}"
    "{%- endif -%}"
    "{{- '\\n" + INVOKE_END + "' -}}"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '\\n" + TOOL_CALLS_END + "' -}}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- if tools and (messages | length == 0 or messages[0]['role'] != 'system') -%}"
    "{{- render_tools(tools) -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- render_content(message['content']) -}}"
    "{%- if tools and loop.first -%}{{- '\\n\\n' + render_tools(tools) -}}{%- endif -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '" + USER_TOKEN + "' + render_content(message['content']) -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT_TOKEN + "' + render_content(message['content']) -}}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{{- render_tool_calls(message['tool_calls']) -}}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '"
    + TOOL_OUTPUT_BEGIN_TOKEN
    + "' + render_content(message['content']) + '"
    + TOOL_OUTPUT_END_TOKEN
    + "' -}}"
    "{%- else -%}"
    "{{- raise_exception('unsupported chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT_TOKEN + "' -}}{%- endif -%}"
)


def load_corpus() -> str:
    """The training text shipped in the package (``rackserve/data/corpus.txt``)."""
    return resources.files("rackserve").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def build_tokenizer(vocab_size: int, corpus: str | None = None) -> Tokenizer:
    """Train the byte-level BPE; the result has exactly `vocab_size` tokens.

    Deterministic: the trainer breaks count ties by token id, and ids come from the fixed
    special-token list and the sorted byte alphabet, so equal inputs give equal merges.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: need at least {MIN_VOCAB_SIZE} "
            f"({len(SPECIAL_TOKENS)} special tokens + {NUM_BYTE_SYMBOLS} byte symbols)"
        )
    text = load_corpus() if corpus is None else corpus
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: the text after a special token must encode the same wherever it sits.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    # A small corpus can run out of merges before a large vocab_size; fill the rest with
    # placeholder specials (as DeepSeek's own vocab does) so the embedding shape matches.
    num_missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if num_missing > 0:
        tokenizer.add_special_tokens([f"<｜place▁holder▁no▁{i}｜>" for i in range(num_missing)])
    # `add_special_tokens=True` (plain completion prompts) prepends BOS like DeepSeek's
    # tokenizer; rendered chats already start with BOS and are encoded without it.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    got = tokenizer.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"trained vocab has {got} tokens, expected {vocab_size}")
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token} did not land at id {token_id}")
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    """`tokenizer_config.json` contents for `transformers.AutoTokenizer.from_pretrained`."""
    added = {
        str(token_id): {
            "content": token.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``.

    Same bytes every time for the same `vocab_size`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    config_text = json.dumps(tokenizer_config(tokenizer), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config_text + "\n", encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
