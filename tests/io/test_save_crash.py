"""A save over an existing checkpoint never destroys it (invariant 10). `qshard.save` is killed
(SIGKILL) just before each of its filesystem operations in turn, or fails on one (ENOSPC), for
every transition between no checkpoint, one file and shards: the directory then loads as the old
checkpoint or the new one, bit for bit, never an error or a mix, and the next save cleans up."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from filesystem_steps import step_hooks
from torch import nn

import qshard
from qshard import CheckpointError
from qshard.io import saving as save_module
from qshard.io.checkpoint import checkpoint_files

# Three int4 Linear(64, 64) layers of about 2.6-2.8 kB each (bias included).
ONE_FILE, THREE_SHARDS, TWO_SHARDS = "5GB", 3000, 6000
CONFIG = "quantization_config.json"
# Files that are not qshard's, some named like its temporary files: no save may touch them.
USER_FILES = {
    "notes.txt": b"mine",
    ".notes.txt.1-0123abcd.tmp": b"mine",
    ".model.safetensors.tmp": b"mine",
    "model.safetensors.1-0123abcd.tmp": b"mine",
}
LEFTOVER = ".model.safetensors.1-0123abcd.tmp"  # as a killed save leaves it


def make_state(seed: int, group_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=group_size))
    return model.state_dict()


def fingerprint(state: dict[str, torch.Tensor]) -> dict:
    """Every stored byte, dtype, shape and attribute: equal fingerprints are equal states."""

    def raw(t):
        return str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).tolist()

    out = {}
    for key, value in state.items():
        if isinstance(value, qshard.QTensor):
            out[key] = (type(value).__name__, str(value.dtype), repr(value.attrs()))
            out |= {f"{key}.{n}": raw(t) for n, t in value.inner_tensors().items()}
        else:
            out[key] = raw(value)
    return out


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch):
    """fsync is for power loss; after a SIGKILL the kernel still has every write. Skipped (its
    calls still counted as steps), it takes these tests from ~40 ms a save to ~8."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.fixture(scope="module")
def states():
    return {"old": make_state(0, group_size=32), "new": make_state(1, group_size=64)}


# ---- the kill test --------------------------------------------------------------------------

# One process that imports torch once and forks a child per kill point; the child saves with
# every filesystem operation hooked, and SIGKILLs itself just before the step-th one.
SAVER = r"""
import json, os, signal, sys, traceback
import torch
torch.set_num_threads(1)  # no intra-op thread pool to carry across fork
import qshard
sys.path.insert(0, sys.argv[2])
from filesystem_steps import step_hooks

STATES = torch.load(sys.argv[1], weights_only=True)

def kill_before(step):
    count = 0
    def tick():
        nonlocal count
        if count == step:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no handler, no finally, no flush
        count += 1
    for module, name, replacement in step_hooks(tick):
        setattr(module, name, replacement)
    os.fsync = lambda fd: tick()  # a step, but skipped: see no_fsync

while line := sys.stdin.readline():
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(60)  # a hung save fails the test instead of blocking it
            kill_before(job["step"])
            qshard.save(STATES[job["state"]], job["directory"], max_shard_size=job["size"])
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print("killed" if killed else f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
"""


class Saver:
    def __init__(self, states_file: pathlib.Path):
        here = str(pathlib.Path(__file__).parent)  # filesystem_steps, for the child
        command = [sys.executable, "-c", SAVER, str(states_file), here]
        pipe = subprocess.PIPE
        self.process = subprocess.Popen(command, stdin=pipe, stdout=pipe, text=True)

    def save(self, state: str, directory: pathlib.Path, size, step: int) -> bool:
        """Whether the save ran to its end (else it was killed before operation `step`)."""
        job = {"state": state, "directory": str(directory), "size": size, "step": step}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        outcome = self.process.stdout.readline().strip()
        assert outcome in ("killed", "exit 0"), f"the save process: {outcome!r} (stderr above)"
        return outcome == "exit 0"

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def saver(states, tmp_path_factory):
    states_file = tmp_path_factory.mktemp("saver") / "states.pt"
    torch.save(states, states_file)
    saver = Saver(states_file)
    yield saver
    saver.close()


