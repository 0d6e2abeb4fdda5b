"""Who may take part in a run, and what nobody can forge (README: "Private and open runs", "Threat model").

  access.py    pure: a private run's keys (HKDF of the secret), membership proofs, revocation records, replay window
  auth.py      the DHT's HMAC authorizer (revoked senders refused), the revocation list, secret re-reads
  gate.py      the averager's side of a private run: members only in joins, parts and state downloads
  identity.py  libp2p identity keys and PeerIDs (Ed25519, RSA; hivemind's protobufs); signing records in a PeerID's name
  records.py   the DHT record validator: a record in a PeerID's name must be signed by that PeerID
"""
