"""What the coordinator reports about its sites: the rows each joined with, and whether its certificate is
revoked, also after a restart."""

from __future__ import annotations

import json

from plexus import pki
from plexus.cli import main as cli

from integration.harness import RAW_ROWS, Federation


def _listed(fed) -> list[tuple]:
    return [(s.site, dict(s.dataset_rows), s.revoked) for s in fed.admin("viewer").sites()]


def test_sites_show_their_rows_and_revocation_across_a_restart(tmp_path, capsys):
    root = tmp_path / "pki"   # its own CA: revoking a site of the shared one would break other tests
    pki.init_federation(root, "sites-test", hosts=["127.0.0.1"])
    for name in "ab":
        pki.add_site(root, name)
    pki.add_admin(root, "viewer", role="viewer")
    fed = Federation(root, tmp_path / "state")
    try:
        fed.raw_site("a").join({"heart-disease": 303, "cxr": 12})
        fed.raw_site("b").join()
        assert _listed(fed) == [("a", {"heart-disease": 303, "cxr": 12}, False),
                                ("b", {"heart-disease": RAW_ROWS}, False)]
        pki.revoke(root, "b")   # a new crl.pem, which the running coordinator reloads
        assert _listed(fed) == [("a", {"heart-disease": 303, "cxr": 12}, False),
                                ("b", {"heart-disease": RAW_ROWS}, True)]
    finally:
        fed.close()

    fed = Federation(root, tmp_path / "state")   # the same state dir: nobody has joined this coordinator yet
    try:
        assert _listed(fed) == [("a", {"heart-disease": 303, "cxr": 12}, False),
                                ("b", {"heart-disease": RAW_ROWS}, True)]
        admin = ["--kit", str(root / "admins" / "viewer"), "--coordinator", fed.address]
        assert cli(["sites", "list", *admin]) == 0
        header, a, b = capsys.readouterr().out.splitlines()
        assert header.split()[3:6] == ["datasets", "rows", "revoked"]
        # a raw site maps no datasets and sends no policy digest: those columns are blank
        assert a.split()[4:] == ["cxr=12,heart-disease=303", "False", "raw"]
        assert b.split()[4:] == [f"heart-disease={RAW_ROWS}", "True", "raw"]
        assert cli(["sites", "list", "--json", *admin]) == 0
        assert [(s["site"], s["dataset_rows"], s["revoked"]) for s in json.loads(capsys.readouterr().out)] == \
            [("a", {"cxr": 12, "heart-disease": 303}, False), ("b", {"heart-disease": RAW_ROWS}, True)]
    finally:
        fed.close()
