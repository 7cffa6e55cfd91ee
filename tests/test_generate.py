"""Generation (jmoe/inference/generate.py, python -m jmoe.generate): decoding with the key/value
cache gives the tokens of the reference that recomputes the whole sequence each step, for every
model family, with windows and sinks, greedy and sampled; the command end to end."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmoe
from jmoe.config import ConfigError, ParallelConfig, load_config
from jmoe.inference.generate import generate, sample
from jmoe.parallel import make_layout
from helpers import build

ROOT = pathlib.Path(__file__).parents[1]
# Prompts of different lengths in one batch; 3 rows on 8 devices (padded rows).
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [7], [200, 11, 11, 64]]


def model_of(name: str, **model):
  overrides = [f"--config.model.{k}={v}" for k, v in model.items()]
  config = load_config(str(ROOT / f"configs/{name}.py"), ["--config.precision.compute=float32",
                                                          *overrides])
  return config, build(config, seed=1)


FAMILIES = {
    "tiny_moe": {}, "tiny_qwen3_moe": {}, "tiny_dense": {}, "tiny_deepseek_v3": {},
    # windows shorter than prompt + continuation, so that they cut
    "tiny_mixtral": dict(sliding_window=5),
    "tiny_gpt_oss": dict(sliding_window=4),  # alternating windows, sinks, biases
}


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_with_and_without_the_cache_are_the_same(name):
  _, model = model_of(name, **FAMILIES[name])
  layout = make_layout(ParallelConfig())
  cached = generate(model, layout, PROMPTS, max_new_tokens=12)
  reference = generate(model, layout, PROMPTS, max_new_tokens=12, cache=False)
  assert cached == reference
  # The first new token is the argmax of the model's own logits after the prompt.
  forward = nnx.jit(lambda model, tokens_1S: model(tokens_1S)[0])
  for prompt, new in zip(PROMPTS, cached):
    logits_1SV = forward(model, jnp.asarray([prompt]))
    assert new[0] == int(jnp.argmax(logits_1SV[0, -1]))
  assert len({tuple(n) for n in cached}) > 1  # the rows are not one another's copies


def test_sampling_follows_the_seed_the_same_way_with_and_without_the_cache():
  _, model = model_of("tiny_gpt_oss", sliding_window=4)
  layout = make_layout(ParallelConfig())
  kw = dict(max_new_tokens=10, temperature=1.5, top_p=0.9)
  cached = generate(model, layout, PROMPTS, seed=3, **kw)
  assert cached == generate(model, layout, PROMPTS, seed=3, cache=False, **kw)
  assert cached != generate(model, layout, PROMPTS, seed=4, **kw)


def test_sampler_keeps_the_nucleus():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 400)
  drawn = np.asarray([int(sample(logits, k, 1.0, 0.7)[0]) for k in keys])
  assert set(drawn) == {0, 1}  # 0.5 + 0.3 reach 0.7; the rest are never drawn
  assert abs(np.mean(drawn == 0) - 0.5 / 0.8) < 0.08
  assert int(sample(logits, keys[0], 1.0, 1e-6)[0]) == 0  # a tiny nucleus is greedy
  assert int(sample(logits, keys[0], 0.0, 1.0)[0]) == 0


def test_bad_requests_are_refused():
  _, model = model_of("tiny_moe")
  layout = make_layout(ParallelConfig())
  with pytest.raises(ConfigError, match="at least one token"):
    generate(model, layout, [[1], []], max_new_tokens=2)
  with pytest.raises(ConfigError, match="top-p"):
    generate(model, layout, [[1]], max_new_tokens=2, top_p=0.0)


def test_the_command_and_the_python_api(tmp_path):
  config, model = model_of("tiny_moe")
  from flax import nnx
  from jmoe.checkpoint.params import save_model
  save_model(tmp_path / "model", nnx.state(model), config)
  tokens = tmp_path / "prompts.txt"
  tokens.write_text("".join(" ".join(map(str, p)) + "\n" for p in PROMPTS))
  out = subprocess.run([sys.executable, "-m", "jmoe.generate", "--checkpoint",
                        str(tmp_path / "model"), "--tokens-file", str(tokens),
                        "--max-new-tokens", "6"], capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 0, out.stderr
  records = [json.loads(line) for line in out.stdout.splitlines()]
  assert [r["tokens"] for r in records] == jmoe.generate(model, PROMPTS, max_new_tokens=6)
  text = subprocess.run([sys.executable, "-m", "jmoe.generate", "--checkpoint",
                         str(tmp_path / "model"), "--prompt", "The cat", "--tokenizer", "bytes",
                         "--max-new-tokens", "4"], capture_output=True, text=True, cwd=ROOT)
  assert text.returncode == 0, text.stderr
  record = json.loads(text.stdout)
  assert len(record["tokens"]) == 4 and isinstance(record["text"], str)
  refused = subprocess.run([sys.executable, "-m", "jmoe.generate", "--checkpoint",
                            str(tmp_path / "model"), "--prompt", "x"], capture_output=True,
                           text=True, cwd=ROOT)
  assert refused.returncode == 2 and "--prompt needs --tokenizer" in refused.stderr
