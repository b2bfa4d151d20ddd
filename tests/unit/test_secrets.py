"""What ddplab.redact masks and finds (issue 45), in-process: a URI's user info and a key named like a secret
or in ``redact_keys``, in plain text, Hydra's escapes and reprs; and the secrets written out that a pickling
launcher is refused for, not those an interpolation fetches where the job runs."""

from __future__ import annotations

import pytest
from helpers.extras import needs

from ddplab import redact

needs("mlflow", "mlflow")

PASSWORD, TOKEN = "S3cretPw9", "T0kenXyz7"


@pytest.mark.parametrize(
    "raw, masked",
    [
        ("mlflow.tracking_uri=http://u:p@h:5000", "mlflow.tracking_uri=http://***@h:5000"),
        (
            "study.storage=postgresql://ddp:pw@127.0.0.1:5432/studies",
            "study.storage=postgresql://***@127.0.0.1:5432/studies",
        ),
        ("https://hf_abc@huggingface.co/x", "https://***@huggingface.co/x"),
        ("['+x.api_key=k1', 'seed=3']", "['+x.api_key=***', 'seed=3']"),
        ("a=1,x.up.token=t,b=2", "a=1,x.up.token=***,b=2"),  # named in redact_keys
        (
            "mailto-like user@host and tokenizer=bpe",
            "mailto-like user@host and tokenizer=bpe",
        ),  # no URI, no key
        # a sweep job's
        ("mlflow.tracking_uri=http\\://u\\:p@h\\:5000", "mlflow.tracking_uri=http\\://***@h\\:5000"),
        ("'mlflow.tracking_uri=http\\\\://u\\\\:p@h'", "'mlflow.tracking_uri=http\\\\://***@h'"),  # its repr
        # Hydra escapes = too
        ("mlflow.tracking_uri=http\\://u\\:dG9rZW4\\=@h", "mlflow.tracking_uri=http\\://***@h"),
        ("- db.password='my pw, 2',seed=1", "- db.password=***,seed=1"),  # quoted: a space or comma inside
        # JSON's \n ends a host, no user info
        ('{"e": "http://h:5000\\nuser@x"}', '{"e": "http://h:5000\\nuser@x"}'),
    ],
)
def test_what_is_masked(raw, masked):
    assert redact.text(raw, ["x.up.token"]) == masked
    assert redact.node({"x": {"password": "p", "n": None, "uri": "tcp://a:b@h"}}) == {
        "x": {"password": "***", "n": None, "uri": "tcp://***@h"}
    }


def test_what_a_pickling_launcher_is_refused():
    """A secret written out is found wherever it sits; one that an interpolation fetches where the job runs is
    not."""
    cfg = {
        "mlflow": {"tracking_uri": "http://${oc.env:U}:${oc.env:P}@h", "experiment": None},
        "cb": {"token": "t", "api_key": "${oc.env:K}", "n": 3, "secret": "", "password": None},
        "study": {
            "storage": "postgresql://ddp:pw@127.0.0.1/s",
            "other": "postgresql://u:pw@${oc.env:HOST}/db",
        },
        "upload": {"auth": {"user": "u"}},  # a whole node named in redact_keys
        "hydra": {
            "overrides": {"task": ["seed=1", "+x.password=p", "mlflow.tracking_uri=http://${oc.env:U}@h"]}
        },
    }
    assert redact.written_out(cfg, ["cb.token", "upload"]) == [
        "cb.token",
        "study.storage",
        "study.other",
        "upload",
        "hydra.overrides.task[1]",
    ]
