"""Checkpoints and safetensors files from an untrusted source: a ValueError naming the file and the field, in
bounded time and memory, and a model left as it was (roundpipe/engine/state/tensor_file.py, checkpoint.py)."""
import json
import os
import random
import shutil
import struct
import zipfile

import pytest
import torch
import torch.nn.functional as F

import roundpipe as rp
from roundpipe.engine.state import tensor_file
from roundpipe.engine.state.tensor_file import TensorFile

TB = 2 ** 40


def raw_file(path, header, data=b"", length=None):
    """A safetensors-shaped file: `header` (an object, or bytes as they are) after its length field."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return str(path)


def f32(name="a", shape=(2, 2), offsets=None):
    n = 4 * (shape[0] * shape[1] if len(shape) == 2 else 1)
    return {name: {"dtype": "F32", "shape": list(shape), "data_offsets": offsets or [0, n]}}


def entry(**kw):
    e = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    e.update(kw)
    return {"a": e}


DATA = bytes(range(16))
# (id, header, data, length field or None, the words the message must hold)
READER_CASES = [
    ("empty", b"", b"", 0, r"the header is not valid JSON"),
    ("length-huge", b"{}", b"", 2 ** 63, r"header length field says 9223372036854775808 bytes; at most 100000000"),
    ("length-past-end", b"{}", b"", 50_000_000, r"header length field says 50000000 bytes but the file has"),
    ("not-json", b"\xff\xfe{{not json", b"", None, r"the header is not valid JSON"),
    ("deep-nesting", b"[" * 200_000 + b"]" * 200_000, b"", None, r"nests too deeply"),
    ("json-list", [1, 2], b"", None, r"the header is a JSON list, not an object"),
    ("huge-string", {"a": "x" * 5_000_000}, b"", None, r"tensor 'a' is 'xxx.*\(5000002 characters\), not an object"),
    ("big-int", b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 16]}}', DATA, None,
     r"not valid JSON \(Exceeds the limit"),
    ("duplicate-key", b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "a": {}}', DATA, None,
     r"the key 'a' appears twice"),
    ("metadata-not-strings", {"__metadata__": {"aliases": 3}, **entry()}, DATA, None, r"__metadata__ must be an object"),
    ("metadata-list", {"__metadata__": ["x"], **entry()}, DATA, None, r"__metadata__ must be an object"),
    ("entry-not-object", {"a": [1]}, DATA, None, r"tensor 'a' is \[1\], not an object"),
    ("dtype-unknown", entry(dtype="F8_E9M9"), DATA, None, r"tensor 'a': unknown dtype 'F8_E9M9'"),
    ("dtype-list", entry(dtype=["F32"]), DATA, None, r"tensor 'a': unknown dtype \['F32'\]"),
    ("dtype-missing", {"a": {"shape": [4], "data_offsets": [0, 16]}}, DATA, None, r"tensor 'a': unknown dtype None"),
    ("shape-negative", entry(shape=[-1, -16]), DATA, None, r"tensor 'a': shape \[-1, -16\] must be a list"),
    ("shape-float", entry(shape=[2.0, 2]), DATA, None, r"tensor 'a': shape \[2.0, 2\] must be a list"),
    ("shape-bool", entry(shape=[True, 4]), DATA, None, r"tensor 'a': shape \[True, 4\] must be a list"),
    ("shape-string", entry(shape="4"), DATA, None, r"tensor 'a': shape '4' must be a list"),
    ("shape-nested", entry(shape=[[4]]), DATA, None, r"tensor 'a': shape \[\[4\]\] must be a list"),
    ("shape-many-dims", entry(shape=[1] * 65), DATA, None, r"tensor 'a': shape .* at most 64 integers"),
    ("shape-terabytes", entry(shape=[TB, 1024]), DATA, None, r"tensor 'a': data_offsets \[0, 16\] hold 16 bytes but "
     r"dtype F32 shape \[1099511627776, 1024\] needs 4503599627370496"),
    ("shape-overflows", entry(shape=[0, TB, TB, TB]), b"", None, r"tensor 'a': shape .* more than 2\*\*62 elements"),
    ("offsets-terabytes", entry(shape=[TB // 4], data_offsets=[0, TB]), DATA, None,
     r"tensor 'a': data_offsets \[0, 1099511627776\] fall outside the data section of 16 bytes"),
    ("offsets-past-end", entry(data_offsets=[8, 24]), DATA, None, r"data_offsets \[8, 24\] fall outside"),
    ("offsets-negative", entry(data_offsets=[-4, 12]), DATA, None, r"data_offsets \[-4, 12\] fall outside"),
    ("offsets-reversed", entry(shape=[0], data_offsets=[16, 0]), DATA, None, r"data_offsets \[16, 0\] fall outside"),
    ("offsets-not-shape", entry(data_offsets=[0, 12]), DATA, None,
     r"data_offsets \[0, 12\] hold 12 bytes but dtype F32 shape \[2, 2\] needs 16"),
    ("offsets-string", entry(data_offsets="0,16"), DATA, None, r"data_offsets '0,16' must be a list of two integers"),
    ("offsets-three", entry(data_offsets=[0, 8, 16]), DATA, None, r"data_offsets \[0, 8, 16\] must be a list of two"),
    ("offsets-float", entry(data_offsets=[0.0, 16.0]), DATA, None, r"data_offsets \[0.0, 16.0\] must be a list"),
    ("overlap", {**f32("a", (2, 2)), **f32("b", (2, 2), [8, 24])}, DATA + DATA[:8], None,
     r"tensor 'b': data_offsets begin at 8 but the tensors before it end at 16 \(overlapping\)"),
    ("gap", {**f32("a", (1, 2)), **f32("b", (1, 2), [12, 20])}, DATA + DATA[:4], None,
     r"tensor 'b': data_offsets begin at 12 but the tensors before it end at 8 \(a gap\)"),
    ("trailing-bytes", f32("a", (1, 2)), DATA, None, r"the tensors' data_offsets end at 8 but the data section has 16"),
]


@pytest.mark.parametrize("case", READER_CASES, ids=[c[0] for c in READER_CASES])
def test_a_hostile_safetensors_header_is_a_value_error_naming_file_and_field(tmp_path, case):
    """Each hand-written malformed header: a ValueError that starts with the file's path and names the field,
    in a short message, before anything the header claims is allocated."""
    _, header, data, length, words = case
    path = raw_file(tmp_path / "x.safetensors", header, data, length)
    with pytest.raises(ValueError, match=words) as err:
        TensorFile(path)
    assert str(err.value).startswith(path) and len(str(err.value)) < 600


def test_a_fifo_a_folder_and_a_truncated_file_are_refused_without_hanging(tmp_path):
    """A FIFO named like a tensor file would block an open for reading: refused as not a regular file."""
    os.mkfifo(tmp_path / "fifo.safetensors")
    os.mkdir(tmp_path / "dir.safetensors")
    for name in ("fifo.safetensors", "dir.safetensors"):
        with pytest.raises(ValueError, match=f"{name}: not a regular file"):
            TensorFile(str(tmp_path / name))
    path = tmp_path / "short.safetensors"
    tensor_file.write(str(path), [("a", torch.ones(3))])
    path.write_bytes(path.read_bytes()[:5])
    with pytest.raises(ValueError, match="short.safetensors: 5 bytes, too short"):
        TensorFile(str(path))


HOSTILE_VALUES = [None, True, -1, -2 ** 63, 2 ** 64, 1.5, float("nan"), "", "x" * 1000, "F32", [], [-1], [0, -1],
                  [2 ** 62, 2 ** 62], [1, 2, 3], {}, {"a": 1}, [[0, 4]], [0, 4], [4], [0], [2, 2], "I8", "BOOL"]


def mutate_file(rnd, good: bytes) -> bytes:
    """One seeded mutation of a valid file: a field of an entry set to a hostile value, bytes flipped,
    the length field changed, or the file cut short."""
    (n,) = struct.unpack("<Q", good[:8])
    kind = rnd.randrange(4)
    if kind == 0:
        header = json.loads(good[8:8 + n])
        name = rnd.choice(sorted(header))
        if name == "__metadata__" or rnd.random() < 0.2:
            header[name] = rnd.choice(HOSTILE_VALUES)
        else:
            header[name][rnd.choice(["dtype", "shape", "data_offsets", "extra"])] = rnd.choice(HOSTILE_VALUES)
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + good[8 + n:]
    out = bytearray(good)
    if kind == 1:
        for _ in range(rnd.randint(1, 4)):
            out[rnd.randrange(len(out))] = rnd.randrange(256)
        return bytes(out)
    if kind == 2:
        out[:8] = struct.pack("<Q", rnd.choice([0, 1, n - 1, n + 1, n + 8, len(good), 2 ** 31, 2 ** 64 - 1]))
        return bytes(out)
    return bytes(out[:rnd.randrange(len(out))])


def test_seeded_mutations_of_a_valid_file_are_refused_or_read_exactly_as_safetensors_reads_them(tmp_path):
    """600 seeded mutations of a valid file (tensors of several dtypes, an empty one, metadata): the reader
    raises a ValueError naming the file, or accepts a file that the safetensors library reads to the same
    tensors; never another exception."""
    safetensors = pytest.importorskip("safetensors")
    good_path = str(tmp_path / "good.safetensors")
    g = torch.Generator().manual_seed(0)
    tensor_file.write(good_path, [("w", torch.randn(3, 5, generator=g)), ("b", torch.arange(4, dtype=torch.int64)),
                                  ("e", torch.zeros(0, 7)), ("h", torch.randn(6, generator=g).to(torch.bfloat16)),
                                  ("m", torch.tensor([True, False, True]))], {"format": "pt", "aliases": "{}"})
    good = open(good_path, "rb").read()
    rnd = random.Random(1)
    path = str(tmp_path / "m.safetensors")
    accepted = refused = 0
    for i in range(600):
        with open(path, "wb") as f:
            f.write(mutate_file(rnd, good))
        try:
            with TensorFile(path) as tf:
                ours = {name: tf.read(name) for name in tf.entries}
        except ValueError as e:
            assert str(e).startswith(path), (i, e)
            refused += 1
            continue
        accepted += 1
        with safetensors.safe_open(path, framework="pt") as sf:
            assert sorted(sf.keys()) == sorted(ours), i
            for name in ours:
                assert torch.equal(sf.get_tensor(name), ours[name]), (i, name)
    assert refused > 300 and accepted > 20, (refused, accepted)


# ---------------------------------------------------------------- whole checkpoints

def small_model(**kw):
    torch.manual_seed(0)
    return rp.RoundPipe([torch.nn.Linear(4, 4) for _ in range(3)], devices=["cpu"] * 2, **kw)


def train_and_save(path, **kw):
    """A checkpoint with a pending asynchronous step, held gradients, AdamW and LambdaLR state."""
    with small_model(**kw) as model:
        opt = rp.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for _ in range(2):
            model.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=F.mse_loss)
            model.step(opt, lr_scheduler=sched, asynchronous=True)
        model.save_checkpoint(path, opt, sched)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "c"
    train_and_save(path)
    return path


def edit_json(path, name, change):
    with open(path / name) as f:
        got = json.load(f)
    change(got)
    with open(path / name, "w") as f:
        json.dump(got, f)


def rewrite_tensors(path, name, change_header=None, data=None):
    """Rewrites a safetensors file of the checkpoint through `change_header(header)` (and new data bytes), then
    records its new size in the manifest, so that the reader's own checks are what refuse it."""
    raw = (path / name).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if change_header is not None:
        change_header(header)
    body = json.dumps(header).encode()
    (path / name).write_bytes(struct.pack("<Q", len(body)) + body + (raw[8 + n:] if data is None else data))
    resize(path, name)


