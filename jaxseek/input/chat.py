"""Chat data for supervised fine-tuning: JSONL conversations → text, with the character spans the loss trains on.

A record is {"messages": [{"role": ..., "content": ...}, ...]} (roles system, user, assistant, tool) or
{"prompt": ..., "response": ...} (one user turn, one assistant turn; an optional "system"). The conversation is
rendered with the tokenizer's chat template (`chat_template.jinja` or the `chat_template` of
`tokenizer_config.json` beside tokenizer.json), or DEFAULT_TEMPLATE. The trained span of assistant message i is
what the template adds between the conversation before it with the generation prompt (render(m[:i], True)) and
the conversation up to it (render(m[:i+1])): the answer and the markup that ends it (e.g. the EOS), never the
prompt or the assistant marker. A template that marks what the model generates with `{% generation %}` …
`{% endgeneration %}` blocks (transformers' assistant-mask convention) is trained on exactly those blocks instead.
Templates are run as transformers runs them (a sandboxed jinja2 environment, trim_blocks and lstrip_blocks,
`raise_exception`, `strftime_now`, the special tokens as variables).
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")

# DeepSeek LLM's chat format: "User: …\n\nAssistant: …<eos>User: …", a system message first as plain text.
DEFAULT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('the default chat template has no role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


# A {% generation %} block renders between these two private-use characters, which render() then removes.
OPEN, CLOSE = "\ue000", "\ue001"
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatError(ValueError):
  """A record or template that cannot be rendered; prepare.py adds the file and line."""


def template_source(tokenizer_path: str | None, override: str | None) -> tuple[str, str]:
  """(jinja source, where it came from): --chat-template FILE, else the tokenizer's own, else the default."""
  if override is not None:
    if override == "default":
      return DEFAULT_TEMPLATE, "default"
    path = Path(override)
    if not path.is_file():
      raise ChatError(f"--chat-template {override}: no such file; pass a jinja file or default")
    return path.read_text(encoding="utf-8"), str(path.resolve())
  if tokenizer_path is not None:
    folder = Path(tokenizer_path).parent
    if (folder / "chat_template.jinja").is_file():
      return (folder / "chat_template.jinja").read_text(encoding="utf-8"), str(folder / "chat_template.jinja")
    template = _tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
      template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                      None)
    if isinstance(template, str):
      return template, str(folder / "tokenizer_config.json")
  return DEFAULT_TEMPLATE, "default"


def special_tokens(tokenizer_path: str | None, eos_token: str | None) -> dict[str, str]:
  """The template's token variables: bos/eos/pad/unk_token from tokenizer_config.json ('' when absent); the EOS
  is the one the data ends documents with."""
  config = _tokenizer_config(Path(tokenizer_path).parent) if tokenizer_path else {}
  out = {}
  for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
    value = config.get(name)
    out[name] = (value.get("content") if isinstance(value, dict) else value) or ""
  if eos_token is not None:
    out["eos_token"] = eos_token
  return out


def _tokenizer_config(folder: Path) -> dict:
  try:
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return {}
  return config if isinstance(config, dict) else {}


def messages(record: object) -> list[dict]:
  """The conversation of one JSONL record, checked: roles known, contents strings, at least one assistant turn."""
  if not isinstance(record, dict):
    raise ChatError("is not a JSON object")
  if "messages" in record:
    conversation = record["messages"]
    if not isinstance(conversation, list) or not conversation:
      raise ChatError("has a 'messages' field that is not a non-empty list")
  elif "prompt" in record and "response" in record:
    conversation = [{"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["response"]}]
    if "system" in record:
      conversation.insert(0, {"role": "system", "content": record["system"]})
  else:
    raise ChatError("has neither a 'messages' list nor 'prompt' and 'response' fields")
  for i, message in enumerate(conversation):
    if not isinstance(message, dict) or message.get("role") not in ROLES:
      raise ChatError(f"message {i} has no role among {', '.join(ROLES)}")
    if not isinstance(message.get("content"), str):
      raise ChatError(f"message {i} ({message['role']}) has no string 'content'")
  if not any(m["role"] == "assistant" for m in conversation):
    raise ChatError("has no assistant message (nothing to train on)")
  return conversation


@functools.lru_cache(maxsize=4)
def compile_template(source: str):
  import jinja2
  from jinja2 import ext, nodes, sandbox

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  class Generation(ext.Extension):
    """{% generation %}body{% endgeneration %} → OPEN body CLOSE."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
      return OPEN + caller() + CLOSE

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols, Generation])
  env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(x, ensure_ascii=ensure_ascii,
                                                                                      indent=indent)
  env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
  try:
    return env.from_string(source)
  except jinja2.exceptions.TemplateError as e:
    raise ChatError(f"the chat template does not compile ({e})") from None


def generation_prompt(source: str, conversation: list[dict], tokens: dict[str, str]) -> str:
  """The text a model continues to answer `conversation`: rendered with the generation prompt, without marks."""
  import jinja2

  try:
    marked = compile_template(source).render(messages=conversation, add_generation_prompt=True, **tokens)
  except jinja2.exceptions.TemplateError as e:
    raise ChatError(f"the chat template cannot render the prompt ({e})") from None
  return marked.replace(OPEN, "").replace(CLOSE, "")


def render(source: str, conversation: list[dict], tokens: dict[str, str]) -> tuple[str, list[tuple[int, int]]]:
  """(text, [(start, end), ...]): the rendered conversation and the character spans of its assistant turns."""
  import jinja2

  template = compile_template(source)

  def run(part: list[dict], generation_prompt: bool) -> str:
    try:
      return template.render(messages=part, add_generation_prompt=generation_prompt, **tokens)
    except jinja2.exceptions.TemplateError as e:
      raise ChatError(f"cannot be rendered by the chat template ({e})") from None

  if any(OPEN in m["content"] or CLOSE in m["content"] for m in conversation):
    raise ChatError("holds the characters U+E000 or U+E001, which mark generated text while rendering; remove them")
  if GENERATION_TAG.search(source):
    return _marked_spans(run(conversation, False))
  text = run(conversation, False)
  spans = []
  for i, message in enumerate(conversation):
    if message["role"] != "assistant":
      continue
    before, through = run(conversation[:i], True), run(conversation[:i + 1], False)
    if not (through.startswith(before) and text.startswith(through)):
      raise ChatError(f"is rendered differently in part and in whole by the chat template (at message {i}), so the "
                      f"assistant tokens cannot be found; pass --chat-template FILE with a template that renders "
                      f"earlier turns the same way whatever follows")
    if len(through) > len(before):
      spans.append((len(before), len(through)))
  return text, spans


def _marked_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
  """The text without the OPEN/CLOSE marks, and the spans they enclosed."""
  text, spans, start = [], [], None
  length = 0
  for piece in re.split(f"([{OPEN}{CLOSE}])", marked):
    if piece == OPEN:
      start = length if start is None else start
    elif piece == CLOSE:
      if start is not None and length > start:
        spans.append((start, length))
      start = None
    else:
      text.append(piece)
      length += len(piece)
  return "".join(text), spans