def loads_as(directory: pathlib.Path, expected: dict) -> str:
    """Whether the directory loads as "old", "new", or "none" (a CheckpointError: only where
    there was no checkpoint)."""
    try:
        state = qshard.load(directory)
    except CheckpointError:
        if expected["old"] is None:
            return "none"
        raise
    found = fingerprint(state)
    matches = [name for name, print_ in expected.items() if print_ == found]
    assert matches, f"{directory} loads as neither the old nor the new checkpoint"
    return matches[0]


def assert_clean(directory: pathlib.Path, user_files) -> None:
    """Only the checkpoint's files, its quantization_config.json and the user's files."""
    files, weight_map = checkpoint_files(directory)
    ours = {f.name for f in files} | {CONFIG} | ({save_module.INDEX_NAME} if weight_map else set())
    assert sorted(os.listdir(directory)) == sorted(ours | set(user_files))


def config_text(directory: pathlib.Path) -> str | None:
    path = directory / CONFIG
    return path.read_text() if path.exists() else None


# name: (the old state's saves, each a max_shard_size or a new name for its model.safetensors;
# the new save's max_shard_size)
TRANSITIONS = {
    "new-dir->one-file": ((), ONE_FILE),
    "new-dir->sharded": ((), THREE_SHARDS),
    "one-file->one-file": ((ONE_FILE,), ONE_FILE),
    "one-file->sharded": ((ONE_FILE,), THREE_SHARDS),
    "sharded->one-file": ((THREE_SHARDS,), ONE_FILE),
    "sharded->sharded-same-count": ((THREE_SHARDS,), THREE_SHARDS),
    "sharded->sharded-other-count": ((THREE_SHARDS,), TWO_SHARDS),
    # saved twice: the second save's shards carry its save id, the new ones the plain names
    "id-named-shards->sharded": ((THREE_SHARDS, THREE_SHARDS), THREE_SHARDS),
    # one file under another name, which loads as the directory's only .safetensors file
    "lone-other-file->sharded": ((ONE_FILE, "weights.safetensors"), THREE_SHARDS),
}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a process per kill point")
@pytest.mark.parametrize(("old_saves", "new_size"), TRANSITIONS.values(), ids=TRANSITIONS)
def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_checkpoint(
    saver, states, tmp_path, old_saves, new_size
):
    pristine, work = tmp_path / "pristine", tmp_path / "work"
    pristine.mkdir()
    old, directory = pristine / "checkpoint", work / "checkpoint"
    user_files = dict(USER_FILES) if old_saves else {}
    if old_saves:  # else the save creates the directory
        for size in old_saves:
            if isinstance(size, str) and size.endswith(".safetensors"):  # rename the file
                (old / "model.safetensors").rename(old / size)
                user_files[size] = (old / size).read_bytes()  # not a name of qshard's
            else:
                qshard.save(states["old"], old, max_shard_size=size)
        for name, data in {**USER_FILES, LEFTOVER: b"partial"}.items():
            (old / name).write_bytes(data)
    expected = {"old": None, "new": fingerprint(states["new"])}
    old_config = None
    if old_saves:
        expected["old"] = fingerprint(qshard.load(old))
        assert expected["old"] == fingerprint(states["old"])
        old_config = config_text(old)
    seen = []
    for step in itertools.count():
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        finished = saver.save("new", directory, new_size, step)
        seen.append(loads_as(directory, expected))
        if seen[-1] != "new":  # the config is replaced only after the commit
            assert config_text(directory) == old_config
        for name, data in user_files.items():
            assert (directory / name).read_bytes() == data
        if finished:
            break
        # The next save, after the kill, completes and leaves no temporary or stale file.
        qshard.save(states["new"], directory, max_shard_size=new_size)
        assert loads_as(directory, expected) == "new"
        assert_clean(directory, user_files)
    assert_clean(directory, user_files)
    config = json.loads(config_text(directory))["config_groups"]["group_0"]["config"]
    assert config["group_size"] == 64  # the new save's
    # The old checkpoint (or none) until one step, the new one from that step on.
    commit = seen.index("new")
    assert commit > 0 and set(seen[:commit]) == {"old" if old_saves else "none"}
    assert set(seen[commit:]) == {"new"}, seen


