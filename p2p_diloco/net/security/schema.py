"""Validation on store: our DHT node refuses to store (and to accept from another node's answer) a record under one
of the run's keys that net/records.py would drop on read, so that honest nodes do not keep and pass on garbage.

hivemind calls :meth:`RunRecordValidator.validate` on every record another node asks us to store and on every
record another node returns to us, after :class:`~p2p_diloco.net.security.records.PeerSignatureValidator` has
checked and stripped the signature (its priority is lower). A node validates only the keys it was told about: a
peer knows its run's keys (:func:`install`), a bootstrap node knows none (readers still check every record). In a
private run the node holds the run's keys and also refuses revocation records whose MAC is wrong, so that a member
cannot hide a revocation behind a later-expiring garbage value.
"""

from __future__ import annotations

from typing import Mapping, Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from p2p_diloco.net.records import RecordError, check, count_dropped_record


class RunRecordValidator(RecordValidatorBase):
    """Refuses malformed records under the keys it knows (``kinds``: DHT key → record kind of net/records.py);
    ``revocation_keys``: a private run's AccessKeys, to check revocation records' MACs as well."""

    def __init__(self, kinds: Mapping[str, str], revocation_keys=None):
        self.kinds = {DHTID.generate(source=key).to_bytes(): kind for key, kind in kinds.items()}
        self.revocation_keys = revocation_keys

    def validate(self, record: DHTRecord) -> bool:
        kind = self.kinds.get(record.key)
        if kind is None:
            return True
        subkey: Optional[object] = None
        try:
            subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
            parsed = check(kind, subkey, value)
            if kind == "revoked" and self.revocation_keys is not None \
                    and not self.revocation_keys.is_revocation(*parsed):
                raise RecordError("revocation not signed with the run's secret")
        except RecordError as e:
            count_dropped_record(kind, f"refused on store: {e}", str(subkey))
            return False
        except Exception as e:  # whatever a crafted record triggers: refused, never raised into hivemind
            count_dropped_record(kind, f"refused on store: unreadable ({type(e).__name__})", str(subkey))
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value

    @property
    def priority(self) -> int:
        return 10  # after the signature check (20), which strips the signature this one must not see

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RunRecordValidator):
            return False
        self.kinds.update(other.kinds)
        self.revocation_keys = self.revocation_keys or other.revocation_keys
        return True


def run_keys(prefix: str, run_id: str) -> dict[str, str]:
    """The DHT keys of one run (net/keys.py) and their record kinds."""
    from p2p_diloco.net.keys import commits_key, finished_key, roster_key, run_index_key, run_settings_key

    return {roster_key(prefix): "roster", finished_key(prefix): "finished", run_index_key(run_id): "runs",
            run_settings_key(run_id): "config", commits_key(prefix): "commits"}


def install(dht, prefix: str, run_id: str) -> None:
    """From now on ``dht`` refuses malformed records under this run's keys (on store and in answers)."""
    dht.add_validators([RunRecordValidator(run_keys(prefix, run_id))])