def resize(path, name):
    edit_json(path, "checkpoint.json", lambda m: m["files"].__setitem__(name, os.path.getsize(path / name)))


def set_field(*keys, value):
    def change(m):
        for k in keys[:-1]:
            m = m[k]
        m[keys[-1]] = value
    return lambda p: edit_json(p, "checkpoint.json", change)


def link_outside(name):
    def do(p):
        outside = p.parent / f"outside-{name}"
        shutil.copy(p / name, outside)
        os.remove(p / name)
        os.symlink(outside, p / name)
    return do


def as_int8(h):
    e = h["0.weight"]
    e["dtype"] = "I8"
    shift = 16 * 3   # a 4x4 fp32 master stored in 16 bytes: every later range moves down 48 bytes
    start = e["data_offsets"][0]
    e["data_offsets"] = [start, start + 16]
    for k, v in h.items():
        if k != "__metadata__" and v["data_offsets"][0] > start:
            v["data_offsets"] = [v["data_offsets"][0] - shift, v["data_offsets"][1] - shift]


def cut_int8(p):
    raw = (p / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    with TensorFile(str(p / "model.safetensors")) as tf:
        _, _, at, nbytes = tf.entries["0.weight"]
    data = raw[8 + n:at] + raw[at:at + 16] + raw[at + nbytes:]
    rewrite_tensors(p, "model.safetensors", as_int8, data)


def zip_deflated(p):
    with zipfile.ZipFile(p / "lr_scheduler.pt") as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    os.remove(p / "lr_scheduler.pt")
    with zipfile.ZipFile(p / "lr_scheduler.pt", "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in members:
            z.writestr(name, data)
    resize(p, "lr_scheduler.pt")


def saved_obj(name, obj):
    def do(p):
        torch.save(obj, p / name)
        resize(p, name)
    return do


def engine_tensor(name, value):
    def do(p):
        with TensorFile(str(p / "engine.safetensors")) as tf:
            tensors = [(n, value if n == name else tf.read(n)) for n in tf.entries]
        if name not in dict(tensors):
            tensors.append((name, value))
        tensor_file.write(str(p / "engine.safetensors"), [t for t in tensors if t[1] is not None])
        resize(p, "engine.safetensors")
    return do


# (id, what is done to a copy of the pristine checkpoint, the words the ValueError must hold)
CHECKPOINT_CASES = [
    ("manifest-not-json", lambda p: (p / "checkpoint.json").write_bytes(b"{\x00garbage"),
     r"checkpoint\.json is not valid JSON"),
    ("manifest-deep", lambda p: (p / "checkpoint.json").write_bytes(b"[" * 100_000), r"checkpoint\.json nests too deeply"),
    ("manifest-list", lambda p: (p / "checkpoint.json").write_text("[1]"), r"checkpoint\.json is not a roundpipe"),
    ("manifest-huge-string", set_field("extra", value="x" * 3_000_000),
     r"checkpoint\.json: extra is 'xxx.*\(3000002 characters\); expected an object"),
    ("manifest-duplicate", lambda p: (p / "checkpoint.json").write_text(
        (p / "checkpoint.json").read_text().replace('"version": 1,', '"version": 1, "version": 1,')),
     r"checkpoint\.json is not valid JSON \(the key 'version' appears twice"),
    ("manifest-missing", lambda p: os.remove(p / "checkpoint.json"), r"checkpoint\.json is missing"),
    ("manifest-fifo", lambda p: (os.remove(p / "checkpoint.json"), os.mkfifo(p / "checkpoint.json")),
     r"checkpoint\.json is not a regular file"),
    ("manifest-link-outside", link_outside("checkpoint.json"), r"checkpoint\.json is a link to .*outside-checkpoint"
     r"\.json, outside the checkpoint folder"),
    ("files-not-object", set_field("files", value=["model.safetensors"]), r"checkpoint\.json: files is \["),
    ("files-negative-size", set_field("files", "model.safetensors", value=-1), r"files is .*expected an object of file"),
    ("files-missing-file", set_field("files", "gone.safetensors", value=0), r"gone\.safetensors is missing \(the "
     r"manifest lists it\)"),
    ("files-parent", set_field("files", "../c2/model.safetensors", value=10),
     r"lists the file '\.\./c2/model\.safetensors'; a checkpoint's files are plain names"),
    ("files-absolute", set_field("files", "/etc/passwd", value=10), r"lists the file '/etc/passwd'"),
    ("files-dotdot", set_field("files", "..", value=10), r"lists the file '\.\.'"),
    ("files-without-model", lambda p: edit_json(p, "checkpoint.json", lambda m: m["files"].pop("model.safetensors")),
     r"files does not list model\.safetensors"),
    ("file-link-outside", link_outside("model.safetensors"), r"model\.safetensors is a link to .*outside-model"),
    ("file-fifo", lambda p: (os.remove(p / "lr_scheduler.pt"), os.mkfifo(p / "lr_scheduler.pt")),
     r"lr_scheduler\.pt is not a regular file"),
    ("file-truncated", lambda p: (p / "engine.safetensors").write_bytes((p / "engine.safetensors").read_bytes()[:-4]),
     r"engine\.safetensors has \d+ bytes but the manifest says"),
    ("num-layers-string", set_field("num_layers", value="3"), r"checkpoint\.json: num_layers is '3'; expected an int"),
    ("calls-negative", set_field("calls", value=-5), r"checkpoint\.json: calls is -5; expected an integer >= 0"),
    ("field-missing", lambda p: edit_json(p, "checkpoint.json", lambda m: m.pop("grads_pending")),
     r"checkpoint\.json has no field 'grads_pending'"),
    ("bool-field", set_field("latest_asynchronous", value="yes"), r"latest_asynchronous is 'yes'; expected true"),
    ("step-kind", set_field("pending_step", "kind", value="explode"), r"pending_step\.kind is 'explode'"),
    ("step-window", set_field("pending_step", "window", value=-1), r"pending_step\.window is -1"),
    ("step-norm", set_field("pending_step", "max_grad_norm", value="big"), r"pending_step\.max_grad_norm is 'big'"),
    ("step-not-object", set_field("pending_step", value=[1]), r"pending_step is \[1\]; expected null or an object"),
    ("loss-scale", set_field("loss_scale", value={"history": {"x": [1, 2]}, "skipped": 0}), r"loss_scale is"),
    ("constants", set_field("constants", value={"a": {"layer": "0"}}), r"constants is"),
    ("grads-unscaled", set_field("grads_unscaled", value=[1.0]), r"grads_unscaled=\[1\.0\] must be a list of 3"),
    ("master-as-int8", cut_int8, r"model\.safetensors: tensor '0\.weight' has dtype torch\.int8 but the model's is "
     r"torch\.float32"),
    ("model-header-length", lambda p: (p / "model.safetensors").write_bytes(
        struct.pack("<Q", 2 ** 62) + (p / "model.safetensors").read_bytes()[8:]),
     r"model\.safetensors: the header length field says 4611686018427387904 bytes; at most"),
    ("model-shape-terabytes", lambda p: rewrite_tensors(p, "model.safetensors", lambda h: h["0.weight"].__setitem__(
        "shape", [TB, 1024])), r"model\.safetensors: tensor '0\.weight': data_offsets .* needs 4503599627370496"),
    ("model-offsets-past-end", lambda p: rewrite_tensors(p, "model.safetensors", lambda h: h["2.bias"].__setitem__(
        "data_offsets", [h["2.bias"]["data_offsets"][0] + 8, h["2.bias"]["data_offsets"][1] + 8])),
     r"model\.safetensors: tensor '2\.bias': data_offsets .* fall outside the data section"),
    ("model-dtype-unknown", lambda p: rewrite_tensors(p, "model.safetensors", lambda h: h["1.bias"].__setitem__(
        "dtype", "Q4")), r"model\.safetensors: tensor '1\.bias': unknown dtype 'Q4'"),
    ("aliases-not-json", lambda p: rewrite_tensors(p, "model.safetensors", lambda h: h["__metadata__"].__setitem__(
        "aliases", "{not json")), r"model\.safetensors: __metadata__\.aliases is '\{not json'"),
    ("aliases-untied", lambda p: rewrite_tensors(p, "model.safetensors", lambda h: h["__metadata__"].__setitem__(
        "aliases", json.dumps({"1.weight": "0.weight"}))),
     r"aliases stores '1\.weight' as '0\.weight', but in this model they are not one shared tensor"),
    ("rng-wrong-size", engine_tensor("rng.cpu", torch.zeros(100, dtype=torch.uint8)),
     r"engine\.safetensors: tensor 'rng\.cpu' has shape \[100\] but the CPU generator state's is \[5056\]"),
    ("rng-invalid", engine_tensor("rng.cpu", torch.zeros(5056, dtype=torch.uint8)),
     r"engine\.safetensors: tensor 'rng\.cpu' is not a CPU generator state"),
    ("rng-missing", engine_tensor("rng.cpu", None), r"engine\.safetensors: no tensor 'rng\.cpu'"),
    ("grad-float64", engine_tensor("step.0.weight", torch.zeros(4, 4, dtype=torch.float64)),
     r"engine\.safetensors: gradient 'step\.0\.weight' is torch\.float64 \[4, 4\]"),
    ("optimizer-not-zip", lambda p: ((p / "optimizer.pt").write_bytes(b"\x80\x04junk" * 10), resize(p, "optimizer.pt")),
     r"optimizer\.pt is not a torch\.save zip file"),
    ("optimizer-groups", saved_obj("optimizer.pt", {"param_groups": 5, "state": {}}),
     r"optimizer\.pt: param_groups or state is not of an optimizer's state_dict"),
    ("scheduler-deflated", zip_deflated, r"lr_scheduler\.pt: member .* is compressed"),
]


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_a_hostile_checkpoint_is_refused_and_the_model_is_left_as_it_was(tmp_path, pristine, case):
    """Each hand-written hostile checkpoint: load_checkpoint raises a ValueError naming the file and the
    field, and the model's state_dict, the optimizer's state and the CPU generator are as before."""
    _, change, words = case
    path = tmp_path / "c"
    shutil.copytree(pristine, path)
    change(path)
    with small_model() as model:
        opt = rp.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        rng = torch.get_rng_state()
        with pytest.raises(ValueError, match=words) as err:
            model.load_checkpoint(path, opt, sched)
        assert str(path) in str(err.value) and len(str(err.value)) < 700
        after = model.state_dict()
        assert all(torch.equal(v, before[k]) for k, v in after.items())
        assert opt.state_dict()["state"] == {} and torch.equal(torch.get_rng_state(), rng)
        model.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=F.mse_loss)   # still usable
        model.step(opt, asynchronous=False)


def test_the_pristine_checkpoint_loads(tmp_path, pristine):
    """The cases above start from a checkpoint that loads (so each refusal is the case's own doing)."""
    with small_model() as model:
        opt = rp.optim.AdamW(model.parameters())
        model.load_checkpoint(pristine, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))


