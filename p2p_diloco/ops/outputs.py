"""What a peer writes out of a run: its checkpoint (and the resume from it), θ_global as a Hugging Face folder, and
text samples by θ_global. ``Peer._after_commit`` calls them every ``run.checkpoint_every``, ``run.export_every`` and
``run.sample_every`` rounds; ``Peer.close`` saves once more and ``Peer.start`` resumes.

A checkpoint is taken under the global state's lock and holds whole committed rounds only: θ_global and the outer
state, θ_local and the inner optimizer, the data order of every rank, the work not yet averaged (tokens, the round
it began from, error feedback's residual, overlap's owed contribution) and the config.
"""

from __future__ import annotations

from dataclasses import asdict

from p2p_diloco.config import ConfigError
from p2p_diloco.config.secrets import redacted
from p2p_diloco.ops.checkpoint import load_checkpoint, save_checkpoint
from p2p_diloco.errors import first_line
from p2p_diloco.ops.stop import unhurried


def checkpoint_state(peer) -> dict:
    ef = peer.error_feedback
    peer.replica.refresh()  # a sharded peer's host copy of θ_local, brought up to date with its shards
    shards_tag = peer.replica.save_moments()  # and its AdamW state, each rank its shard (run_dir/inner-shards)
    return {**peer.state.state_dict(), "name": peer.name, "fingerprint": peer.fingerprint, "inner_shards": shards_tag,
            "model": peer.model.state_dict(), "inner": peer.inner.state_dict(),
            "data": peer.data.train.state_dict(), "data_ranks": peer.replica.data_states(),
            "tokens_since_commit": peer.tokens_since_commit, "work_round": peer.work_round,
            "tokens_trained": peer.tokens_trained, "config": redacted(asdict(peer.cfg)),
            "error_feedback": ef.state_dict() if ef is not None else None, "overlap": peer.exchange.state_dict()}


def save(peer) -> None:
    with peer.state.lock, unhurried("the checkpoint's write"):  # a stop's deadline lets it finish (ops/stop.py)
        try:
            state = checkpoint_state(peer)
        except RuntimeError as e:
            if peer.replica.shards is None:
                raise
            # a sharded peer whose rank died: that rank's shard of θ_local is gone; the last checkpoint stays
            peer.log.warning(f"checkpoint not saved: a rank of this sharded peer is gone ({first_line(e)})")
            return
        save_checkpoint(peer.run_dir, state)


def resume(peer) -> bool:
    """Load the newest checkpoint of ``run.run_dir`` into the peer; False if there is none. ConfigError if it
    belongs to another model or outer setup."""
    saved = load_checkpoint(peer.run_dir)
    if saved is None:
        return False
    if saved["fingerprint"] != peer.fingerprint:
        raise ConfigError(f"run.run_dir: {peer.run_dir} holds a checkpoint of another model or outer setup "
                          f"({saved['fingerprint']} != {peer.fingerprint}); use another run.run_dir")
    peer.state.load_state_dict(saved)
    peer.model.load_state_dict(saved["model"])
    peer.inner.load_state_dict(saved["inner"])
    if peer.replica.shards is not None:
        peer.replica.broadcast_local()  # the saved θ_local into every rank's shard
        if not peer.replica.restore_moments(saved.get("inner_shards")):
            peer.log.warning("resumed without the inner AdamW state: run_dir holds no inner-shards folder written "
                             "with this checkpoint")
    peer.data.train.load_state_dict(saved["data"])
    peer.tokens_since_commit = saved["tokens_since_commit"]
    peer.work_round = saved.get("work_round", peer.round)  # θ_local's work is relative to the saved θ_global
    peer.tokens_trained = saved.get("tokens_trained", 0)  # absent from checkpoints of earlier versions
    if saved.get("error_feedback") is not None and peer.error_feedback is not None:
        peer.error_feedback.load_state_dict(saved["error_feedback"])
    peer.exchange.load_state_dict(saved.get("overlap"))  # the all-reduce that was in flight counts as failed
    return True


def export(peer) -> None:
    """θ_global as a Hugging Face folder, ``run_dir/exports/round-NNNNNN``."""
    from p2p_diloco.ops.export import export_path, prune_exports, save_hf_folder

    path = export_path(peer.run_dir, peer.round)
    with peer.exchange.global_in_model():
        save_hf_folder(peer.model, peer.cfg, path, info={"round": peer.round, "peer": peer.name})
    pruned = prune_exports(peer.run_dir, peer.cfg.run.export_keep)
    peer.metrics.log({"event": "export", "peer": peer.name, "round": peer.round, "path": str(path),
                      "deleted": [p.name for p in pruned]})
    peer.log.info(f"round {peer.round}: θ_global exported to {path}")


def sample(peer) -> None:
    """A short continuation of ``run.sample_prompt`` by θ_global, as a metrics record (never fails the run)."""
    from p2p_diloco.ops.generate import SAMPLE_TOKENS, Generator, sample as generate

    prompt = peer.cfg.run.sample_prompt
    try:
        if peer._sampler is None:
            from p2p_diloco.ops.export import hf_tokenizer

            peer._sampler = Generator(peer.model, hf_tokenizer(peer.cfg, peer.cfg.model.seq_len), peer.name)
        with peer.exchange.global_in_model():
            text = generate(peer._sampler, prompt, samples=1, max_new_tokens=SAMPLE_TOKENS, seed=0)[0]
    except Exception as e:  # noqa: BLE001 - a sample is for people watching: it must not stop training
        peer.log.warning(f"round {peer.round}: text sample failed: {e!r}")
        return
    peer.metrics.log({"event": "sample", "peer": peer.name, "round": peer.round, "prompt": prompt, "text": text})
