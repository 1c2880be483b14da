"""``EncryptionCodec``: workflow payloads encrypted (AES-256-GCM) before they leave the
process, so Temporal's history holds ciphertext.

What a job carries (task, transcripts kept inline, tool arguments and results, approval
comments) is stored by Temporal for the history's retention and shown in its Web UI and
CLI to anyone with namespace access. With ``WARMLOOP_PAYLOAD_KEY`` set, every client and
worker built by ``warmloop.workers.clients.connect`` encrypts each payload with it; the
Web UI shows them through the codec server (``warmloop.workers.codec_server``) to
authorised users only.

Not encrypted: search attributes (Temporal indexes them: job id, profile, status),
workflow and activity type names, task queues, timer durations and Temporal's own
failure fields that the SDK does not move into payloads. Failure messages and stack
traces are encoded (``data_converter`` uses the failure converter that moves them into
an encoded payload).

The format is that of Temporal's samples (Python, Go, TypeScript): metadata
``encoding: binary/encrypted`` and ``encryption-key-id: <id>``, data = 12-byte random
nonce + AES-GCM ciphertext and tag of the serialized original ``Payload``, no
associated data. A codec server in another language with the same key can read them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.message import DecodeError
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

ENCRYPTED_ENCODING = b"binary/encrypted"
"""``encoding`` metadata of an encrypted payload."""
KEY_ID_METADATA = "encryption-key-id"
"""Metadata naming the key a payload was encrypted with."""
NONCE_BYTES = 12
KEY_BYTES = 32


class PayloadDecryptionError(ValueError):
    """An encrypted payload cannot be decrypted: its key is unknown here, the key under
    its id is not the one it was encrypted with, or the payload was altered."""

    def __init__(self, key_id: str, message: str) -> None:
        super().__init__(message)
        self.key_id = key_id


class EncryptionCodec(PayloadCodec):
    """Encrypts every payload with ``key`` (id ``key_id``); decrypts payloads made with
    it or any of ``old_keys`` ({id: key}, for rotation) and passes payloads that are not
    encrypted through unchanged (histories written before encryption was turned on).

    Hazards:

    - A process without the key cannot read the namespace's jobs (workers fail their
      workflow tasks, which Temporal retries until a worker with the key picks them
      up); losing the key loses every open job's data. Keep it in a secret store.
    - A random 96-bit nonce per payload is safe for about 2**32 payloads per key
      (NIST SP 800-38D); rotate the key well before that.
    - Decoding accepts plaintext payloads (that is what lets old histories read), so
      the codec does not stop someone who can write to Temporal from injecting
      unencrypted input; Temporal's own authorisation has to.
    """

    def __init__(self, key: bytes, key_id: str = "k1", *,
                 old_keys: Mapping[str, bytes] | None = None) -> None:
        keys = {**(old_keys or {}), key_id: key}
        for kid, k in keys.items():
            if len(k) != KEY_BYTES:
                raise ValueError(f"payload key {kid!r} is {len(k)} bytes; AES-256 needs "
                                 f"{KEY_BYTES}")
        self.key_id = key_id
        self._key_id_bytes = key_id.encode()
        self._ciphers = {kid: AESGCM(k) for kid, k in keys.items()}

    @property
    def key_ids(self) -> list[str]:
        """Ids of the keys this codec decrypts with (the current one last)."""
        return list(self._ciphers)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        cipher = self._ciphers[self.key_id]
        out = []
        for p in payloads:
            nonce = os.urandom(NONCE_BYTES)
            out.append(Payload(
                metadata={"encoding": ENCRYPTED_ENCODING, KEY_ID_METADATA: self._key_id_bytes},
                data=nonce + cipher.encrypt(nonce, p.SerializeToString(), None)))
        return out

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self._decode_one(p) for p in payloads]

    def _decode_one(self, p: Payload) -> Payload:
        if p.metadata.get("encoding") != ENCRYPTED_ENCODING:
            return p
        key_id = p.metadata.get(KEY_ID_METADATA, b"").decode(errors="replace")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            known = ", ".join(repr(k) for k in self._ciphers)
            raise PayloadDecryptionError(
                key_id, f"payload encrypted with key id {key_id!r}, which this process "
                f"does not have (it has {known}); add it to WARMLOOP_PAYLOAD_OLD_KEYS")
        if len(p.data) < NONCE_BYTES + 16:
            raise PayloadDecryptionError(
                key_id, f"payload encrypted with key id {key_id!r} is truncated "
                f"({len(p.data)} bytes)")
        try:
            plain = cipher.decrypt(p.data[:NONCE_BYTES], p.data[NONCE_BYTES:], None)
        except InvalidTag:
            raise PayloadDecryptionError(
                key_id, f"cannot decrypt a payload with key id {key_id!r}: the key under "
                "that id is not the one it was encrypted with, or the payload was "
                "altered") from None
        try:
            return Payload.FromString(plain)
        except DecodeError:
            raise PayloadDecryptionError(
                key_id, f"payload decrypted with key id {key_id!r} is not a Temporal "
                "payload") from None
