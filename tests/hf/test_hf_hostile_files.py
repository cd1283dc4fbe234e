"""Folders from an untrusted source given to rp.hf.from_pretrained (issue 41 item 6, the HF part): a bad config.json,
safetensors header, bitsandbytes field or a symlink out of the folder is a ValueError naming the file and the field,
found before anything large is allocated or read (every file here is a few KB; a terabyte is only a header value)."""
import json
import os
import shutil
import struct

import pytest
import torch

import roundpipe as rp

pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")
from safetensors.torch import load_file, save_file  # noqa: E402
from test_qlora import SHAPE, bnb_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

WEIGHT = "model.layers.0.self_attn.q_proj.weight"
NORMS = ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{"plain": a tiny fp32 Llama, "bnb": it through bitsandbytes NF4 without double quantization (fp32 absmax)}."""
    torch.manual_seed(0)
    plain = tmp_path_factory.mktemp("plain")
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", tie_word_embeddings=False, **SHAPE)).save_pretrained(
        plain)
    bnb = tmp_path_factory.mktemp("bnb")
    bnb_model(plain, "nf4", False).save_pretrained(bnb)
    return {"plain": plain, "bnb": bnb}


def _copy(sources, tmp_path, kind="bnb"):
    out = tmp_path / kind
    shutil.copytree(sources[kind], out)
    return out


def _load(folder):
    return rp.hf.from_pretrained(folder, devices=["cpu"])


def _raises(folder, *parts):
    """from_pretrained(folder) is a ValueError whose message holds every one of `parts`."""
    with pytest.raises(ValueError) as e:
        _load(folder)
    for part in parts:
        assert str(part) in str(e.value), (part, str(e.value))


def _split(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header, data=b"", length=None):
    """A safetensors file with this header (a dict, or raw bytes) and data; `length` overrides the length field."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _edit_tensors(folder, edit):
    """Rewrites folder/model.safetensors with edit(tensors) applied (a well-formed file)."""
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _blob(meta):
    return torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)


@pytest.mark.parametrize("text, what", [
    ('{"model_type": ' + "[" * 5000 + "]" * 5000 + "}", "nests too deeply"),
    ("[1, 2, 3]", "a JSON list, not an object"),
    ('{"model_type": "llama", ', "not valid JSON"),
])
def test_config_json_that_is_no_config(sources, tmp_path, text, what):
    """A deeply nested, non-object or truncated config.json names the file and what is wrong."""
    folder = _copy(sources, tmp_path)
    (folder / "config.json").write_text(text)
    _raises(folder, folder / "config.json", what)


def test_config_json_too_large_or_claiming_absurd_layers(sources, tmp_path, monkeypatch):
    """A config.json over the size cap (lowered here to keep the file small) and one claiming 10**9 decoder layers
    (which would take forever to build) name the file and the field."""
    from roundpipe.hf import quantize
    folder = _copy(sources, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "padding": "x" * 3000}))
    monkeypatch.setattr(quantize, "MAX_JSON_BYTES", 2048)
    _raises(folder, folder / "config.json", "bytes")
    monkeypatch.undo()
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 9}))
    _raises(folder, folder / "config.json", "num_hidden_layers=1000000000")
    plain = _copy(sources, tmp_path, "plain")
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 9}))
    _raises(plain, plain / "config.json", "num_hidden_layers")


def test_safetensors_headers_that_lie(sources, tmp_path):
    """A header length of a terabyte, a tensor claiming a terabyte past the file's end, and two tensors over the
    same bytes name the file (and the tensor); for the 4-bit reader and for the plain path (transformers' reader)."""
    folder = _copy(sources, tmp_path)
    path = folder / "model.safetensors"
    header, data = _split(path)
    _write(path, header, data, length=1 << 40)
    _raises(folder, path, "header")
    _write(path, {**header, WEIGHT: {"dtype": "U8", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 1 << 40]}}, data)
    _raises(folder, path, WEIGHT)
    overlapping = {**header, NORMS[1]: dict(header[NORMS[1]], data_offsets=header[NORMS[0]]["data_offsets"])}
    _write(path, overlapping, data)
    _raises(folder, path, "overlapping")
    plain = _copy(sources, tmp_path, "plain")
    path = plain / "model.safetensors"
    header, data = _split(path)
    _write(path, {**header, NORMS[1]: dict(header[NORMS[1]], data_offsets=header[NORMS[0]]["data_offsets"])}, data)
    _raises(plain, path, "not a valid safetensors file")
    _write(path, header, data, length=1 << 40)
    _raises(plain, path)


def test_bnb_fields_of_the_wrong_kind(sources, tmp_path):
    """absmax stored fp16, absmax with a NaN, a quant_state that is not JSON and one claiming a shape of 2**80 values
    each name the file, the weight and the field; nothing of the claimed size is allocated."""
    folder = _copy(sources, tmp_path)
    path = folder / "model.safetensors"
    original = path.read_bytes()
    state_key = f"{WEIGHT}.quant_state.bitsandbytes__nf4"
    meta = json.loads(bytes(load_file(path)[state_key].tolist()))
    cases = [
        (lambda t: t.update({f"{WEIGHT}.absmax": t[f"{WEIGHT}.absmax"].half()}), "torch.float16"),
        (lambda t: t[f"{WEIGHT}.absmax"].__setitem__(3, float("nan")), "NaN"),
        (lambda t: t.update({state_key: torch.tensor(list(b"\xff{not json"), dtype=torch.uint8)}), "not JSON"),
        (lambda t: t.update({state_key: _blob({**meta, "shape": [1 << 40, 1 << 40]})}), "claims shape"),
        (lambda t: t.update({state_key: _blob({**meta, "blocksize": "64"})}), "blocksize"),
        (lambda t: t.update({state_key: torch.zeros(1 << 13, dtype=torch.uint8)}), "at most"),
    ]
    for edit, what in cases:
        path.write_bytes(original)
        _edit_tensors(folder, edit)
        _raises(folder, path, repr(WEIGHT), what)


def test_files_outside_the_folder(sources, tmp_path):
    """A *.safetensors symlink to a file outside the folder, a FIFO named *.safetensors and a shard index naming a
    file outside are ValueErrors naming the file; nothing outside is read and the FIFO is never opened."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for kind in ("bnb", "plain"):
        folder = _copy(sources, tmp_path, kind)
        shutil.move(folder / "model.safetensors", outside / f"{kind}.safetensors")
        os.symlink(outside / f"{kind}.safetensors", folder / "model.safetensors")
        _raises(folder, folder / "model.safetensors", "outside the folder")
    folder = tmp_path / "bnb"
    (folder / "model.safetensors").unlink()
    shutil.copy(sources["bnb"] / "model.safetensors", folder / "model.safetensors")
    os.mkfifo(folder / "extra.safetensors")
    _raises(folder, folder / "extra.safetensors", "not a regular file")
    (folder / "extra.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {WEIGHT: "../outside/bnb.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _raises(folder, "model.safetensors.index.json", "../outside/bnb.safetensors")

    # a hub cache's layout: snapshots/<rev>/<file> -> ../../blobs/<hash>, which loads
    snapshot = tmp_path / "hub" / "models--tiny" / "snapshots" / "abc"
    blobs = tmp_path / "hub" / "models--tiny" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(sources["bnb"].iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / f.name)
    with _load(snapshot) as model:
        assert model.config.model_type == "llama"
