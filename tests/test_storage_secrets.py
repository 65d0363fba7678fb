"""No credential in any message: one scrubber (:mod:`checkpoint.storage.secrets`) for errors of the
API, CLI text and ``--json`` output, warnings and reports, whatever the placement of the secret
(a storage option under a credential-like name at any depth, the userinfo or query string of the
endpoint URL, the checkpoint URL's userinfo, fsspec's configuration, a presigned URL quoted by a
library). The endpoint is unreachable (127.0.0.1:1), so every request fails at once."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("s3fs")

import checkpoint  # noqa: E402
from checkpoint.errors import CheckpointError, error_fields  # noqa: E402
from checkpoint.storage import secrets  # noqa: E402
from checkpoint.storage.objstore import TransferConfig  # noqa: E402

NO_RETRY = TransferConfig(retries=0)
ONE_TRY = {"config_kwargs": {"retries": {"total_max_attempts": 1}}, "connect_timeout": 1}  # botocore's own retries off

# (storage_options, URL, the secrets they hold): each a placement seen in practice.
PLACEMENTS = [
    ({"endpoint_url": "http://127.0.0.1:1/?apitoken=QueryTOKEN1234"}, "s3://bk/x", ["QueryTOKEN1234"]),
    ({"endpoint_url": "http://gwuser:GatewayPASS99@127.0.0.1:1/"}, "s3://bk/x", ["GatewayPASS99", "gwuser"]),
    ({"endpoint_url": "http://127.0.0.1:1", "key": "AKIDPLACEMENT3", "secret": "SecretKEY33333"}, "s3://bk/x",
     ["AKIDPLACEMENT3", "SecretKEY33333"]),
    ({"endpoint_url": "http://127.0.0.1:1", "client_kwargs": {"aws_session_token": "NestedSESSION44"}}, "s3://bk/x",
     ["NestedSESSION44"]),
    ({"endpoint_url": "http://127.0.0.1:1/#frag=FragSECRET55"}, "s3://bk/x", ["FragSECRET55"]),
]  # fmt: skip


def _messages(opts, url) -> list[str]:
    opts, out = {**opts, **ONE_TRY}, []
    for op in ("save", "load", "verify"):
        try:
            if op == "save":
                checkpoint.save({"w": torch.zeros(2)}, url, storage_options=opts, transfer=NO_RETRY)
            elif op == "load":
                checkpoint.load({"w": torch.zeros(2)}, url, storage_options=opts, transfer=NO_RETRY)
            else:
                out += list(checkpoint.verify(url, storage_options=opts).problems)
                continue
        except Exception as e:  # noqa: BLE001 - every kind is checked for secrets
            out += [str(e), repr(e), json.dumps(error_fields(e), default=str)]
            if op == "save":
                assert isinstance(e, checkpoint.CheckpointWriteError), type(e)  # a save names a write failure
            continue
        raise AssertionError(f"{op} reached an unreachable endpoint")
    return out


@pytest.mark.parametrize("opts,url,hidden", PLACEMENTS)
def test_api_errors_and_reports_hold_no_secret(opts, url, hidden):
    msgs = _messages(opts, url)
    assert msgs and all(s not in m for m in msgs for s in hidden), [m for m in msgs if any(s in m for s in hidden)]
    assert any("s3://bk/x" in m for m in msgs)  # the object is still named


def test_cli_text_and_json_hold_no_secret(monkeypatch, capsys):
    import fsspec.config

    from checkpoint.cli import main as cli_main

    secret = "CliConfigTOKEN777"
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://127.0.0.1:1/?sig={secret}", "key": "AKIDCLI8888",
                                                   "config_kwargs": {"retries": {"total_max_attempts": 1}}})  # fmt: skip
    for argv in (["inspect", "s3://bk/cli"], ["verify", "s3://bk/cli", "--json"], ["diff", "s3://bk/a", "s3://bk/b", "--json"]):
        rc = cli_main(argv)
        out, err = capsys.readouterr()
        assert rc != 0 and (out or err)
        assert secret not in out + err and "AKIDCLI8888" not in out + err, (argv, out, err)


def test_scrub_kinds_in_free_text():
    presigned = "https://bk.s3.amazonaws.com/o?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA%2Fx&X-Amz-Signature=deadbeef99"
    text = (
        f"GET {presigned} failed; s3://alice:pw-Alice1@bk/ck; Authorization: AWS4-HMAC-SHA256 Credential=AKIA/2026 "
        "password=hunter22 model.embed_tokens.weight: shape (3, 4)"
    )
    out = secrets.scrub(text)
    for s in ("deadbeef99", "AKIA%2Fx", "pw-Alice1", "alice", "AWS4-HMAC-SHA256 Credential", "hunter22"):
        assert s not in out, (s, out)
    # what is not a credential stays: object names, tensor names, shapes, plain URLs
    assert "https://bk.s3.amazonaws.com/o?" in out and "s3://***@bk/ck" in out
    assert "model.embed_tokens.weight: shape (3, 4)" in out
    assert secrets.scrub("s3://bk/run/step-00000001 and /tmp/a?b") == "s3://bk/run/step-00000001 and /tmp/a?b"


def test_registered_options_scrub_every_later_message():
    secrets.register({"storage": {"password": "RegisteredPW123"}, "signature_version": "s3v4"})
    e = CheckpointError("opening failed with RegisteredPW123 (s3v4)")
    assert "RegisteredPW123" not in str(e) and "s3v4" in str(e)  # a signature *version* is no secret
    with pytest.warns(UserWarning) as w:
        import warnings

        warnings.warn(secrets.scrub("retention could not remove it (RegisteredPW123)"), stacklevel=1)
    assert "RegisteredPW123" not in str(w[0].message)


def test_log_records_of_any_logger_are_scrubbed(caplog):
    import logging

    secrets.register({"endpoint_url": "http://127.0.0.1:1/?apitoken=LogTOKEN9999"})
    with caplog.at_level(logging.DEBUG, logger="botocore.endpoint"):
        logging.getLogger("botocore.endpoint").debug(
            "Sending http request: <AWSPreparedRequest url=%s, headers={'Authorization': b'AWS4 Credential=AK/1'}>",
            "http://127.0.0.1:1/b/k?apitoken=LogTOKEN9999&X-Amz-Signature=sig0123",
        )
    text = caplog.text
    assert "LogTOKEN9999" not in text and "sig0123" not in text and "Sending http request" in text
