"""Which published run settings a joiner takes (issue 24, finding 4): the pure rules of net/run_settings.py. Anyone
can publish settings under the run's key, as many entries as it holds keys; a joiner given the run's spec hash takes
only the spec of that hash, and one without it never takes local paths, a checkpoint to load, weaker defences or
sizes and rates above the limits from the DHT."""

from __future__ import annotations

import pytest

from p2p_diloco.config import ConfigError, load_config, shared_settings
from p2p_diloco.net.run_settings import (LIMITS, WEAKER, adopt_settings, choose_settings, refusals, run_fingerprint,
                                         spec_hash)

RUN = {"model.seq_len": "32", "diloco.inner_steps": "8", "run.run_id": "spec-run", "inner.lr": "1e-3"}
JOINER = {"run.run_id": "spec-run", "network.initial_peers": "/ip4/127.0.0.1/tcp/1"}
GIVEN = {"run.run_id", "network.initial_peers"}  # what a joiner with only the run id sets


def _run() -> dict:
    return shared_settings(load_config(overrides=RUN))


def _entries(*specs) -> list[dict]:
    return [{"settings": dict(s), "fingerprint": "f"} for s in specs]


def _taken(run: dict, **joiner) -> list[str]:
    """What a joiner with only the run id (and ``joiner`` overrides) would refuse to take from ``run``."""
    cfg = load_config(overrides={**JOINER, **joiner})
    adopted, changed = adopt_settings(cfg, run)
    return refusals(cfg, adopted, changed)


@pytest.mark.timeout(30)
def test_the_spec_hash_covers_every_run_setting_and_nothing_else():
    run = _run()
    assert len(spec_hash(run)) == 16 and spec_hash(run) == spec_hash(dict(reversed(list(run.items()))))
    for key, value in (("data.dataset", "stdlib"), ("inner.lr", 2e-3), ("averaging.verify_parts", False),
                       ("run.run_id", "other")):
        assert spec_hash({**run, key: value}) != spec_hash(run), key
    cfg = load_config(overrides=RUN)
    machine = load_config(overrides={**RUN, "run.threads": "1", "inner.batch_size": "2", "run.name": "x"})
    assert spec_hash(shared_settings(machine)) == spec_hash(run)  # machine settings are each machine's own
    # the run's DHT prefix: the same setup fingerprint, another spec -> another prefix (no averaging together)
    other = load_config(overrides={**RUN, "data.dataset": "stdlib"})
    assert run_fingerprint("setup", cfg) == run_fingerprint("setup", machine) != run_fingerprint("setup", other)
    assert run_fingerprint("setup", cfg) != run_fingerprint("other-model", cfg)


@pytest.mark.timeout(30)
def test_a_joiner_with_the_spec_hash_takes_only_that_spec_whatever_the_votes():
    run = _run()
    sybil = {**run, "data.dataset": "/home/victim/.ssh", "model.seq_len": 2 ** 20, "inner.lr": 400.0}
    published = _entries(sybil, sybil, sybil, run, sybil)
    joiner = load_config(overrides={**JOINER, "run.spec_hash": spec_hash(run)})
    assert choose_settings(joiner, published, GIVEN) == run
    assert choose_settings(joiner, _entries(sybil, sybil), GIVEN) is None  # not there: wait for it, never the votes
    plain = load_config(overrides=JOINER)
    assert choose_settings(plain, published, GIVEN) == sybil  # without the hash the majority is a candidate...
    assert any(r.startswith("data.dataset=/home/victim/.ssh (a local path)") for r in _taken(sybil))  # ...refused


@pytest.mark.timeout(30)
def test_a_peer_that_set_run_settings_follows_the_entries_that_agree_with_them():
    run = _run()
    sybil = {**run, "inner.lr": 5e-3}
    mine = load_config(overrides={**JOINER, "inner.lr": "1e-3"})
    assert choose_settings(mine, _entries(sybil, sybil, sybil, run), GIVEN | {"inner.lr"}) == run
    # no entry agrees: the majority's, and first_difference (in settle) refuses it naming inner.lr
    assert choose_settings(mine, _entries(sybil, sybil), GIVEN | {"inner.lr"}) == sybil


