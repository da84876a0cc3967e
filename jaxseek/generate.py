"""Text generation: python -m jaxseek.generate --checkpoint PATH --tokenizer byte|tokenizer.json --prompt TEXT.

Prefill (the whole left-padded prompt batch in one call) and a decode loop (`lax.while_loop`, one token per
iteration) over a KV cache (jaxseek/model/decode.py), each compiled once. Greedy at temperature 0, else
sampling with optional top-k and top-p filtering. See docs/generate.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxseek import config as config_lib
from jaxseek import faults
from jaxseek.errors import UserError, cli
from jaxseek.model import decode
from jaxseek.sharding import rules

NEG_INF = -jnp.inf
GENERATE_AXES = ("data", "fsdp", "expert", "tensor")  # pipeline and context parallel decoding are not built


def top_k_filter(logits_BV: jax.Array, k: int) -> jax.Array:
  """Logits below the k-th largest of their row set to -inf (k ≤ 0: unchanged)."""
  if k <= 0 or k >= logits_BV.shape[-1]:
    return logits_BV
  kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
  return jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)


def top_p_filter(logits_BV: jax.Array, p: float) -> jax.Array:
  """Nucleus filtering: keeps the smallest set of most likely tokens whose probabilities sum to ≥ p (a token is
  kept when the tokens more likely than it sum to < p, so the most likely one always is); the rest -inf."""
  if p >= 1.0:
    return logits_BV
  sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  kept = jnp.sum(before_BV < p, axis=-1, keepdims=True)
  threshold_B1 = jnp.take_along_axis(sorted_BV, kept - 1, axis=-1)
  return jnp.where(logits_BV < threshold_B1, NEG_INF, logits_BV)


def sample(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
  """The next token per row [B] (int32): argmax at temperature 0, else a draw from the filtered softmax."""
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = top_p_filter(top_k_filter(logits_BV / temperature, top_k), top_p)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Prompts → tokens [B, T0] left-padded, mask [B, T0] (1 at real tokens), positions [B, T0] (0 at the first
  real token of each row; padding gets 0 too and is masked)."""
  T0 = max(len(p) for p in prompts)
  tokens = np.full((len(prompts), T0), pad_id, np.int32)
  mask = np.zeros((len(prompts), T0), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, T0 - len(p):], mask[b, T0 - len(p):] = p, 1
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prefill(graphdef, state, tokens_BT, positions_BT, valid_BT, cache):
  logits_BTV, cache = decode.step(nnx.merge(graphdef, state), tokens_BT, positions_BT, valid_BT, cache, 0)
  return logits_BTV[:, -1], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "temperature", "top_k", "top_p", "eos_id"))
def _decode(graphdef, state, cache, logits_BV, next_pos_B, key, *, steps, temperature, top_k, top_p, eos_id):
  """Samples `steps` tokens [B, steps]: the first from the prefill's logits, each next one after a cached step.
  Stops early once every row has emitted EOS (rows that did are filled with EOS)."""
  model = nnx.merge(graphdef, state)
  B, T0 = logits_BV.shape[0], cache["valid"].shape[1] - steps
  first = sample(logits_BV, jax.random.fold_in(key, 0), temperature, top_k, top_p)
  out_BN = jnp.zeros((B, steps), jnp.int32).at[:, 0].set(first)
  done_B = (first == eos_id) if eos_id is not None else jnp.zeros((B,), bool)

  def cond(carry):
    i, _, _, done_B = carry
    return (i < steps) & ~jnp.all(done_B)

  def body(carry):
    i, cache, out_BN, done_B = carry
    token_B = out_BN[:, i - 1]
    logits_B1V, cache = decode.step(model, token_B[:, None], (next_pos_B + i - 1)[:, None],
                                    jnp.ones((B, 1), jnp.int32), cache, T0 + i - 1)
    token_B = sample(logits_B1V[:, 0], jax.random.fold_in(key, i), temperature, top_k, top_p)
    if eos_id is not None:
      token_B = jnp.where(done_B, eos_id, token_B)
      done_B = done_B | (token_B == eos_id)
    return i + 1, cache, out_BN.at[:, i].set(token_B), done_B

  i, _, out_BN, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, out_BN, done_B))
  return out_BN, i


def batch_shards() -> int:
  """How many ways the active mesh splits the batch (1 without a mesh)."""
  if not rules.has_mesh():
    return 1
  shape = jax.sharding.get_abstract_mesh().shape
  return math.prod(shape[a] for a in rules.mesh_axes("batch"))


