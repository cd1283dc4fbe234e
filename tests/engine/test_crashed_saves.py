"""Saves killed mid-way: the checkpoint stays whole and their temporary folders go (roundpipe/engine/state/save_folders.py)."""
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch

import roundpipe as rp
from roundpipe.engine.state import save_folders

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, SIGKILL and os.kill(pid, 0)")

TRIALS = 20
FILES = {"checkpoint.json", "model.safetensors", "engine.safetensors"}

# One process imports torch and roundpipe once (2-4 s) and forks a saver per trial: each builds the
# model and saves states filled with base+1, base+2, ... until the test kills it with SIGKILL.
_ZYGOTE = r'''
import os, sys, traceback
import torch
import roundpipe as rp
import roundpipe.engine.model  # noqa: F401 - everything imported before forking
def say(*words):   # one write(2) a line: a saver killed between print's text and its newline left "saved 87004"
    os.write(1, (" ".join(map(str, words)) + "\n").encode())   # unended, and the zygote's next line joined it
say("ready")
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "trial":
        if os.fork() == 0:
            try:
                model = rp.RoundPipe([torch.nn.Linear(8, 8) for _ in range(3)], devices=["cpu"] * 2)
                shapes = {n: v.shape for n, v in model.state_dict().items()}
                say("built", os.getpid())
                for k in range(1, 10000):
                    value = int(cmd[2]) + k
                    model.load_state_dict({n: torch.full(s, float(value)) for n, s in shapes.items()})
                    say("saving", value)
                    model.save_checkpoint(cmd[1])
                    say("saved", value)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
    elif cmd[0] == "reap":
        _, status = os.waitpid(int(cmd[1]), 0)
        say("reaped", cmd[1], status)
'''


class Zygote:
    def __init__(self, err_path):
        self.err_path, self.err = err_path, open(err_path, "w")
        # no OpenMP pool in the forking process: a child of a process whose pool ran can hang in its own
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, bufsize=1, env=env)
        self.lines = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(l.split()) for l in self.proc.stdout], daemon=True).start()

    def until(self, word, seen=None):
        """Reads lines up to the first that starts with `word` and returns it; all of them into `seen`."""
        while True:
            try:
                line = self.lines.get(timeout=120)
            except queue.Empty:
                raise AssertionError(f"no {word!r} line in 120 s; stderr: {open(self.err_path).read()[-3000:]}") from None
            if seen is not None:
                seen.append(line)
            if line[0] == word:
                return line

    def send(self, *words):
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.err.close()


def model():
    return rp.RoundPipe([torch.nn.Linear(8, 8) for _ in range(3)], devices=["cpu"] * 2)


def fill(m, value):
    m.load_state_dict({n: torch.full_like(v, float(value)) for n, v in m.state_dict().items()})


def the_value(m):
    """The one number every tensor of the model is filled with."""
    sd = m.state_dict()
    value = float(next(iter(sd.values())).reshape(-1)[0])
    assert all(torch.equal(v, torch.full_like(v, value)) for v in sd.values()), sd
    return int(value)


def leftovers(parent, name="c"):
    """Everything beside the checkpoint and inside it that a checkpoint does not hold."""
    beside = sorted(set(os.listdir(parent)) - {name, "zygote.err"})
    folder = os.path.join(parent, name)   # missing after a save killed between its two renames
    inside = sorted(set(os.listdir(folder)) - FILES) if os.path.isdir(folder) else []
    return beside + [f"{name}/{n}" for n in inside]


def test_saves_killed_at_random_points_leave_a_whole_checkpoint_and_no_temporary(tmp_path):
    """20 savers killed by SIGKILL at seeded random points of a save loop (states filled with distinct
    numbers): each time the checkpoint loads and holds a state that was saved, no older than the last save
    that returned, and after the test process's next save nothing but the checkpoint is left."""
    rnd = random.Random(0)
    path = str(tmp_path / "c")
    zygote = Zygote(tmp_path / "zygote.err")
    try:
        zygote.until("ready")
        with model() as m:
            fill(m, 0)
            m.save_checkpoint(path)
            current, interrupted = 0, 0
            for trial in range(TRIALS):
                base = 1000 * (trial + 1)
                zygote.send("trial", path, base)
                pid = int(zygote.until("built")[1])
                seen = []
                for _ in range(rnd.randint(1, 4)):   # into the save of a random step, at a random moment of it
                    zygote.until("saving", seen)
                threading.Event().wait(rnd.uniform(0, 0.03))
                os.kill(pid, signal.SIGKILL)
                zygote.send("reap", pid)
                status = int(zygote.until("reaped", seen)[2])
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, open(tmp_path / "zygote.err").read()
                started = [int(l[1]) for l in seen if l[0] == "saving"]
                returned = [int(l[1]) for l in seen if l[0] == "saved"]
                interrupted += bool(leftovers(tmp_path))
                m.load_checkpoint(path)
                got = the_value(m)
                assert got in [current] + started, (trial, got, started)
                assert not returned or got >= returned[-1], (trial, got, returned)
                assert leftovers(tmp_path) == []   # load_checkpoint removed the dead saver's folder
                current = base
                fill(m, current)
                m.save_checkpoint(path)
                assert leftovers(tmp_path) == []
            print(f"{interrupted} of {TRIALS} savers were killed with a temporary folder in place")
            assert interrupted > 0   # the kills did land inside saves
    finally:
        zygote.close()


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def owned(folder, pid, host=None):
    os.makedirs(folder)
    with open(os.path.join(folder, save_folders.OWNER), "w") as f:
        json.dump({"host": host or socket.gethostname(), "pid": pid}, f)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(b"partial")
    return folder


