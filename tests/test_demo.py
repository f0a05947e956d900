"""The main job end to end at a small size: files, determinism, and --load."""

from __future__ import annotations

import json

from causal_attention import demo


def test_demo_writes_its_files_is_deterministic_and_loads(tmp_path):
    a = demo.main(steps=25, seed=3, out=tmp_path / "a", load=None, n_eval=24)
    b = demo.main(steps=25, seed=3, out=tmp_path / "b", load=None, n_eval=24)
    for name in ("metrics.json", "loss.png", "attention.png", "model.safetensors", "config.json"):
        assert (tmp_path / "a" / name).stat().st_size > 0
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    for key in ("accuracy", "train_seconds", "tokens_per_s_cache", "tokens_per_s_nocache", "steps"):
        assert key in metrics
    assert metrics["steps"] == 25
    # Same seed, same result.
    assert a["accuracy"] == b["accuracy"] and a["final_loss"] == b["final_loss"]
    # A saved model answers new problems without training.
    loaded = demo.main(steps=0, seed=3, out=tmp_path / "unused", load=tmp_path / "a", n_eval=24)
    assert 0.0 <= loaded["accuracy"] <= 1.0 and loaded["tokens_per_s_cache"] > 0
    assert not (tmp_path / "unused").exists()  # --load trains nothing and writes nothing


def test_saved_model_loads_bit_for_bit(tmp_path):
    import torch

    from causal_attention.gpt import GPTConfig, TinyGPT

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
