"""The C++ program's byte-level BPE tokenizer (csrc/tools/tokenizer.cpp) against the `tokenizers`
package, token for token, on a corpus of unicode, whitespace runs, numbers, emoji and code, for each
kind it reads: GPT-2's (ByteLevel with its regex), Llama 3's (a Split regex, ignore_merges, a BOS
template) and Qwen2's (NFC, its Split regex), plus added tokens with lstrip / rstrip / single_word.
The tokenizers are trained here (nothing is downloaded) with the pre-tokenizer regexes those models
ship. --prompt text goes through it into generation and back out as text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tools.test_cpp_generate import expect_error, run
from tools.test_cpp_huggingface import save_hf

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

# The pre-tokenizer regexes of Llama 3's and Qwen2's tokenizer.json.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure you're right; they'LL say it's THEIR'S, we've 'd and 'M.",
    "a  b\t\tc\n\n\nd   \n  e \r\n f\u00a0g\u3000h\u000bi\u0085j\u2028k",
    "   leading and trailing   ",
    "12345 3.14159 1,000,000 0x1F 2026-12-06 ９８７ ١٢٣",
    "naïve café Ωμέγα Привет мир 你好，世界 こんにちは 안녕하세요 مرحبا שלום",
    "e\u0301 vs \u00e9 and A\u030a vs \u00c5 (NFC composes them)",
    "emoji 👍🏽 👨\u200d👩\u200d👧 🇫🇷 ✨🚀 and ZWJ\u200b here",
    "def f(x):\n    return x**2  # square\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++",
    "<|endoftext|>after a special, and before<|endoftext|>",
    "chat <|eot_id|> turn <|start_header_id|>user<|end_header_id|> end",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "masked [MASK] word and [MASK]and glued, a CUSTOMword and CUSTOM alone",
    "tabs\tand\x01controls\x1b[0m\x7f",
    "",
    " ",
    "\n",
    "zzqx zzqx",
]

TRAINING = CORPUS * 3 + [
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but",
    "what all were when we there can an your which their said if do will each about how up out them then she",
    "many some so these would other into has more her two like him see time could no make than first been its",
] * 20


def trained(kind: str) -> Tokenizer:
    """A byte-level BPE of the kind's layout, trained on TRAINING (600 tokens)."""
    specials = {"gpt2": ["<|endoftext|>"],
                "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                           "<|end_header_id|>"],
                "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}[kind]
    tok = Tokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()
        pattern = LLAMA3 if kind == "llama3" else QWEN2
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING, trainer)
    if kind == "llama3":
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                          special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])])
        # ignore_merges: a word in the vocab is taken whole, though no merge path builds it.
        data = json.loads(tok.to_str())
        data["model"]["ignore_merges"] = True
        data["model"]["vocab"]["Ġzzqx"] = len(data["model"]["vocab"]) + len(data["added_tokens"])
        tok = Tokenizer.from_str(json.dumps(data))
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
    if kind == "gpt2":  # added tokens with RoBERTa's and custom placement rules
        tok.add_special_tokens([AddedToken("[MASK]", lstrip=True, rstrip=False, special=True, normalized=False)])
        tok.add_tokens([AddedToken("CUSTOM", single_word=True, rstrip=True, normalized=False)])
    return tok


KINDS = ["gpt2", "llama3", "qwen2"]


@pytest.fixture(scope="module", params=KINDS)
def tokenizer_dir(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Tokenizer, Path]:
    """A small Llama of 700 tokens saved by transformers, with the kind's tokenizer.json beside it."""
    directory = save_hf("llama", tmp_path_factory.mktemp(request.param) / "hf", vocab_size=700)
    tok = trained(request.param)
    assert tok.get_vocab_size() <= 700
    tok.save(str(directory / "tokenizer.json"))
    return request.param, tok, directory


def tokenized(directory: Path, *args: str) -> list[dict]:
    # split("\n"), not splitlines(): the JSON text holds U+2028 and U+0085 as they are
    return [json.loads(line) for line in run("--model", str(directory), "--tokenize", *args).stdout.split("\n") if line]


