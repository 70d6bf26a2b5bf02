"""A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate, made with the
openssl command line (no Python dependency)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory: Path) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=tooltrie-test-ca", cwd=d)
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("subjectAltName=DNS:publisher\nextendedKeyUsage=clientAuth\n")
    (d / "stranger.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who, cn in (("server", "localhost"), ("client", "publisher"), ("stranger", "stranger")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
                 "-subj", f"/CN={cn}", cwd=d)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{who}.crt", "-days", "2", "-extfile", f"{who}.ext", cwd=d)
    return {p.stem + p.suffix.replace(".", "_"): p for p in d.iterdir()}