# ---- failures ------------------------------------------------------------------------------


def _no_space():
    return OSError(errno.ENOSPC, "No space left on device (injected)")


@contextlib.contextmanager
def failing_at(step: int, error=_no_space):
    """Every filesystem operation of the save counted; the step-th raises `error()` (ENOSPC by
    default). Yields a list that holds the number of operations so far."""
    count = [0]

    def tick():
        count[0] += 1
        if count[0] - 1 == step:
            raise error()

    with pytest.MonkeyPatch.context() as patch:
        for module, name, replacement in step_hooks(tick):
            patch.setattr(module, name, replacement)
        yield count


def snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


OLD_LAYOUTS = {"one-file": (ONE_FILE,), "sharded": (THREE_SHARDS,)}


@pytest.mark.parametrize("new_size", [ONE_FILE, THREE_SHARDS, TWO_SHARDS])
@pytest.mark.parametrize("old_sizes", OLD_LAYOUTS.values(), ids=OLD_LAYOUTS)
def test_an_error_at_any_step_leaves_the_old_checkpoint_or_commits_the_new(
    states, tmp_path, old_sizes, new_size
):
    directory = tmp_path / "checkpoint"
    for size in old_sizes:
        qshard.save(states["old"], directory, max_shard_size=size)
    (directory / "notes.txt").write_text("mine")
    before = snapshot(directory)
    expected = {"old": fingerprint(states["old"]), "new": fingerprint(states["new"])}
    outcomes = []
    for step in itertools.count():
        with contextlib.suppress(OSError), failing_at(step) as count:
            qshard.save(states["new"], directory, max_shard_size=new_size)
        if count[0] <= step:  # ran to its end without reaching the failing step
            break
        # (an error from mkdir is ignored, as the directory exists: the save runs to its end)
        outcomes.append(loads_as(directory, expected))
        if outcomes[-1] == "old":  # and not one file more or less
            assert snapshot(directory) == before
        else:  # failed after the commit (deleting a stale file): the next save tidies up
            assert not [name for name in os.listdir(directory) if name.endswith(".tmp")]
            qshard.save(states["new"], directory, max_shard_size=new_size)
            assert_clean(directory, {"notes.txt"})
        shutil.rmtree(directory)
        directory.mkdir()
        for name, data in before.items():
            (directory / name).write_bytes(data)
    assert loads_as(directory, expected) == "new"
    assert_clean(directory, {"notes.txt"})
    assert "old" in outcomes


@pytest.mark.parametrize("new_size", [ONE_FILE, THREE_SHARDS])
def test_an_interrupt_at_any_step_leaves_no_temporary_file(states, tmp_path, new_size):
    """Ctrl-C (KeyboardInterrupt) at any filesystem step of a save: the old or the new
    checkpoint loads, and none of the save's temporary files is left (`qshard quantize`
    interrupted while saving left one in some runs)."""
    directory = tmp_path / "checkpoint"
    qshard.save(states["old"], directory, max_shard_size=THREE_SHARDS)
    before = snapshot(directory)
    expected = {"old": fingerprint(states["old"]), "new": fingerprint(states["new"])}
    for step in itertools.count():
        with contextlib.suppress(KeyboardInterrupt), failing_at(step, KeyboardInterrupt) as count:
            qshard.save(states["new"], directory, max_shard_size=new_size)
        if count[0] <= step:
            break
        assert not [n for n in os.listdir(directory) if n.endswith(".tmp")], (
            step,
            os.listdir(directory),
        )
        assert loads_as(directory, expected) in ("old", "new")
        shutil.rmtree(directory)
        directory.mkdir()
        for name, data in before.items():
            (directory / name).write_bytes(data)
    assert step > 5