def test_encodings_equal_tokenizers(tokenizer_dir: tuple[str, Tokenizer, Path]) -> None:
    kind, tok, directory = tokenizer_dir
    lines = tokenized(directory, *sum((["--prompt", text] for text in CORPUS), []))
    assert len(lines) == len(CORPUS)
    for text, line in zip(CORPUS, lines):
        assert line["ids"] == tok.encode(text).ids, (kind, text)
        assert line["text"] == tok.decode(line["ids"]), (kind, text)
    if kind == "llama3":
        assert lines[0]["ids"][0] == tok.token_to_id("<|begin_of_text|>")
        assert tok.token_to_id("Ġzzqx") in lines[-1]["ids"]
    if kind == "qwen2":  # NFC: the decomposed and composed letters encode alike
        assert tok.encode("e\u0301").ids == tok.encode("\u00e9").ids


def test_random_text_equals_tokenizers(tokenizer_dir: tuple[str, Tokenizer, Path]) -> None:
    """Strings drawn from the corpus's characters and whitespace, in random order and runs."""
    kind, tok, directory = tokenizer_dir
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    alphabet = sorted(set("".join(CORPUS)) | set(" \t\n\r'"))
    texts = ["".join(alphabet[i] for i in torch.randint(0, len(alphabet), (int(n),), generator=gen))
             for n in torch.randint(1, 60, (40,), generator=gen)]
    texts = [t for t in texts if "\x00" not in t]  # a command-line argument cannot hold NUL
    lines = tokenized(directory, *sum((["--prompt", text] for text in texts), []))
    for text, line in zip(texts, lines):
        assert line["ids"] == tok.encode(text).ids, (kind, repr(text))


def test_decoding_equals_tokenizers(tokenizer_dir: tuple[str, Tokenizer, Path]) -> None:
    """Random id sequences (split UTF-8 characters, special tokens) decode as tokenizers decodes them:
    specials left out, bytes that are no UTF-8 as U+FFFD."""
    kind, tok, directory = tokenizer_dir
    gen = torch.Generator().manual_seed(10 + KINDS.index(kind))
    sequences = [torch.randint(0, tok.get_vocab_size(), (int(n),), generator=gen).tolist()
                 for n in torch.randint(1, 30, (30,), generator=gen)]
    sequences.append([tok.token_to_id(c) for c in ("ð", "Ł")])  # the first two bytes of a 4-byte character
    lines = tokenized(directory, *sum((["--tokens", ",".join(map(str, ids))] for ids in sequences), []))
    for ids, line in zip(sequences, lines):
        assert line["ids"] == ids
        assert line["text"] == tok.decode(ids), (kind, ids)
    assert lines[-1]["text"] == tok.decode(sequences[-1]) == "\ufffd"


def test_prompts_generate_text_as_python(tokenizer_dir: tuple[str, Tokenizer, Path]) -> None:
    """--prompt: encoded, generated (one prompt streamed, a batch at the end) and decoded, equal to
    Python's generate on tokenizers' ids, decoded by tokenizers."""
    from causal_attention.models.convert import from_huggingface

    kind, tok, directory = tokenizer_dir
    model = from_huggingface(directory)
    prompts = ["Hello world", "def f(x):", "naïve café 👍🏽"]
    ids = [tok.encode(p).ids for p in prompts]
    expected = [tok.decode(a) for a in model.generate(ids, 12)]
    out = run("--model", str(directory), "--max-new-tokens", "12", *sum((["--prompt", p] for p in prompts), []))
    assert out.stdout == "".join(text + "\n" for text in expected)
    alone = run("--model", str(directory), "--max-new-tokens", "12", "--prompt", prompts[2])
    assert alone.stdout == expected[2] + "\n"


