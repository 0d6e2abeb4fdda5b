"""The pure modules (math, rules, codecs, keys) import no hivemind: they are tested against references on their own
and can be read without the swarm (house style: one seam talks to the swarm)."""

import subprocess
import sys

import pytest

# net/security/identity.py is not here: it encodes keys and PeerIDs with hivemind's own crypto_pb2 and PeerID
PURE = ["p2p_diloco.train.outer", "p2p_diloco.train.dylu", "p2p_diloco.train.overlap", "p2p_diloco.net.consensus",
        "p2p_diloco.net.deadlines", "p2p_diloco.net.reachability", "p2p_diloco.net.security.access",
        "p2p_diloco.net.averaging.codecs", "p2p_diloco.net.averaging.aggregators",
        "p2p_diloco.net.averaging.screening", "p2p_diloco.net.averaging.reducer_checks",
        "p2p_diloco.net.averaging.contribution"]


@pytest.mark.timeout(60)
def test_pure_modules_import_no_hivemind():
    code = ("import importlib, sys\n"
            f"for name in {PURE!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert 'hivemind' not in sys.modules, f'{name} imports hivemind'\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