def generate(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, pad_id: int = 0,
             cache_dtype=jnp.float32, log=None) -> list[list[int]]:
  """New tokens for each prompt (token ids), at most `max_new_tokens`, cut before the first EOS. On a mesh the
  batch is padded with copies of the last prompt to a multiple of the batch shards (data × fsdp × expert)."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise UserError("every prompt needs at least one token")
  count = len(prompts)
  prompts = list(prompts) + [prompts[-1]] * (-count % batch_shards())
  tokens, mask, positions = left_pad(prompts, pad_id)
  B, T0 = tokens.shape
  cache = decode.init_cache(model, B, T0 + max_new_tokens, cache_dtype)
  if log is not None:
    layers = sum(getattr(model, s).num_layers for s in decode.STACKS if getattr(model, s) is not None)
    per = decode.cache_nbytes(cache) // (layers * B * (T0 + max_new_tokens))
    log(f"KV cache: {per} bytes per token per layer × {layers} layers × {B} rows × {T0 + max_new_tokens} slots = "
        f"{decode.cache_nbytes(cache)} bytes")
  graphdef, state = nnx.split(model)
  static = dict(steps=max_new_tokens, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                eos_id=eos_id)
  args = (state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask), cache)
  if log is None:
    logits_BV, cache = _prefill(graphdef, *args)
  else:  # the command line: say while each program compiles (on stderr, beside the other notes)
    logits_BV, cache = faults.compile_noted(lambda: _prefill.lower(graphdef, *args), "prefill", sys.stderr)(*args)
  args = (state, cache, logits_BV, jnp.asarray(mask.sum(1), jnp.int32), jax.random.key(seed))
  if log is None:
    out_BN, n = _decode(graphdef, *args, **static)
  else:
    out_BN, n = faults.compile_noted(lambda: _decode.lower(graphdef, *args, **static), "decode loop",
                                     sys.stderr)(*args)
  rows = np.asarray(out_BN)[:count, :int(n)].tolist()
  return [row[:row.index(eos_id)] if eos_id is not None and eos_id in row else row for row in rows]


# ------------------------------------------------------------------------------------------------ command line


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m jaxseek.generate", description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="Hugging Face folder, jaxseek checkpoint or run folder")
  parser.add_argument("--tokenizer", required=True, help="byte, or a tokenizer.json (or its folder)")
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--prompt", help="one prompt")
  source.add_argument("--prompts", help="a text file, one prompt per line (a batch)")
  parser.add_argument("--chat", action="store_true",
                      help="each prompt is a user message, rendered with the chat template and its generation prompt")
  parser.add_argument("--chat-template", metavar="FILE|default",
                      help="with --chat: a jinja chat template (default: the tokenizer's own, else jaxseek's "
                           "User:/Assistant: template)")
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
  parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
  parser.add_argument("--seed", type=int, default=None, help="sampling seed (default 0)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="weights, compute and cache dtype")
  parser.add_argument("overrides", nargs="*", help="mesh sizes, e.g. mesh.tensor=2 mesh.expert=2")

  parser.error = lambda message: (_ for _ in ()).throw(UserError(message))  # one `error:` line, exit status 2
  return parser.parse_args(argv)


def check_args(args) -> list[str]:
  """Validates the flags; returns the prompts."""
  if args.max_new_tokens < 1:
    raise UserError(f"--max-new-tokens {args.max_new_tokens} must be ≥ 1")
  if not math.isfinite(args.temperature) or args.temperature < 0:
    raise UserError(f"--temperature {args.temperature} must be ≥ 0 (0: greedy)")
  if args.top_k < 0:
    raise UserError(f"--top-k {args.top_k} must be ≥ 0 (0: no top-k filtering)")
  if not 0 < args.top_p <= 1:
    raise UserError(f"--top-p {args.top_p} must be in (0, 1]")
  if args.temperature == 0:  # greedy: the sampling options would be silently ignored
    for flag, value, default in (("--top-k", args.top_k, 0), ("--top-p", args.top_p, 1.0), ("--seed", args.seed, None)):
      if value != default:
        raise UserError(f"{flag} {value} applies when sampling; pass --temperature > 0 (0 is greedy)")
  if args.chat_template is not None and not args.chat:
    raise UserError("--chat-template applies with --chat only")
  if not Path(args.checkpoint).is_dir():
    raise UserError(f"--checkpoint {args.checkpoint}: no such folder; pass a Hugging Face model folder, a jaxseek "
                    "checkpoint folder or a run folder")
  if args.prompt is not None:
    prompts = [args.prompt]
  else:
    path = Path(args.prompts)
    if not path.is_file():
      raise UserError(f"--prompts {path}: no such file; pass a text file with one prompt per line")
    prompts = [line for line in config_lib.read_text(path, f"--prompts {path}", "pass a UTF-8 text file")
               .splitlines() if line]
    if not prompts:
      raise UserError(f"--prompts {path} holds no prompt; write one prompt per line")
  return prompts


def checkpoint_model_config(path: str | Path) -> config_lib.ModelConfig:
  """The ModelConfig of a Hugging Face folder or a jaxseek checkpoint / run folder, read before loading."""
  from jaxseek.convert import hf
  from jaxseek.convert.pretrained import hf_model_config

  path = Path(path)
  if (path / "config.json").is_file():
    return hf_model_config(hf.Folder(path))
  if (path / "config.yaml").is_file():
    return config_lib.portable(config_lib.load(path / "config.yaml").model)
  raise UserError(f"{path} has no config.json (Hugging Face model folder) or config.yaml (jaxseek checkpoint "
                  "folder); pass the folder that holds one")


def make_mesh(overrides: list[str], model: config_lib.ModelConfig | None = None):
  """A mesh over the first data × fsdp × expert × tensor devices from `mesh.<axis>=N` overrides (unset axes 1),
  checked against the model's dimensions; None without overrides."""
  if not overrides:
    return None
  sizes: dict = {}
  for item in overrides:
    section, field, value = config_lib.parse_override(item, example="mesh.tensor=2")
    if section != "mesh" or field not in GENERATE_AXES:
      raise UserError(f"override {item!r}: generate takes mesh sizes mesh.<axis>=N for axis in "
                      f"{', '.join(GENERATE_AXES)}, e.g. mesh.tensor=2")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise UserError(f"override {item!r}: the size must be a whole number ≥ 1")
    sizes[field] = value
  base = config_lib.Config() if model is None else config_lib.Config(model=model)
  mesh_cfg = dataclasses.replace(base.mesh, data=1, **sizes)
  shards = mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.expert
  cfg = dataclasses.replace(base, mesh=mesh_cfg, train=dataclasses.replace(base.train, batch_size=shards,
                                                                          microbatches=1))
  n = math.prod(mesh_cfg.sizes().values())
  if n > jax.device_count():
    raise UserError(f"mesh {' × '.join(f'{a}={v}' for a, v in sizes.items())} needs {n} devices but "
                    f"{jax.device_count()} are available")
  from jaxseek.sharding import mesh as mesh_lib

  return mesh_lib.make_mesh(cfg, jax.devices()[:n])