@pytest.mark.parametrize("new_size", [ONE_FILE, THREE_SHARDS])
@pytest.mark.parametrize("old_sizes", [(), *OLD_LAYOUTS.values()], ids=["none", *OLD_LAYOUTS])
def test_no_space_on_the_second_file_leaves_the_old_checkpoint(
    states, tmp_path, monkeypatch, old_sizes, new_size
):
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    for size in old_sizes:
        qshard.save(states["old"], directory, max_shard_size=size)
    before = snapshot(directory)
    real, calls = save_module._write_safetensors, []
    failing = 1 if new_size == ONE_FILE else 2  # the second shard, or the one file

    def disk_full(tensors, metadata, f):
        calls.append(None)
        real(tensors, metadata, f)
        if len(calls) == failing:
            f.truncate(f.tell() // 2)
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_module, "_write_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        qshard.save(states["new"], directory, max_shard_size=new_size)
    assert snapshot(directory) == before  # no partial or new file left
    if old_sizes:
        assert fingerprint(qshard.load(directory)) == fingerprint(states["old"])


# ---- names and leftovers -------------------------------------------------------------------


def test_the_next_save_deletes_what_killed_saves_left_and_nothing_else(states, tmp_path):
    directory = tmp_path / "checkpoint"
    qshard.save(states["old"], directory, max_shard_size=THREE_SHARDS)
    leftovers = [  # temporary files of killed saves, and shards no index lists
        ".model.safetensors.12-0123abcd.tmp",
        ".model-00002-of-00003.safetensors.7-89abcdef.tmp",
        ".model-00001-of-00003-0123456789abcdef.safetensors.7-89abcdef.tmp",
        ".model.safetensors.index.json.345-deadbeef.tmp",
        ".quantization_config.json.9-00000000.tmp",
        "model-00002-of-00005.safetensors",
        "model-00001-of-00003-0123456789abcdef.safetensors",
    ]
    others = [  # not qshard's names or not its patterns
        ".notes.txt.1-0123abcd.tmp",
        ".model.safetensors.tmp",
        ".model.safetensors.x-0123abcd.tmp",
        ".model.safetensors.1-0123ABCD.tmp",
        "model.safetensors.1-0123abcd.tmp",
        ".weights.safetensors.1-0123abcd.tmp",
        "weights.bin",
    ]
    for name in leftovers + others:
        (directory / name).write_bytes(b"x")
    (directory / ".model.safetensors.5-0123abcd.tmp").mkdir()  # a directory: left alone
    qshard.save(states["new"], directory, max_shard_size=TWO_SHARDS)
    assert fingerprint(qshard.load(directory)) == fingerprint(states["new"])
    assert_clean(directory, [*others, ".model.safetensors.5-0123abcd.tmp"])


def test_shards_take_fresh_names_while_the_index_lists_the_plain_ones(states, tmp_path):
    names = []
    for state in ("old", "new", "old"):
        written = qshard.save(states[state], tmp_path, max_shard_size=THREE_SHARDS)
        names.append([p.name for p in written[:3]])
        assert fingerprint(qshard.load(tmp_path)) == fingerprint(states[state])
        assert_clean(tmp_path, [])
    plain = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert names[0] == names[2] == plain
    save_id = names[1][0].removeprefix("model-00001-of-00003-").removesuffix(".safetensors")
    assert len(save_id) == 16 and names[1] == [n.replace(".s", f"-{save_id}.s") for n in plain]
    assert all(save_module.SHARD_NAME.fullmatch(n) for n in names[1])
    written = qshard.save(states["new"], tmp_path, max_shard_size=TWO_SHARDS)
    assert [p.name for p in written[:2]] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_an_index_that_lists_model_safetensors_stays_loadable(states, tmp_path):
    """A foreign index naming the one-file name: the new save writes one shard and an index
    rather than replace a file the old checkpoint reads before the commit."""
    qshard.save(states["old"], tmp_path)
    with open(tmp_path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    weight_map = {key: "model.safetensors" for key in header if key != "__metadata__"}
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / save_module.INDEX_NAME).write_text(json.dumps(index))
    assert fingerprint(qshard.load(tmp_path)) == fingerprint(states["old"])
    written = qshard.save(states["new"], tmp_path)
    assert written[0].name == "model-00001-of-00001.safetensors"
    assert fingerprint(qshard.load(tmp_path)) == fingerprint(states["new"])
    assert_clean(tmp_path, [])