def mutate_checkpoint(rnd, path):
    """One seeded mutation of a checkpoint: a manifest field set to a hostile value, or a file's bytes
    changed (its new size recorded in the manifest half of the time, so the files' own checks run)."""
    names = sorted(os.listdir(path))
    name = rnd.choice(names)
    if name == "checkpoint.json" and rnd.random() < 0.7:
        manifest = json.load(open(path / name))
        key = rnd.choice(sorted(manifest))
        target = manifest
        if isinstance(manifest[key], dict) and manifest[key] and rnd.random() < 0.5:
            target, key = manifest[key], rnd.choice(sorted(manifest[key]))
        target[key] = rnd.choice(HOSTILE_VALUES)
        json.dump(manifest, open(path / name, "w"))
        return
    good = (path / name).read_bytes()
    bad = mutate_file(rnd, good) if name.endswith(".safetensors") else bytearray(good)
    if not name.endswith(".safetensors"):
        for _ in range(rnd.randint(1, 3)):
            bad[rnd.randrange(len(bad))] = rnd.randrange(256)
    (path / name).write_bytes(bytes(bad))
    if name != "checkpoint.json" and rnd.random() < 0.5:
        resize(path, name)


def test_seeded_mutations_of_a_checkpoint_load_or_are_refused_leaving_the_model_as_it_was(tmp_path, pristine):
    """80 seeded mutations of a checkpoint's files and manifest fields: each load either succeeds or raises a
    ValueError naming a file of the checkpoint, with the model's state_dict unchanged; never another
    exception."""
    rnd = random.Random(2)
    refused = 0
    with small_model() as model:
        for i in range(80):
            path = tmp_path / f"c{i}"
            shutil.copytree(pristine, path)
            mutate_checkpoint(rnd, path)
            opt = rp.optim.AdamW(model.parameters())
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            model.synchronize()
            before = {k: v.clone() for k, v in model.state_dict().items()}
            try:
                model.load_checkpoint(path, opt, sched)
            except ValueError as e:
                refused += 1
                assert str(path) in str(e), (i, e)
                assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), i
            shutil.rmtree(path)
    assert refused > 40, refused