def text_codec(tokenizer, chat_template: str | None = None, chat: bool = False):
  """(encode: prompt → ids without EOS, decode: ids → text) for a resolved tokenizer. With `chat` a prompt is one
  user message rendered with the chat template (`chat_template`: a file, "default", or None for the tokenizer's
  own) and its generation prompt, and the template's own special tokens are the only ones added."""
  from jaxseek.input import chat as chat_lib
  from jaxseek.input.tokenize import chat_variables, load_tokenizer

  if chat:
    try:
      source, _ = chat_lib.template_source(tokenizer.path, chat_template)
      chat_lib.compile_template(source)
    except chat_lib.ChatError as e:
      raise UserError(str(e)) from None
    variables = chat_variables(tokenizer)

    def render(text):
      try:
        return chat_lib.generation_prompt(source, [{"role": "user", "content": text}], variables)
      except chat_lib.ChatError as e:
        raise UserError(str(e)) from None
  if tokenizer.kind == "byte":
    as_bytes = lambda text: list(text.encode("utf-8"))
    return ((lambda text: as_bytes(render(text))) if chat else as_bytes,
            lambda ids: bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace"))
  tok = load_tokenizer(tokenizer.path)
  if chat:
    encode = lambda text: tok.encode(render(text), add_special_tokens=False).ids
  else:
    encode = lambda text: [i for i in tok.encode(text, add_special_tokens=True).ids if i != tokenizer.eos_id]
  return encode, lambda ids: tok.decode(ids)


@cli
def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  prompts = check_args(args)
  from jaxseek.convert.pretrained import load_pretrained
  from jaxseek.input import tokenize

  tokenizer = tokenize.resolve(args.tokenizer)
  encode, decode_text = text_codec(tokenizer, args.chat_template, args.chat)
  ids = [encode(p) for p in prompts]
  if any(not i for i in ids):
    raise UserError("a prompt encodes to no tokens; give each prompt some text")
  model_cfg = checkpoint_model_config(args.checkpoint)
  longest = max(len(i) for i in ids)
  if longest + args.max_new_tokens - 1 > model_cfg.max_position_embeddings:  # the last new token is not fed back
    raise UserError(f"a prompt of {longest} tokens + --max-new-tokens {args.max_new_tokens} needs "
                    f"{longest + args.max_new_tokens - 1} positions, more than the model's max_position_embeddings "
                    f"{model_cfg.max_position_embeddings}; shorten the prompt or lower --max-new-tokens")
  mesh = make_mesh(args.overrides, model_cfg if args.overrides else None)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    model = load_pretrained(args.checkpoint, param_dtype=args.dtype, dtype=args.dtype)
    vocab = model.embed.table_VD.shape[0]
    if tokenizer.vocab_size > vocab:
      raise UserError(f"--tokenizer {args.tokenizer} has {tokenizer.vocab_size} tokens but the model's vocab_size "
                      f"is {vocab}; pass the model's tokenizer")
    outputs = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed or 0, eos_id=tokenizer.eos_id,
                       cache_dtype=jnp.dtype(args.dtype),
                       log=lambda line: print(line, file=sys.stderr))
  for row in outputs:
    print(decode_text(row).replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