def test_only_dead_writers_folders_of_this_checkpoint_are_removed(tmp_path):
    """Beside checkpoint c: the folders of a dead writer (by its owner file, or by the pid in the name when
    it died before writing one) go, at the next load and at the next save; a live writer's (this process),
    another host's, a data-parallel one without an owner, other names, a link to a folder elsewhere and that
    folder's files stay."""
    dead, dead2, mine = dead_pid(), dead_pid(), os.getpid()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    base = tmp_path / "ck"
    base.mkdir()
    with model() as m:
        fill(m, 5)
        m.save_checkpoint(base / "c")
        gone = [owned(base / f".c.tmp-{dead}", dead), str(base / f".c.tmp-{dead2}"), owned(base / ".c.tmp", dead)]
        os.makedirs(gone[1])   # killed before it wrote its owner file
        kept = [owned(base / f".c.tmp-{mine}", mine),
                owned(base / f".c.tmp-{dead * 10 + 2}", dead * 10 + 2, host="elsewhere"),
                owned(base / f".c.tmp-{dead2}0", dead), str(base / ".c.tmp.x"), str(base / f".d.tmp-{dead}"),
                str(base / f".c.tmp-{dead}x"), str(base / ".c.tmp-0"), str(base / f"c.tmp-{dead}"),
                str(base / f".c.old-{dead}"), str(base / ".d.tmp")]
        for folder in kept[3:]:
            os.makedirs(folder)
        os.symlink(elsewhere, base / f".c.tmp-{dead * 10 + 1}")
        m.load_checkpoint(base / "c")
        assert [g for g in gone if os.path.exists(g)] == []
        assert [k for k in kept if not os.path.isdir(k)] == []
        assert os.path.islink(base / f".c.tmp-{dead * 10 + 1}") and (elsewhere / "keep").read_text() == "x"
        owned(base / f".c.tmp-{dead}", dead)
        m.save_checkpoint(base / "c")
        assert not os.path.exists(base / f".c.tmp-{dead}") and the_value(m) == 5
        assert sorted(os.listdir(base / "c")) == sorted(FILES)


def test_a_save_killed_between_its_renames_is_rolled_back_by_the_next_load(tmp_path):
    """Killed after moving the old checkpoint into its folder and before moving its folder into place:
    load_checkpoint puts the old one back and loads it; killed after that, the old one left inside the new
    checkpoint (and the owner file) go."""
    dead = dead_pid()
    path = tmp_path / "c"
    with model() as m:
        fill(m, 3)
        m.save_checkpoint(path)
        tmp = owned(tmp_path / f".c.tmp-{dead}", dead)
        os.rename(path, os.path.join(tmp, save_folders.REPLACED))
        fill(m, 4)
        m.load_checkpoint(path)
        assert the_value(m) == 3 and leftovers(tmp_path) == []
        # killed after the second rename: .replaced and .writer.json inside the new checkpoint
        m.save_checkpoint(tmp_path / "old")
        os.rename(tmp_path / "old", path / save_folders.REPLACED)
        with open(path / save_folders.OWNER, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": dead}, f)
        m.load_checkpoint(path)
        assert leftovers(tmp_path) == []
        # the same leftovers of a live writer (this process, about to remove them itself) stay
        os.makedirs(path / save_folders.REPLACED)
        with open(path / save_folders.OWNER, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
        m.load_checkpoint(path)
        assert leftovers(tmp_path) == ["c/" + save_folders.REPLACED, "c/" + save_folders.OWNER]