def test_a_bad_upload_file_is_refused_before_the_masters_change(tmp_path):
    """With staleness compensation the workers' predicted weights are saved too (upload.safetensors); a wrong
    entry there is refused before anything is restored, not after the masters were read."""
    kw = dict(compute_dtype=torch.bfloat16, compensation=rp.StalenessCompensation(predict=0.5))
    path = tmp_path / "c"
    train_and_save(path, **kw)
    rewrite_tensors(path, "upload.safetensors", lambda h: h["1.weight"].__setitem__("dtype", "F16"))
    with small_model(**kw) as model:
        opt = rp.optim.AdamW(model.parameters())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=r"upload\.safetensors: tensor '1\.weight' has dtype torch\.float16 but "
                                             r"the upload copy's is torch\.bfloat16"):
            model.load_checkpoint(path, opt)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("step", [torch.tensor(-2.84), torch.tensor(float("nan")), torch.tensor(2.5), "3"])
def test_a_damaged_optimizer_step_count_is_refused_at_load(tmp_path, pristine, step):
    """A byte flipped in optimizer.pt turned a parameter's Adam 'step' into -2.84 (the seeded mutations, 12th):
    the load took it and the pending step it re-issued failed at the next synchronize(), outside the load.
    Now the load refuses it, naming the file, and the model is left as it was."""
    path = tmp_path / "c"
    shutil.copytree(pristine, path)
    saved = torch.load(path / "optimizer.pt", weights_only=True)
    saved["state"][1]["step"] = step
    torch.save(saved, path / "optimizer.pt")
    resize(path, "optimizer.pt")   # the manifest's size of it: the file's own check runs
    with small_model() as model:
        opt = rp.optim.AdamW(model.parameters())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=r"optimizer\.pt: state 'step' of parameter 1 is .*expected a whole "
                                             r"number >= 0"):
            model.load_checkpoint(path, opt)
        model.synchronize()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