def test_generation_stops_at_the_models_eos_ids(tmp_path: Path) -> None:
    """A transformers directory's eos_token_id (generation_config.json's list first) ends a sequence."""
    from causal_attention.models.convert import from_huggingface

    directory = save_hf("llama", tmp_path / "hf")
    model = from_huggingface(directory)
    prompt = [1, 2, 3]
    free = model.generate([prompt], 8)[0]
    stop = free[3]
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [89, stop]}))
    out = run("--model", str(directory), "--max-new-tokens", "8", "--tokens", "1,2,3")
    assert out.stdout.strip() == ",".join(map(str, free[: free.index(stop) + 1]))
    assert run("--model", str(directory), "--max-new-tokens", "8", "--eos", "89", "--tokens", "1,2,3").stdout.strip() \
        == ",".join(map(str, free))
    # An id no token has is never generated: left out with a note (transformers warns of it too).
    (directory / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [50256, stop]}))
    out = run("--model", str(directory), "--max-new-tokens", "8", "--tokens", "1,2,3")
    assert out.stdout.strip() == ",".join(map(str, free[: free.index(stop) + 1]))
    assert "eos_token_id 50256 is outside the model's vocabulary" in out.stderr
    (directory / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": "2"}))
    expect_error("--model", str(directory), "--tokens", "1,2,3", contains=["eos_token_id must be an int"])


def test_unsupported_tokenizers_are_named(tmp_path: Path) -> None:
    """A tokenizer.json this program cannot read: --prompt names what; --tokens still run."""
    directory = save_hf("llama", tmp_path / "hf", vocab_size=700)
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.save(str(directory / "tokenizer.json"))
    expect_error("--model", str(directory), "--prompt", "a", contains=["tokenizer.json", "model type 'WordPiece'"])
    assert run("--model", str(directory), "--tokens", "1", "--max-new-tokens", "2").stdout.strip()
    data = json.loads(trained("gpt2").to_str())
    data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    (directory / "tokenizer.json").write_text(json.dumps(data))
    expect_error("--model", str(directory), "--prompt", "a", contains=["pre-tokenizer 'Metaspace' is not supported"])
    data = json.loads(trained("gpt2").to_str())
    data["model"]["vocab"]["Ġbig"] = 700
    (directory / "tokenizer.json").write_text(json.dumps(data))
    expect_error("--model", str(directory), "--prompt", "a", contains=["vocab['Ġbig'] = 700 is outside the model's"])


def tiny_bpe(merges: list[tuple[str, str]], *, unk: bool = False, fuse_unk: bool = False) -> Tokenizer:
    """A byte-level BPE over ASCII letters and space only (other bytes have no token), with these merges."""
    alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ"]
    vocab = {c: i for i, c in enumerate(alphabet + (["<unk>"] if unk else []))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>" if unk else None, fuse_unk=fuse_unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def same_as_tokenizers(tok: Tokenizer, directory: Path, texts: list[str]) -> None:
    tok.save(str(directory / "tokenizer.json"))
    lines = tokenized(directory, *sum((["--prompt", t] for t in texts), []))
    for text, line in zip(texts, lines):
        assert line["ids"] == tok.encode(text).ids, repr(text)
        assert line["text"] == tok.decode(line["ids"]), repr(text)


def test_edge_rules_equal_tokenizers(tmp_path: Path) -> None:
    """Rules of tokenizers that its files rarely exercise: duplicate merges keep their last rank,
    fuse_unk joins runs of unknown characters, added tokens take the ids tokenizers gives them (not
    the file's), normalized added tokens match the normalized text, and a long word merges in
    n log n (a 64000-character word)."""
    directory = save_hf("llama", tmp_path / "hf", vocab_size=700)
    same_as_tokenizers(tiny_bpe([("b", "c"), ("a", "b"), ("ab", "c"), ("b", "c")]), directory, ["abc", "abcbc", "cab"])
    same_as_tokenizers(tiny_bpe([("a", "b")], unk=True, fuse_unk=True), directory, ["é é x ©©", "abé©x", "ÿÿÿ ab"])
    same_as_tokenizers(tiny_bpe([("a", "b")], unk=True), directory, ["é é x ©©"])
    same_as_tokenizers(tiny_bpe([("t", "h"), ("th", "e"), ("a", "b")]), directory, ["abab" * 16000])

    data = json.loads(trained("gpt2").to_str())
    vocab = data["model"]["vocab"]
    data["added_tokens"] += [
        {"id": 650, "content": "<x>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": False},
        {"id": 640, "content": "the", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}]
    assert "the" in vocab
    tok = Tokenizer.from_str(json.dumps(data))
    same_as_tokenizers(tok, directory, ["a<x>b the other", "the<x>"])
    assert tok.encode("<x>").ids != [650]  # the rule above is tokenizers', not the file's
    lines = tokenized(directory, "--tokens", f"{vocab['the']},{tok.token_to_id('<x>')},{vocab['Ġthe']}")
    assert lines[0]["text"] == tok.decode([vocab["the"], tok.token_to_id("<x>"), vocab["Ġthe"]])

    rstrip = trained("gpt2")
    rstrip.add_tokens([AddedToken("X", rstrip=True, normalized=False), AddedToken(" Y", normalized=False)])
    same_as_tokenizers(rstrip, directory, ["X Y", "X  Y Z", "aX   b", "X Y X"])

    nfc = trained("qwen2")
    nfc.add_tokens([AddedToken("cafe\u0301", normalized=True)])
    same_as_tokenizers(nfc, directory, ["un café", "un cafe\u0301 ici", "café"])
