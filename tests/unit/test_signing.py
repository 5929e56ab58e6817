"""Signal signatures: verifiable without Python, and every forgery refused."""

import shutil
import subprocess

import orjson
import pytest

from pipeline.admission.signing import PLACEHOLDER, SignatureError, sign, signed_bytes, verify
from tests.reference import reference_accepts

KEYS = {"k-old": b"old secret", "k-new": b"new secret"}


def example_signal():
    body = orjson.loads(open("schemas/examples/admission_signal/valid/overloaded.json", "rb").read())
    del body["signature"], body["key_id"]
    return body


def test_signed_signal_is_valid_against_the_schema_and_verifies():
    message = sign(example_signal(), "k-new", KEYS["k-new"])
    assert message.endswith(b'"}') and b'"signature":"' in message[-80:]
    assert reference_accepts("admission_signal", orjson.loads(message))
    assert verify(message, KEYS)["pool"] == "llama-70b-a"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_an_independent_implementation_verifies_the_documented_bytes(tmp_path):
    message = sign(example_signal(), "k-old", KEYS["k-old"])
    covered, signature = signed_bytes(message)
    assert covered == message[:-66] + PLACEHOLDER + b'"}'
    (tmp_path / "signed").write_bytes(covered)
    out = subprocess.run(["openssl", "dgst", "-sha256", "-hmac", "old secret", str(tmp_path / "signed")],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith(signature)


def test_key_rotation_accepts_old_and_new_ids():
    assert verify(sign(example_signal(), "k-old", KEYS["k-old"]), KEYS)
    assert verify(sign(example_signal(), "k-new", KEYS["k-new"]), KEYS)
    with pytest.raises(SignatureError) as err:
        verify(sign(example_signal(), "k-old", KEYS["k-old"]), {"k-new": KEYS["k-new"]})
    assert err.value.reason == "unknown_key"


@pytest.mark.parametrize("forge,reason", [
    (lambda m: m.replace(b'"standard":1.0', b'"standard":0.0'), "bad_signature"),
    (lambda m: m[:-66] + b"1" * 64 + b'"}', "bad_signature"),
    (lambda m: m[:m.rindex(b',"signature"')] + b"}", "unsigned"),
    (lambda m: m.replace(b'"key_id":"k-new"', b'"key_id":"k-old"'), "bad_signature"),
    (lambda m: m + b" ", "unsigned"),
])
def test_forgeries_are_refused(forge, reason):
    message = sign(example_signal(), "k-new", KEYS["k-new"])
    with pytest.raises(SignatureError) as err:
        verify(forge(message), KEYS)
    assert err.value.reason == reason


def test_a_controller_without_keys_refuses_to_start_unless_development_is_explicit():
    import pytest

    from pipeline.admission.keyring import DEV_KEYS, keyring
    from pipeline.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="no signing keys"):
        keyring(load_settings(env={}))
    assert keyring(load_settings(env={}, dev_signing_key=True)) == {k: v.encode() for k, v in DEV_KEYS.items()}
    with pytest.raises(SettingsError, match="dev_signing_key"):
        load_settings(env={}, dev_signing_key=True, web_host="0.0.0.0", query_token="t" * 20)
    assert keyring(load_settings(env={}, signing_keys={"k1": "s" * 16}, signing_key_id="k1")) == {"k1": b"s" * 16}


@pytest.mark.parametrize("key_id, problem",
                         [("k" * 65, "too_long"), ("2024 rotation", "bad_format"), ("", "bad_format")])
def test_a_key_id_the_signal_schema_refuses_fails_at_start_up(key_id, problem):
    """Signed with it, every signal would be refused by every router as invalid while the controller ran on."""
    from pipeline.admission.keyring import active_key
    from pipeline.settings import SettingsError, load_settings

    settings = load_settings(env={}, signing_keys={key_id: "s" * 16, "k1": "t" * 16}, signing_key_id="k1")
    with pytest.raises(SettingsError, match=f"signing key id .*{problem}"):
        active_key(settings)


def test_the_worker_refuses_to_start_without_keys(tmp_path):
    import subprocess
    import sys

    env = {"PATH": "/usr/bin:/bin", "SLUICE_STATE_DIR": str(tmp_path), "SLUICE_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9"}
    proc = subprocess.run([sys.executable, "-c", "from pipeline.worker.app import create_app; "
                           "from pipeline.settings import load_settings; create_app(load_settings())"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no signing keys" in proc.stderr
