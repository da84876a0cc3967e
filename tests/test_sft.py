"""Supervised fine-tuning data: chat rendering, the stored loss mask, packing with it, and the masked loss."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, load_config
from flax import nnx

from jaxseek import objective as objective_lib
from jaxseek import step as step_lib
from jaxseek.errors import UserError
from jaxseek.input import batches as batches_lib
from jaxseek.input import chat, prepare, shards
from jaxseek.sharding.mesh import make_mesh

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]


def _jsonl(path, records):
  path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
  return str(path)


def _documents(folder):
  """Every document of a prepared folder as (tokens, mask), in shard order."""
  opened = shards.open_folder(folder, 1 << 20)
  return [(np.asarray(t[o[i]:o[i + 1]]), np.asarray(m[o[i]:o[i + 1]]))
          for t, o, m in zip(opened.tokens, opened.offsets, opened.masks) for i in range(len(o) - 1)]


def test_default_template_trains_on_the_answers_and_their_eos(tmp_path):
  records = [{"messages": CONVERSATION}, {"prompt": "Name a colour", "response": "Blue é", "system": "S"}]
  manifest = prepare.prepare([_jsonl(tmp_path / "c.jsonl", records)], "byte", tmp_path / "out", format="chat",
                             progress=False)
  (doc1, mask1), (doc2, mask2) = _documents(tmp_path / "out")
  assert bytes(doc1.astype(np.uint8)) == b"Be brief.\n\nUser: Hi\n\nAssistant: Hello!\0User: 2+2?\n\nAssistant: 4\0"
  trained = lambda doc, mask: bytes(np.where(mask == 1, doc, ord("_")).astype(np.uint8))
  assert trained(doc1, mask1) == b"_" * 31 + b" Hello!\0" + b"_" * 22 + b" 4\0"
  assert bytes(doc2.astype(np.uint8)) == "S\n\nUser: Name a colour\n\nAssistant: Blue é\0".encode()
  assert trained(doc2, mask2).endswith(" Blue é\0".encode()) and mask2.sum() == len(" Blue é\0".encode())
  assert manifest["chat"]["trained_tokens"] == mask1.sum() + mask2.sum()
  assert manifest["chat"]["template"] == "default" and "mask" in manifest["shards"][0]["sha256"]


# A DeepSeek-V3-style template: specials around the turns, the answer and its EOS in a generation block.
MARKED_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|User|>{{ m['content'] }}"
    "{% else %}<|Assistant|>{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|Assistant|>{% endif %}")


def _bpe_tokenizer(folder, template):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  specials = ["<|bos|>", "<|eos|>", "<|User|>", "<|Assistant|>"]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  corpus = [m["content"] for m in CONVERSATION] * 20 + ["the quick brown fox jumps over the lazy dog"] * 20
  tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  folder.mkdir()
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<|bos|>", "eos_token": {"content": "<|eos|>"}, "chat_template": template}))
  return folder / "tokenizer.json"


CHATS = [CONVERSATION, [{"role": "user", "content": "the quick fox?"}, {"role": "assistant", "content": "jumps"}],
         [{"role": "user", "content": "dog"}, {"role": "assistant", "content": "lazy dog"},
          {"role": "user", "content": "and?"}, {"role": "assistant", "content": "over the fox"}]]


def test_mask_equals_transformers_assistant_mask(tmp_path):
  """The tokenizer's own chat template (tokenizer_config.json): tokens and assistant mask equal transformers'
  apply_chat_template(return_assistant_tokens_mask=True); the same template without generation blocks (the
  prefix rule) gives the same mask."""
  transformers = pytest.importorskip("transformers")
  path = _bpe_tokenizer(tmp_path / "tok", MARKED_TEMPLATE)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<|bos|>", eos_token="<|eos|>")
  hf.chat_template = MARKED_TEMPLATE
  data = _jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
  manifest = prepare.prepare([data], str(path), tmp_path / "own", shards=2, format="chat", progress=False)
  assert manifest["chat"]["template"].endswith("tokenizer_config.json")
  unmarked = tmp_path / "plain.jinja"
  unmarked.write_text(MARKED_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
  prepare.prepare([data], str(path), tmp_path / "plain", shards=2, format="chat", chat_template=str(unmarked),
                  progress=False)
  own, plain = _documents(tmp_path / "own"), _documents(tmp_path / "plain")
  order = [0, 2, 1]  # documents 0, 2 in shard 0; 1 in shard 1
  for (tokens, mask), (tokens_p, mask_p), i in zip(own, plain, order):
    want = hf.apply_chat_template(CHATS[i], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert tokens.tolist() == want["input_ids"]
    assert mask.tolist() == want["assistant_masks"] and 0 < mask.sum() < len(mask)
    np.testing.assert_array_equal(tokens_p, tokens)
    np.testing.assert_array_equal(mask_p, mask)


def test_chat_prompts_for_generation_equal_transformers(tmp_path):
  """generate --chat: a prompt becomes the ids transformers' apply_chat_template(add_generation_prompt=True)
  gives; byte-level with the default template, the DeepSeek LLM prompt."""
  transformers = pytest.importorskip("transformers")
  from jaxseek.generate import text_codec
  from jaxseek.input import tokenize

  path = _bpe_tokenizer(tmp_path / "tok", MARKED_TEMPLATE)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<|bos|>", eos_token="<|eos|>")
  encode, _ = text_codec(tokenize.resolve(str(path)), chat=True)
  want = hf.apply_chat_template([{"role": "user", "content": "the lazy fox?"}], add_generation_prompt=True,
                                tokenize=True, chat_template=MARKED_TEMPLATE, return_dict=True)["input_ids"]
  assert encode("the lazy fox?") == want and hf.convert_ids_to_tokens(want)[-1] == "<|Assistant|>"
  encode, _ = text_codec(tokenize.resolve("byte"), chat=True)
  assert bytes(encode("Hi")) == b"User: Hi\n\nAssistant:"


def test_template_sources(tmp_path):
  folder = tmp_path / "tok"
  folder.mkdir()
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
  assert chat.template_source(str(folder / "tokenizer.json"), None)[0] == "D"
  (folder / "chat_template.jinja").write_text("J")
  assert chat.template_source(str(folder / "tokenizer.json"), None)[0] == "J"
  assert chat.template_source(str(folder / "tokenizer.json"), "default")[0] == chat.DEFAULT_TEMPLATE
  assert chat.template_source(None, None)[0] == chat.DEFAULT_TEMPLATE


# markup and prompts in lower case and punctuation, answers in capitals: the loss must fall on capitals and EOS only
SPLIT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}# {{ m['content'] }}\n"
                  "{% else %}@ {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}@ {% endif %}")


def _split_data(tmp_path, count=60, seed=0):
  rng = np.random.default_rng(seed)
  word = lambda letters, n: "".join(rng.choice(list(letters), n))
  records = []
  for _ in range(count):
    turns = []
    for _ in range(int(rng.integers(1, 3))):
      turns += [{"role": "user", "content": word("abcdefgh ", int(rng.integers(1, 30)))},
                {"role": "assistant", "content": word("XYZUVW", int(rng.integers(1, 20)))}]
    records.append({"messages": turns})
  (tmp_path / "t.jinja").write_text(SPLIT_TEMPLATE)
  prepare.prepare([_jsonl(tmp_path / "c.jsonl", records)], "byte", tmp_path / "sft", shards=2, format="chat",
                  chat_template=str(tmp_path / "t.jinja"), progress=False)
  return tmp_path / "sft"


def test_packed_rows_train_on_assistant_targets_only(tmp_path):
  folder = _split_data(tmp_path)
  cfg = load_config("tiny-dense", f"data.source={folder}", "train.seq_len=32", "train.batch_size=4",
                    "data.prefetch=0")
  it = iter(batches_lib.make_dataset(cfg))
  counted = 0
  for _ in range(6):
    batch = next(it)
    real = batch["segment_ids"] > 0
    answer = np.isin(batch["targets"], [ord(c) for c in "XYZUVW"]) | (batch["targets"] == 0)
    np.testing.assert_array_equal(batch["loss_mask"] == 1, real & answer)
    counted += int(batch["loss_mask"].sum())
  assert 0 < counted < int(6 * 4 * 32)


def _batch(rng, vocab, mask):
  B, T = mask.shape
  segment_ids = np.where(np.arange(T) < T - 2, 1 + (np.arange(T) >= T // 2), 0)[None].repeat(B, 0)
  positions = np.where(segment_ids == 2, np.arange(T) - T // 2, np.arange(T)) * (segment_ids > 0)
  return {"inputs": rng.integers(1, vocab, (B, T)), "targets": rng.integers(1, vocab, (B, T)),
          "loss_mask": mask * (segment_ids > 0), "segment_ids": segment_ids, "positions": positions}


def test_masked_loss_equals_numpy_and_prompt_targets_get_no_gradient():
  """A hand-built packed batch with prompt (mask 0) and answer (mask 1) positions: the step's loss is the NumPy
  cross entropy averaged over the answer targets, its loss_tokens their count; changing a prompt target leaves
  every gradient (MTP included) unchanged, changing an answer target does not."""
  cfg = load_config("tiny-v3", "model.num_nextn_predict_layers=1", "mesh.data=1", "train.batch_size=2",
                    "train.seq_len=16")
  mesh = make_mesh(cfg, jax.devices()[:1])
  trainer, state = step_lib.init_state(cfg, mesh)
  rng = np.random.default_rng(0)
  mask = (rng.random((2, 16)) < 0.4).astype(np.float32)
  batch = {k: jnp.asarray(v, jnp.float32 if k == "loss_mask" else jnp.int32)
           for k, v in _batch(rng, cfg.model.vocab_size, mask).items()}
  with jax.set_mesh(mesh):
    objective = objective_lib.objective_fn(trainer, cfg, state, step_lib.step_batch(cfg, batch), 1)
    grad = jax.jit(lambda params, b: jax.grad(objective, has_aux=True)(params, step_lib.step_batch(cfg, b))[0])
    model = nnx.merge(trainer.graphdef, state.params, state.biases)
    logits = np.asarray(jax.jit(lambda m, b: m(b["inputs"], b["positions"], b["segment_ids"]))(model, batch),
                        np.float64)
    grads = grad(state.params, batch)
    prompt = np.argwhere(np.asarray(batch["loss_mask"]) == 0)
    answer = np.argwhere(np.asarray(batch["loss_mask"]) == 1)
    changed = {**batch, "targets": batch["targets"].at[tuple(prompt.T)].add(1)}
    moved = {**batch, "targets": batch["targets"].at[tuple(answer[0])].add(1)}
    grads_prompt, grads_answer = grad(state.params, changed), grad(state.params, moved)
    _, metrics = step_lib.compile_step(trainer, cfg, mesh)(state, batch)

  log_softmax = logits - logits.max(-1, keepdims=True)
  log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
  ce = -np.take_along_axis(log_softmax, np.asarray(batch["targets"])[..., None], -1)[..., 0]
  m = np.asarray(batch["loss_mask"])
  np.testing.assert_allclose(float(metrics["loss"]), (ce * m).sum() / m.sum(), rtol=1e-5)
  assert float(metrics["loss_tokens"]) == m.sum() == len(answer)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_prompt)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-9)
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_answer))) > 0


def test_mtp_experts_count_prompt_positions_the_loss_masks():
  """The MoE block of an MTP layer routes and counts every position that has a next token, as the main stack
  does, whatever the loss mask; the MTP loss counts the answer targets only."""
  batch = {"loss_mask": jnp.asarray([[0, 0, 1, 1, 0, 1, 1, 0]], jnp.float32),
           "segment_ids": jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 0]])}
  np.testing.assert_array_equal(step_lib.mtp_valid(batch, 1), [[1, 1, 1, 0, 1, 1, 0, 0]])
  np.testing.assert_array_equal(step_lib.mtp_mask(batch, 1), [[0, 1, 1, 0, 1, 1, 0, 0]])


@pytest.mark.parametrize("records, template, words", [
    ([{"text": "plain"}], None, "c.jsonl:1 has neither a 'messages' list"),
    ([{"messages": [{"role": "user", "content": "q"}]}], None, "c.jsonl:1 has no assistant message"),
    ([{"messages": CONVERSATION}, {"messages": [{"role": "robot", "content": "q"}]}], None, "c.jsonl:2 message 0"),
    ([{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]}], None,
     "no string 'content'"),
    ([{"messages": CONVERSATION}], "{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% endif %}{% endfor %}",
     "rendered differently in part and in whole"),
    ([{"messages": CONVERSATION}], "{% for m in messages %}", "does not compile"),
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
     "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",
     "no assistant token survives the chat template"),
])
def test_bad_chat_input_is_one_line_and_writes_nothing(tmp_path, records, template, words):
  data = _jsonl(tmp_path / "c.jsonl", records)
  if template is not None:
    (tmp_path / "t.jinja").write_text(template)
  with pytest.raises(UserError, match=words) as e:
    prepare.prepare([data], "byte", tmp_path / "out", format="chat", progress=False,
                    chat_template=str(tmp_path / "t.jinja") if template else None)
  assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
  assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def test_chat_cli_refuses_text_files_with_exit_2(tmp_path, run_env):
  (tmp_path / "notes.txt").write_text("a document")
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--input", str(tmp_path / "notes.txt"),
                        "--tokenizer", "byte", "--out", str(tmp_path / "out"), "--format", "chat"],
                       capture_output=True, text=True, env=run_env)
  assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--format chat reads .jsonl, .parquet or .arrow files" in out.stderr
  assert not (tmp_path / "out").exists()
  # an error found while tokenising (after the start) is one line on stderr too
  _jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}, {"messages": 3}])
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--input", str(tmp_path / "c.jsonl"),
                        "--tokenizer", "byte", "--out", str(tmp_path / "out"), "--format", "chat"],
                       capture_output=True, text=True, env=run_env)
  assert out.returncode == 2 and out.stderr == "error: " + str(tmp_path / "c.jsonl") + ":2 has a 'messages' field " \
      "that is not a non-empty list\n", out.stderr
  assert not (tmp_path / "out").exists()


def test_training_and_evaluation_count_the_answer_tokens(tmp_path):
  """A run on chat data: metrics.jsonl's loss_tokens are the loss-mask sums of the batches training read, and the
  held-out evaluation counts answer tokens only as well."""
  from jaxseek.metrics import read_jsonl
  from jaxseek.train import run

  folder = _split_data(tmp_path, count=200)
  overrides = [f"data.source={folder}", "train.seq_len=32", "train.batch_size=8", "train.steps=3",
               f"train.run_dir={tmp_path / 'run'}", "metrics.every=1", "eval.source=holdout", "eval.holdout=0.2",
               "eval.every=3", "eval.tokens=256"]
  cfg = load_config("tiny-dense", *overrides)
  run(cfg)
  records = list(read_jsonl(tmp_path / "run" / "metrics.jsonl"))
  train = iter(batches_lib.make_dataset(load_config("tiny-dense", *overrides, "data.prefetch=0")))
  expected = [float(next(train)["loss_mask"].sum()) for _ in range(3)]
  assert [r["loss_tokens"] for r in records if "loss_tokens" in r] == expected
  assert all(0 < t < 8 * 32 for t in expected)
  eval_cfg = batches_lib.eval_config(cfg)
  held_out = iter(batches_lib.make_dataset(eval_cfg, docs=batches_lib.open_sources(eval_cfg, "eval")))
  assert records[-1]["eval_tokens"] == float(next(held_out)["loss_mask"].sum())
