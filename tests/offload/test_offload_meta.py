"""optimizer_offload.json read as strictly as the checkpoint's own files: seeded mutations of a valid one load as
the file says or are refused with a ValueError naming it, and a refused load leaves the model as it was."""
import copy
import json
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp

pytest.importorskip("roundpipe._C")

WIDTH = 80   # 6400-element weights take AdamW8bit's 8-bit path (codes and absmax slices), the biases fp32
HOSTILE = [-1, 2 ** 63, 1e300, "manual_seed", "float32", None, True, [], {}, [[0, []]], "x" * 10_000, 0, 3]


def make(tmp_path, name):
    torch.manual_seed(0)
    return rp.RoundPipe([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)], devices=["cpu"],
                        num_microbatches=2, offload_dir=tmp_path / name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of two AdamW8bit steps with every layer's state on disk, and its optimizer_offload.json."""
    tmp = tmp_path_factory.mktemp("meta")
    with make(tmp, "run") as model:
        opt = rp.optim.AdamW8bit(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            model.forward_backward(torch.randn(4, WIDTH, generator=g), labels=torch.randn(4, WIDTH, generator=g),
                                   loss_fn=F.mse_loss)
            model.step(opt)
        model.save_checkpoint(tmp / "ckpt", opt)
    return tmp / "ckpt", json.loads((tmp / "ckpt" / "optimizer_offload.json").read_text())


def paths(value, at=()):
    """Every place in a JSON value: (path, value) of each object entry and list item, depth first."""
    yield at, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield from paths(v, at + (k,))


def mutate(meta, rng):
    """One seeded change: a value replaced by a hostile one, an object key dropped or a list item removed."""
    meta = copy.deepcopy(meta)
    places = [p for p, _ in paths(meta) if p]
    where = rng.choice(places)
    parent = meta
    for k in where[:-1]:
        parent = parent[k]
    if rng.random() < 0.2:
        del parent[where[-1]]
    else:
        parent[where[-1]] = rng.choice(HOSTILE)
    return meta


def write(ckpt, meta) -> None:
    """optimizer_offload.json as given, and the manifest's size for it to match (a consistent hostile checkpoint:
    the manifest's size check would otherwise refuse every change before the layout is read)."""
    raw = json.dumps(meta)
    (ckpt / "optimizer_offload.json").write_text(raw)
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["files"]["optimizer_offload.json"] = len(raw.encode())
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


def test_seeded_mutations_load_or_are_refused_naming_the_file(tmp_path, saved):
    """60 seeded mutations (a negative, huge or wrong-typed value, a dtype name that is a torch function, a
    dropped key or item): each is refused with a ValueError naming optimizer_offload.json and leaves the
    masters and the optimizer's state as they were, or (a change the layout does not depend on) loads.  Before,
    some raised KeyError, TypeError or IndexError, or read through getattr(torch, dtype)."""
    ckpt, meta = saved
    rng = random.Random(20261207)
    refused = 0
    with make(tmp_path, "load") as model:
        opt = rp.optim.AdamW8bit(model.parameters(), lr=1e-2)
        try:
            for _ in range(60):
                bad = mutate(meta, rng)
                write(ckpt, bad)
                before = [p.detach().clone() for p in model.parameters()]
                state = copy.deepcopy(opt.state_dict()["state"])
                try:
                    model.load_checkpoint(ckpt, opt)
                except ValueError as e:
                    assert "optimizer_offload.json" in str(e), (bad, str(e))
                    refused += 1
                    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
                    assert opt.state_dict()["state"].keys() == state.keys()
        finally:
            write(ckpt, meta)
    assert refused >= 40, refused
