"""The payload codec (AES-GCM) and its codec server for the Temporal Web UI."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import pytest
from pydantic import BaseModel
from starlette.testclient import TestClient
from temporalio.api.common.v1 import Payload
from temporalio.api.failure.v1 import Failure
from temporalio.exceptions import ApplicationError

from warmloop.workers.clients import data_converter
from warmloop.workers.codec import (
    ENCRYPTED_ENCODING,
    KEY_ID_METADATA,
    EncryptionCodec,
    PayloadDecryptionError,
)
from warmloop.workers.codec_server import codec_app
from warmloop.workers.settings import Settings

MARKER = "ACME-SECRET-IBAN-DE89370400440532013000"
KEY1, KEY2 = os.urandom(32), os.urandom(32)
UI = "http://127.0.0.1:8233"
TOKEN = "Bearer let-me-in"


def plain(text: str = MARKER) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(text).encode())


# ---- the codec --------------------------------------------------------------------------


async def test_round_trip_hides_the_payload() -> None:
    codec = EncryptionCodec(KEY1, "k1")
    originals = [plain(), plain("second"), Payload(metadata={"encoding": b"binary/null"})]
    encoded = await codec.encode(originals)
    for e in encoded:
        assert e.metadata["encoding"] == ENCRYPTED_ENCODING
        assert e.metadata[KEY_ID_METADATA] == b"k1"
        assert MARKER.encode() not in e.SerializeToString()
    assert await codec.decode(encoded) == originals


async def test_each_encoding_uses_a_fresh_nonce() -> None:
    codec = EncryptionCodec(KEY1, "k1")
    a, b = await codec.encode([plain(), plain()])
    assert a.data[:12] != b.data[:12] and a.data != b.data


async def test_tampered_payload_is_refused_naming_the_key() -> None:
    codec = EncryptionCodec(KEY1, "k1")
    [enc] = await codec.encode([plain()])
    flipped = bytearray(enc.data)
    flipped[20] ^= 0x01
    tampered = Payload(metadata=enc.metadata, data=bytes(flipped))
    with pytest.raises(PayloadDecryptionError, match="key id 'k1'.*altered") as e:
        await codec.decode([tampered])
    assert e.value.key_id == "k1"
    with pytest.raises(PayloadDecryptionError, match="truncated"):
        await codec.decode([Payload(metadata=enc.metadata, data=enc.data[:20])])


async def test_wrong_key_under_the_same_id_is_refused() -> None:
    [enc] = await EncryptionCodec(KEY1, "k1").encode([plain()])
    with pytest.raises(PayloadDecryptionError,
                       match="key id 'k1': the key under that id is not the one"):
        await EncryptionCodec(KEY2, "k1").decode([enc])


async def test_unknown_key_id_is_refused_naming_both() -> None:
    [enc] = await EncryptionCodec(KEY1, "k1").encode([plain()])
    with pytest.raises(PayloadDecryptionError,
                       match=r"key id 'k1', which this process does not have \(it has 'k2'\)"):
        await EncryptionCodec(KEY2, "k2").decode([enc])


async def test_rotation_reads_old_payloads_and_writes_with_the_new_key() -> None:
    [old] = await EncryptionCodec(KEY1, "k1").encode([plain()])
    rotated = EncryptionCodec(KEY2, "k2", old_keys={"k1": KEY1})
    assert await rotated.decode([old]) == [plain()]
    [new] = await rotated.encode([plain()])
    assert new.metadata[KEY_ID_METADATA] == b"k2"


async def test_unencrypted_payloads_pass_through() -> None:
    """Histories written before encryption was turned on still read."""
    codec = EncryptionCodec(KEY1, "k1")
    originals = [plain(), Payload(metadata={"encoding": b"binary/plain"}, data=b"\x00\x01")]
    assert await codec.decode(originals) == originals


def test_keys_must_be_aes_256() -> None:
    with pytest.raises(ValueError, match="'k1' is 16 bytes; AES-256 needs 32"):
        EncryptionCodec(os.urandom(16), "k1")


class Ticket(BaseModel):
    customer: str
    body: str


async def test_data_converter_from_settings() -> None:
    key = base64.b64encode(KEY1).decode()
    converter = data_converter(Settings(payload_key=key, payload_key_id="prod-1"))
    ticket = Ticket(customer="C100", body=MARKER)
    [payload] = await converter.encode([ticket])
    assert payload.metadata[KEY_ID_METADATA] == b"prod-1"
    assert MARKER.encode() not in payload.SerializeToString()
    assert await converter.decode([payload], [Ticket]) == [ticket]
    # Failure messages are encrypted too, and come back for a process with the key.
    failure = Failure()
    await converter.encode_failure(ApplicationError(MARKER, type="ToolError"), failure)
    assert MARKER.encode() not in failure.SerializeToString()
    decoded = await converter.decode_failure(failure)
    assert isinstance(decoded, ApplicationError) and decoded.message == MARKER


# ---- the codec server -----------------------------------------------------------------


def server(**kwargs: Any) -> TestClient:
    return TestClient(codec_app(EncryptionCodec(KEY1, "k1"),
                                authorize=lambda header: header == TOKEN,
                                allowed_origins=[UI], **kwargs))


def as_json(*payloads: Payload) -> dict[str, Any]:
    return {"payloads": [
        {"metadata": {k: base64.b64encode(v).decode() for k, v in p.metadata.items()},
         "data": base64.b64encode(p.data).decode()} for p in payloads]}


def from_json(body: dict[str, Any]) -> list[Payload]:
    return [Payload(metadata={k: base64.b64decode(v) for k, v in p.get("metadata", {}).items()},
                    data=base64.b64decode(p.get("data", ""))) for p in body["payloads"]]


HEADERS = {"Authorization": TOKEN, "X-Namespace": "default", "Origin": UI}


async def test_codec_server_decodes_for_an_authorised_user() -> None:
    [enc] = await EncryptionCodec(KEY1, "k1").encode([plain()])
    with server() as client:
        for path in ("/decode", "/default/decode", "/codec/default/decode/"):
            r = client.post(path, json=as_json(enc), headers=HEADERS)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "application/json"
            assert from_json(r.json()) == [plain()]
            assert r.headers["access-control-allow-origin"] == UI
            assert r.headers["access-control-allow-credentials"] == "true"


async def test_codec_server_encodes() -> None:
    with server() as client:
        r = client.post("/encode", json=as_json(plain()), headers=HEADERS)
        assert r.status_code == 200
        [enc] = from_json(r.json())
        assert enc.metadata["encoding"] == ENCRYPTED_ENCODING
        assert await EncryptionCodec(KEY1, "k1").decode([enc]) == [plain()]


@pytest.mark.parametrize("authorization", [None, "Bearer guess", ""])
async def test_codec_server_refuses_an_unauthorised_caller(authorization: str | None) -> None:
    [enc] = await EncryptionCodec(KEY1, "k1").encode([plain()])
    headers = {"X-Namespace": "default", "Origin": UI}
    if authorization is not None:
        headers["Authorization"] = authorization
    with server() as client:
        r = client.post("/decode", json=as_json(enc), headers=headers)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert MARKER not in r.text
        # The browser can read the refusal (and show "unauthorised", not a CORS error).
        assert r.headers["access-control-allow-origin"] == UI


def test_codec_server_cors_preflight() -> None:
    with server() as client:
        r = client.options("/decode", headers={
            "Origin": UI, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-namespace"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == UI
        assert r.headers["access-control-allow-credentials"] == "true"
        assert "POST" in r.headers["access-control-allow-methods"]
        allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-namespace"} <= allowed
        other = client.options("/decode", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
        post = client.post("/decode", json=as_json(plain()),
                           headers={**HEADERS, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in post.headers


async def test_codec_server_errors() -> None:
    [enc] = await EncryptionCodec(KEY2, "k1").encode([plain()])  # another key under k1
    with server() as client:
        wrong = client.post("/decode", json=as_json(enc), headers=HEADERS)
        assert wrong.status_code == 400 and "key id 'k1'" in wrong.json()["error"]
        bad = client.post("/decode", content=b"{not json", headers={
            **HEADERS, "Content-Type": "application/json"})
        assert bad.status_code == 400 and "invalid Payloads JSON" in bad.json()["error"]
        form = client.post("/decode", content=json.dumps(as_json(plain())),
                           headers={**HEADERS, "Content-Type": "text/plain"})
        assert form.status_code == 415
        assert client.post("/other", json=as_json(plain()), headers=HEADERS).status_code == 404
        assert client.get("/decode", headers=HEADERS).status_code == 405


def test_codec_server_refuses_a_wildcard_origin() -> None:
    with pytest.raises(ValueError, match="cannot be '\\*'"):
        codec_app(EncryptionCodec(KEY1), authorize=lambda _: True, allowed_origins=["*"])
