"""The main job end to end at a small size: files, determinism, and --load."""

from __future__ import annotations

import json

import pytest
import torch

from causal_attention.tools import demo
from helpers import BASE_SEED


TIMES = ("train_seconds", "train_tokens_per_s", "tokens_per_s_cache", "tokens_per_s_nocache")


@pytest.fixture
def one_thread():
    """The demo's model is small: on a busy 2-core machine two threads can make each of its ops
    wait a scheduler tick (a 60-step run took 140 s instead of 12 s). Results are deterministic
    for a given thread count, so the thread count is fixed here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_demo_learns_and_a_saved_model_gives_the_same_answers(tmp_path, one_thread):
    """60 steps are enough to answer some held-out problems exactly (an untrained model answers none:
    each is a reversal of 1 to 12 digits); the saved model reproduces the trained model's answers,
    and --load answers new problems with it."""
    seed = 3 + BASE_SEED
    trained = demo.main(steps=60, seed=seed, out=tmp_path / "a", load=None, n_eval=64)
    for name in ("metrics.json", "loss.png", "attention.png", "model.safetensors", "config.json"):
        assert (tmp_path / "a" / name).stat().st_size > 0
    assert (tmp_path / "a" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert metrics == pytest.approx(trained)
    assert metrics["steps"] == 60 and metrics["eval_problems"] == 64
    assert trained["accuracy"] >= 0.1, trained  # it learned something that needs attention

    model = demo.load_model(tmp_path / "a")
    accuracy, _, answers = demo.evaluate(model, demo.heldout_problems(seed, 64), use_cache=True)
    assert accuracy == trained["accuracy"]  # the saved weights are the trained ones
    assert all(1 <= len(a) <= demo.MAX_DIGITS + 1 for a in answers)

    loaded = demo.main(steps=0, seed=seed, out=tmp_path / "unused", load=tmp_path / "a", n_eval=64)
    problems = demo.new_problems(seed, 64)
    assert problems != demo.heldout_problems(seed, 64)
    expected, _, _ = demo.evaluate(model, problems, use_cache=False)  # without the cache: another path
    assert loaded["accuracy"] == expected >= 0.1 and loaded["tokens_per_s_cache"] > 0
    assert not (tmp_path / "unused").exists()  # --load trains nothing and writes nothing


def test_demo_is_deterministic(tmp_path, one_thread):
    """Same seed, same model file and metrics (times aside)."""
    runs = [demo.main(steps=6, seed=11 + BASE_SEED, out=tmp_path / name, load=None, n_eval=8) for name in "ab"]
    a, b = ({k: v for k, v in run.items() if k not in TIMES} for run in runs)
    assert a == b
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()



def test_training_depends_on_its_seed():
    """A run that ignored its seed would be trivially deterministic."""
    from rich.console import Console

    from causal_attention.models import GPTConfig, TinyGPT

    losses = []
    for seed in (BASE_SEED, BASE_SEED + 1):
        torch.manual_seed(0)  # the same initial weights: only the batches differ
        model = TinyGPT(GPTConfig(vocab_size=demo.VOCAB, max_len=demo.MAX_LEN, dim=32, n_layers=1, n_heads=2))
        losses.append(demo.train(model, steps=3, seed=seed, batch_size=8, console=Console(quiet=True))[0])
    assert losses[0] != losses[1]


def test_saved_model_loads_bit_for_bit(tmp_path):
    import torch

    from causal_attention.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=demo.VOCAB, max_len=demo.MAX_LEN, dim=32, n_layers=2, n_heads=2))
    demo.save_model(model, tmp_path)
    loaded = demo.load_model(tmp_path)
    assert loaded.config == model.config
    for (name, p), (name2, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert name == name2 and torch.equal(p, q)


def test_batches_are_right_padded_with_answer_targets():
    import random

    tokens, mask, targets = demo.make_batch(random.Random(0), 8)
    lengths = mask.sum(1)
    assert bool((mask == (tokens.new_ones(tokens.shape).cumsum(1) <= lengths[:, None])).all())  # right padding
    for b in range(8):
        seq = tokens[b, : lengths[b]].tolist()
        sep = seq.index(demo.SEP)
        digits = seq[1:sep]
        assert seq[sep + 1 :] == [*reversed(digits), demo.EOS]
        expected = targets.new_full((tokens.shape[1],), -100)
        expected[sep : lengths[b] - 1] = tokens[b, sep + 1 : lengths[b]]
        assert targets[b].tolist() == expected.tolist()
