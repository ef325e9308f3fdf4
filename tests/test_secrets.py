"""No password in any output or file: the one masking function (attune.search.storage.mask_url / mask_text) is used
for every URL attune prints or writes. The slow test runs a PostgreSQL-backed study through the CLI and greps
everything it printed and wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attune.search.storage import check_url, mask_text, mask_url

ROOT = str(Path(__file__).resolve().parents[1])
# unencoded '/', ':' and '?' in the password (SQLAlchemy's URL parser takes everything up to the last '@')
PASSWORD = "Zq9/x?k:S3cr3tPW"


@pytest.mark.parametrize("url", [
    f"postgresql+psycopg://tuner:{PASSWORD}@db:5432/attune",
    f"postgresql://tuner:{PASSWORD}@db/attune?sslmode=require",
    f"postgresql://tuner@db/attune?password={PASSWORD}",
    f"postgresql://tuner@db/attune?sslmode=require&PASSWORD={PASSWORD}",
    f"mysql+pymysql://tuner:{PASSWORD}@db/attune",
    f"postgresql://tuner:{PASSWORD}@db@x/attune",
])
def test_mask_url_hides_the_password(url):
    m = mask_url(url)
    assert PASSWORD not in m and "S3cr3t" not in m and "***" in m
    assert "tuner" in m or "password=***" in m.lower()
    assert PASSWORD not in mask_text(f"cannot open {url}: refused")


def test_mask_url_keeps_urls_without_secrets():
    for url in ("sqlite:////tmp/x/study.db", "postgresql://db:5432/attune", "study.journal"):
        assert mask_url(url) == url


def test_opened_passwords_are_masked_in_free_text():
    check_url(f"postgresql://tuner:{PASSWORD}@db/attune")  # registers the secret of a storage attune opens
    assert mask_text(f"driver said: authentication failed (password {PASSWORD})") == \
        "driver said: authentication failed (password ***)"


def _attune(*args, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="200")
    return subprocess.run([sys.executable, "-c", "import sys; from attune.cli import main; sys.exit(main())", *args], cwd=cwd, env=env, capture_output=True,
                          timeout=300)


@pytest.mark.slow
def test_postgres_study_never_shows_the_password(tmp_path):
    from tests.test_postgres import Server, _skip_reason

    why = _skip_reason()
    if why:
        pytest.skip(why)
    srv = Server()  # trust authentication: any password logs in, so the URL can carry one
    try:
        url = srv.url.replace("postgresql://postgres:unused-password@", f"postgresql+psycopg://postgres:{PASSWORD}@")
        out = tmp_path / "out"
        runs = [
            _attune("tune", "--model", "tiny-llama", "--gpus", "8xH200", "--trials", "2", "--storage", url,
                    "--study-name", "secret-test", "--out", str(out), "--verbose", cwd=tmp_path),
            _attune("study", "status", "--storage", url, "--study", "secret-test", cwd=tmp_path),
            _attune("study", "status", "--storage", url, "--study", "secret-test", "--json", cwd=tmp_path),
            _attune("study", "status", "--storage", url, "--study", "no-such-study", cwd=tmp_path),
            _attune("study", "status", "--storage", url.rsplit("/", 1)[0] + "/nodb", cwd=tmp_path),
            _attune("tune", "--model", "tiny-llama", "--gpus", "8xH200", "--trials", "1", "--storage",
                    url.replace(f":{srv.port}/", ":1/"), "--storage-timeout", "1", "--out", str(tmp_path / "o2"),
                    cwd=tmp_path),
        ]
        assert runs[0].returncode == 0, runs[0].stderr.decode()[-2000:]
        assert runs[1].returncode == 0 and b"secret-test" in runs[1].stdout
        assert all(r.returncode != 0 for r in runs[3:]), [r.stderr[-300:] for r in runs[3:]]
        secret = PASSWORD.encode()
        for r in runs:
            assert secret not in r.stdout and secret not in r.stderr, (r.args, r.stdout[-500:], r.stderr[-500:])
            assert b"S3cr3t" not in r.stdout + r.stderr
        files = [p for p in tmp_path.rglob("*") if p.is_file()]
        assert any(p.name == "report.md" for p in files) and any(p.name == "recipe.yaml" for p in files)
        for p in files:
            assert b"S3cr3t" not in p.read_bytes(), p
        assert b"postgres:***@" in (out / "report.md").read_bytes()
    finally:
        srv.close()