@pytest.mark.timeout(30)
def test_paths_checkpoints_and_config_files_are_never_taken_from_the_dht(tmp_path, monkeypatch):
    run = _run()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "data").write_text("a local folder that looks like a hub name")
    for key, value, why in (("data.dataset", "~/notes.txt", "a local path"),
                            ("data.dataset", "/etc/hostname", "a local path"),
                            ("data.dataset", "owner/data", "a local path"),  # exists here: the loader reads it
                            ("data.dataset", "a/b/c", "a local path"),
                            ("data.dataset", "bad name!", "neither built in nor a hub name"),
                            ("data.tokenizer", "./tok", "a local path"),
                            ("model.name", "/tmp/config.json", "a config file, not a preset"),
                            ("model.init_from", "someone/checkpoint", "a checkpoint to load")):
        refused = _taken({**run, key: value})
        assert refused == [f"{key}={value} ({why})"], (key, value, refused)
    # built in, presets and hub names (the documented C4 run: allenai/c4 with the gpt2 tokenizer) are taken
    assert _taken({**run, "data.dataset": "stdlib", "model.name": "60m", "data.tokenizer": "byte"}) == []
    assert _taken({**run, "data.dataset": "allenai/c4", "data.dataset_config": "en", "data.tokenizer": "gpt2"}) == []
    # a key the joiner set itself is its own choice, never a refusal (settle compares it instead)
    cfg = load_config(overrides={**JOINER, "data.dataset": "~/notes.txt"})
    adopted, changed = adopt_settings(cfg, {**run, "data.dataset": "~/notes.txt"})
    assert "data.dataset" not in changed and refusals(cfg, adopted, changed) == []


@pytest.mark.timeout(30)
def test_weaker_defences_and_sizes_or_rates_above_the_limits_are_refused():
    run = _run()
    weaker = {"averaging.verify_parts": False, "averaging.suspect_rounds": 0, "averaging.max_weight_ratio": 1e6,
              "averaging.max_share": 50.0, "inner.grad_clip": None}
    refused = _taken({**run, **weaker})
    assert sorted(r.split("=")[0] for r in refused) == sorted(weaker), refused
    assert all("weaker than this peer's" in r for r in refused)
    # the aggregator: mean is weaker than a robust rule this peer holds; a robust rule is never weaker than mean
    assert _taken({**run, "averaging.aggregator": "mean"}, **{"averaging.aggregator": "trimmed_mean"}) == \
        ["averaging.aggregator=mean (weaker than this peer's trimmed_mean)"]
    assert _taken({**run, "averaging.aggregator": "trimmed_mean", "averaging.suspect_rounds": 10}) == []
    over = {"model.seq_len": 2 ** 20, "inner.lr": 400.0, "diloco.outer_lr": 50.0, "data.eval_batches": 10 ** 6,
            "averaging.part_size_bytes": 2 ** 31}
    refused = _taken({**run, **over})
    assert sorted(r.split("=")[0] for r in refused) == sorted(over), refused
    assert "inner.lr=400.0 (above the limit 0.01 for settings from the DHT)" in refused
    at_limits = {k: v for k, v in LIMITS.items() if k in over}
    assert _taken({**run, **at_limits, "model.seq_len": int(LIMITS["model.seq_len"])}) == []
    assert set(WEAKER) <= set(run)  # every defence named is a run setting


@pytest.mark.timeout(30)
def test_every_taken_value_passes_the_configs_own_checks_in_one_line():
    run = _run()
    for key, value in (("model.seq_len", "9"), ("model.seq_len", -1), ("averaging.aggregator", "median"),
                       ("averaging.min_group_size", 10 ** 6), ("inner.beta1", 1.5)):
        with pytest.raises(ConfigError) as e:
            adopt_settings(load_config(overrides=JOINER), {**run, key: value})
        line = str(e.value)
        assert key in line and "published by the peers of run 'spec-run'" in line and "\n" not in line, line
    with pytest.raises(ConfigError) as e:  # control characters from the DHT never reach the terminal
        adopt_settings(load_config(overrides=JOINER), {**run, "averaging.codec": "x\x1b[2J\x07"})
    assert "\x1b" not in str(e.value) and "\x07" not in str(e.value)
