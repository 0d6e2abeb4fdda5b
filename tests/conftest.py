"""Shared fixtures. Every test that starts processes tags them through the environment, and asserts afterwards that
no process carrying its tag (peers, their DHT and averager processes, p2pd daemons) is left running."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import tempfile
import time
import uuid

import pytest

TAG_VAR = "P2P_DILOCO_TEST_TAG"
HIVEMIND_SOCKET_DIR = "/tmp"  # hivemind 1.1.12 puts p2pd's control sockets there whatever TMPDIR says


@pytest.fixture(scope="session", autouse=True)
def suite_tmpdir():
    """One temporary folder for the processes the suite starts, removed at the end.

    Processes that a test kills on purpose (peers, their DHT and averager processes, torchrun workers) cannot remove
    their own temporary folders (multiprocessing's ``pymp-*``, torchrun's ``torchelastic_*``); with TMPDIR pointing
    here they leave them in this folder instead of in /tmp. The pytest process keeps its own temporary folder (it is
    cached before TMPDIR changes): it exits normally and removes what it made, after this fixture has run."""
    tempfile.gettempdir()  # fixes this process's folder before TMPDIR changes
    path = tempfile.mkdtemp(prefix="p2pt-")  # short: Unix socket paths under it stay well under 108
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TMPDIR", path)
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def tagged_pids(tag: str) -> list[int]:
    """PIDs of live processes whose environment carries ``TAG_VAR=tag`` (children inherit it, p2pd too)."""
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            pids.append(int(entry))
    return pids


@pytest.fixture
def process_tag(monkeypatch):
    """A unique tag set in this test's environment; at teardown, no tagged process may remain.

    Leftovers fail the test, and are then ended (by PID) so one failure does not poison later tests."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VAR, tag)
    with none_left(tag):
        yield tag


@pytest.fixture(scope="module")
def module_process_tag():
    """:func:`process_tag` for a module's shared fixture (e.g. one swarm that several tests look at)."""
    tag = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TAG_VAR, tag)
        with none_left(tag):
            yield tag


@contextlib.contextmanager
def none_left(tag: str):
    """On exit, wait briefly for processes tagged ``tag`` to end, end the leftovers by PID, remove the p2pd
    sockets they left, and fail if there were any (cleaning up also when the block raised)."""
    socks_before = hivemind_sockets()
    try:
        yield
    finally:
        described = _end_leftovers(tag, socks_before)
    assert not described, f"processes left running: {described}"


def _end_leftovers(tag: str, socks_before: set[str]) -> dict[int, str]:
    deadline = time.monotonic() + 5  # daemons told to stop may take a moment to exit
    while (leftovers := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    described = {pid: _cmdline(pid) for pid in leftovers}
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # p2pd's control sockets of processes that were killed hard stay behind: remove the new ones that nobody has
    # bound any more (another test run, on this machine at the same time, may be using its own)
    for sock in sockets_left(socks_before):
        try:
            os.unlink(sock)
        except OSError:
            pass
    return described


def hivemind_sockets() -> set[str]:
    """The p2pd daemon and client sockets in hivemind's folder now."""
    return set(glob.glob(os.path.join(HIVEMIND_SOCKET_DIR, "hivemind-*.sock")))


def sockets_left(before: set[str]) -> set[str]:
    """Sockets that appeared since ``before`` and that no live process has bound (left behind)."""
    return hivemind_sockets() - before - bound_unix_paths()


def bound_unix_paths() -> set[str]:
    """Paths of every Unix socket bound by a live process, in every network namespace on this machine.

    /proc/PID/net/unix lists the sockets of PID's network namespace, so one process per namespace is read."""
    paths, seen = set(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            netns = os.readlink(f"/proc/{entry}/ns/net")
            if netns in seen:
                continue
            with open(f"/proc/{entry}/net/unix") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        seen.add(netns)
        paths.update(line.split()[7] for line in lines if len(line.split()) >= 8)
    return paths


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer (GPT-2's kind) trained here on a few sentences and saved with save_pretrained to
    a local folder: the Hugging Face tokenizer path, offline. Returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [f"document {i}: the quick brown fox jumps over the lazy dog, naïve café {i * 7919 % 1000}"
             for i in range(300)]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(str(folder))
    return str(folder)


def identities(folder, names) -> dict[str, str]:
    """An identity file per name, the smallest peer id to the first name, then in order: the round's designated
    leader (net/consensus.py designated_leader) is the smallest id among the peers at its round."""
    from hivemind.p2p import P2P, PeerID

    made = []
    for i in range(len(names)):
        path = os.path.join(str(folder), f"identity{i}.key")
        P2P.generate_identity(path)
        with open(path, "rb") as f:
            made.append((PeerID.from_identity(f.read()).to_base58(), path))
    return {name: path for name, (_, path) in zip(names, sorted(made))}
