"""Tests for roundpipe.commands.data: the built-in byte corpus and its seeded batches."""
import pytest
import torch

from roundpipe.commands.data import VOCAB_SIZE, ByteCorpus, stdlib_dir


def _write(root, files):
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def test_stdlib_corpus_reads_python_sources_in_sorted_order():
    """The default corpus is the stdlib's *.py files, sorted, without installed packages."""
    corpus = ByteCorpus.load()
    rel = [p.relative_to(stdlib_dir()).as_posix() for p in corpus.files]
    assert rel == sorted(rel) and len(rel) > 100
    assert all(r.endswith(".py") and "site-packages" not in r for r in rel)
    assert any(r == "os.py" for r in rel)
    assert len(corpus) > 1_000_000
    assert bytes(corpus.data[:len(corpus.files[0].read_bytes())].tolist()) == corpus.files[0].read_bytes()


def test_batches_are_shifted_windows_of_the_right_shape():
    """labels are input_ids shifted by one byte, int64 [B, T], from the corpus itself."""
    corpus = ByteCorpus.load()
    x, y = next(corpus.batches(3, 17, seed=5))
    assert x.shape == y.shape == (3, 17) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < VOCAB_SIZE
    data = bytes(corpus.split("train").tolist())
    for row_x, row_y in zip(x, y):
        window = bytes(row_x.tolist()) + bytes([int(row_y[-1])])
        assert window in data


def test_batches_are_deterministic_per_seed():
    """The same seed gives the same batches; another seed gives different ones."""
    corpus = ByteCorpus.load()
    a = list(corpus.batches(4, 32, seed=1, steps=3))
    b = list(corpus.batches(4, 32, seed=1, steps=3))
    c = list(corpus.batches(4, 32, seed=2, steps=3))
    assert len(a) == 3
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], c[0][0])


def test_validation_split_is_disjoint_tail():
    """Validation batches come from the held-out tail only."""
    data = torch.arange(200, dtype=torch.uint8)
    corpus = ByteCorpus(data, val_fraction=0.25)
    assert corpus.split("train").numel() == 150 and corpus.split("val").numel() == 50
    for x, _ in corpus.batches(8, 10, split="val", steps=5):
        assert int(x.min()) >= 150
    for _x, y in corpus.batches(8, 10, split="train", steps=5):
        assert int(y.max()) < 150


def test_data_dir_override_reads_text_files_and_skips_binary_and_hidden(tmp_path):
    """--data-dir reads every text file recursively, sorted, skipping binary and hidden files."""
    _write(tmp_path, {"b.txt": b"bbbb", "a/z.md": b"zz", "bin.dat": b"\0\1\2", ".hidden/x.txt": b"hh",
                      ".dot.txt": b"dd"})
    corpus = ByteCorpus.load(tmp_path, val_fraction=0.1)
    assert [p.name for p in corpus.files] == ["z.md", "b.txt"]
    assert bytes(corpus.data.tolist()) == b"zz\nbbbb"


@pytest.mark.parametrize("bad", ["missing", "file.txt"])
def test_data_dir_that_is_not_a_folder_is_rejected(tmp_path, bad):
    """A data_dir that does not exist or is a file raises ValueError naming it."""
    _write(tmp_path, {"file.txt": b"x"})
    with pytest.raises(ValueError, match="data_dir=.*is not a directory"):
        ByteCorpus.from_dir(tmp_path / bad)


def test_data_dir_without_text_files_is_rejected(tmp_path):
    """A folder with only binary files raises ValueError."""
    _write(tmp_path, {"x.bin": b"\0" * 10})
    with pytest.raises(ValueError, match="no text files"):
        ByteCorpus.from_dir(tmp_path)


def test_seq_len_longer_than_the_data_is_rejected(tmp_path):
    """A window longer than the split raises ValueError naming seq_len and the bytes available."""
    _write(tmp_path, {"a.txt": b"hello world" * 4})
    corpus = ByteCorpus.load(tmp_path, val_fraction=0.5)
    with pytest.raises(ValueError, match="seq_len=64 needs at least 65 bytes"):
        next(corpus.batches(2, 64))


@pytest.mark.parametrize("kwargs, match", [({"batch_size": 0}, "batch_size=0"), ({"seq_len": -3}, "seq_len=-3"),
                                           ({"batch_size": 2.5}, "batch_size=2.5"), ({"steps": -1}, "steps=-1"),
                                           ({"split": "test"}, "split='test'")])
def test_bad_batch_arguments_are_rejected(kwargs, match):
    """Non-positive sizes, negative steps and unknown splits raise ValueError naming the argument."""
    corpus = ByteCorpus(torch.zeros(100, dtype=torch.uint8))
    args = {"batch_size": 2, "seq_len": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        next(corpus.batches(**args))


def test_bad_corpus_construction_is_rejected():
    """Wrong data types and val_fraction outside (0, 1) are rejected."""
    with pytest.raises(TypeError, match="data must be a 1-D uint8 tensor"):
        ByteCorpus(torch.zeros(10, dtype=torch.int64))
    with pytest.raises(ValueError, match="val_fraction=1.0"):
        ByteCorpus(torch.zeros(10, dtype=torch.uint8), val_fraction=1.0)
