"""Chat data: conversations rendered with a checkpoint's own chat template, assistant tokens marked.

A conversation is a list of messages, `{"role": ..., "content": ...}` (and whatever else the
template reads: tool calls, reasoning). It is rendered with the Jinja2 template that Hugging Face
checkpoints ship (`chat_template` in tokenizer_config.json, or chat_template.jinja), in the same
environment and with the same variables as transformers' `apply_chat_template`, then tokenized.

Which tokens the loss counts (the loss mask): the template's `{% generation %}` blocks where it has
them; otherwise each assistant turn, from the end of what the template renders as its prompt
(the messages before it, with `add_generation_prompt`) through its end-of-turn token (the special
token that teaches the model to stop; `ChatTemplate._turn_end` says how it is found).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pathlib

import numpy as np

from jmoe.config import ConfigError

# Private-use characters around the output of {% generation %} blocks while rendering.
_OPEN, _CLOSE = "\ue000", "\ue001"


def _environment():
  import jinja2
  from jinja2 import ext, nodes
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(ext.Extension):
    """`{% generation %}...{% endgeneration %}`: what the assistant writes (transformers' tag)."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
      return _OPEN + caller() + _CLOSE

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


class ChatTemplate:
  """A checkpoint's chat template, ready to render conversations."""

  def __init__(self, source: str, variables: dict[str, str], where: str):
    import jinja2
    self.where, self._variables = where, dict(variables)
    try:
      self._template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise ConfigError(f"{where}: the chat template is not valid Jinja2 (line {e.lineno}: "
                        f"{e.message})") from None
    self.marks_generation = "generation" in source and "endgeneration" in source
    # What the rendering depends on, for a resume to check that it renders as before.
    self.fingerprint = hashlib.sha256(
        json.dumps([source, sorted(self._variables.items())]).encode()).hexdigest()[:16]

  @classmethod
  def from_files(cls, tokenizer: str | pathlib.Path, template: str | pathlib.Path = ""
                 ) -> "ChatTemplate":
    """The template next to a tokenizer.json (chat_template.jinja, else tokenizer_config.json's
    `chat_template`), or `template`: a .jinja file or a tokenizer_config.json. Special tokens
    (bos_token, eos_token, ...) come from the tokenizer_config.json beside either."""
    tokenizer = pathlib.Path(tokenizer)
    folder = tokenizer if tokenizer.is_dir() else tokenizer.parent
    path = pathlib.Path(template) if template else None
    settings_path = (path if path is not None and path.suffix == ".json"
                     else folder / "tokenizer_config.json")
    settings = {}
    if settings_path.is_file():
      try:
        settings = json.loads(settings_path.read_text())
      except ValueError as e:
        raise ConfigError(f"{settings_path} is not valid JSON ({e})") from None
    if path is None and (folder / "chat_template.jinja").is_file():
      path = folder / "chat_template.jinja"
    if path is not None and path.suffix != ".json":
      if not path.is_file():
        raise ConfigError(f"data.chat_template: {path} does not exist (give a .jinja file or a "
                          f"tokenizer_config.json)")
      source, where = path.read_text(), str(path)
    else:
      source, where = settings.get("chat_template"), str(settings_path)
      if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
      if not isinstance(source, str):
        raise ConfigError(
            f"chat data needs a chat template, and {settings_path} has none "
            f"{'(the file does not exist)' if not settings_path.is_file() else ''}; put the "
            f"checkpoint's tokenizer_config.json or chat_template.jinja beside data.tokenizer, "
            f"or name one with data.chat_template")
    variables = {name: text for name, value in settings.items()
                 if name.endswith("_token") and (text := _token_text(value)) is not None}
    return cls(source, variables, where)

  def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as text, as transformers' apply_chat_template(tokenize=False) gives it."""
    return self._marked(messages, add_generation_prompt).replace(_OPEN, "").replace(_CLOSE, "")

  def _marked(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as text, {% generation %} blocks between _OPEN and _CLOSE."""
    import jinja2
    try:
      return self._template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self._variables)
    except jinja2.TemplateError as e:
      raise ConfigError(f"{self.where}: the chat template refuses a conversation: {e}") from None

  def pieces(self, messages: list[dict], special: list[str]) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, counted by the loss) pieces. `special`: the
    tokenizer's special tokens as text (end-of-turn tokens among them)."""
    if self.marks_generation:
      out, rest = [], self._marked(messages)
      while _OPEN in rest:
        before, rest = rest.split(_OPEN, 1)
        inside, _, rest = rest.partition(_CLOSE)
        out += [(before, False), (inside, True)]
      return [p for p in out + [(rest, False)] if p[0]]
    text = self.render(messages)
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    spans = []
    for number, i in enumerate(turns):
      prompt = self.render(messages[:i], add_generation_prompt=True)
      if not text.startswith(prompt):
        raise ConfigError(
            f"{self.where}: the chat template renders the messages before assistant turn {i} "
            f"(with add_generation_prompt) as text that does not begin the whole conversation, "
            f"so the assistant's tokens cannot be found; use a template with {{% generation %}} "
            f"blocks (data.chat_template)")
      start = len(prompt)
      spans.append((start, self._turn_end(messages[:i + 1], text, start, special,
                                          last=number == len(turns) - 1)))
    bounds = [0] + [b for span in spans for b in span] + [len(text)]
    return [(text[a:b], k % 2 == 1) for k, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]

  def _turn_end(self, upto: list[dict], text: str, start: int, special: list[str],
                last: bool) -> int:
    """Where the assistant turn starting at `start` ends: through its end-of-turn token.

    The conversation that ends with this turn is rendered too: where it agrees with the whole
    one past `start`, the turn is what they share (through its last special token); where it
    does not (templates render the final turn differently: thinking blocks, another end token),
    the turn runs through the first special token from where they part."""
    alone = self.render(upto)
    shared = len(alone) if text.startswith(alone) else next(
        (k for k, (a, b) in enumerate(zip(alone, text)) if a != b), min(len(alone), len(text)))
    if text.startswith(alone) and shared > start:
      ends = [text.rfind(s, start, shared) + len(s) for s in special
              if text.rfind(s, start, shared) >= 0]
      return max(ends) if ends else shared
    found = [(text.find(s, max(shared, start)), s) for s in special]
    found = [(at, s) for at, s in found if at >= 0]
    if found:
      at, s = min(found)
      return at + len(s)
    if not last:
      raise ConfigError(f"{self.where}: an assistant turn ends with no special token (such as "
                        f"an end-of-turn token), so where it stops is unknown; use a template "
                        f"with {{% generation %}} blocks (data.chat_template)")
    return len(text)


def check_messages(messages, where: str) -> list[dict]:
  if (not isinstance(messages, list) or not messages
      or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
    raise ConfigError(f"{where}: a conversation is a non-empty list of messages, each a JSON "
                      f"object with a \"role\" (and its \"content\")")
  if not any(m["role"] == "assistant" for m in messages):
    raise ConfigError(f"{where}: the conversation has no assistant message, so nothing in it "
                      f"would be learned; leave it out")
  return messages


def tokenize_chat(messages: list[dict], template: ChatTemplate, tokenizer
                  ) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, loss mask) of a conversation: each piece tokenized on its own (as a prompt is
  at generation time), the assistant's pieces counted."""
  pieces = template.pieces(messages, tokenizer.special_tokens)
  encoded = tokenizer.encode_batch([text for text, _ in pieces])
  mask = [np.full(ids.size, counted, np.int32) for (_, counted), ids in zip(pieces, encoded)]
  return np.concatenate(encoded).astype(np.int32), np.concatenate(mask)
