"""What tenant code and tenants may see of the control plane's environment and errors."""

from __future__ import annotations

import os

import pytest

from controller.access import scrub

ENV = {
    "CPN_ADMIN_TOKEN": "cpn_admin_0123456789abcdef",
    "CPN_DATABASE_URL": "postgresql+psycopg://cpn:very-secret-pw@db:5432/cpn",
    "CPN_CACHE_DIR": "/var/cache/cpn",
    "CPN_GLOO_IFNAME": "eth0",
    "CPN_RAY_NUM_CPUS": "2",
    "PGPASSWORD": "pg-password-1",
    "RAY_AUTH_TOKEN": "ray-token-0123456789",
    "HOME": "/home/cpn",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-0123456789",
    "PROMETHEUS_MULTIPROC_DIR": "/tmp/cpn-serve-x/metrics",
}


def test_workers_keep_what_they_use_and_lose_every_other_cpn_variable() -> None:
    assert scrub.withheld(ENV) == [
        "AWS_SECRET_ACCESS_KEY",  # S3 settings: only for checkpoints in an object store
        "CPN_ADMIN_TOKEN",
        "CPN_DATABASE_URL",
        "CPN_RAY_NUM_CPUS",
        "PGPASSWORD",
        "PROMETHEUS_MULTIPROC_DIR",  # cpn serve --workers: the workers' counters, not Ray's
    ]
    assert "AWS_SECRET_ACCESS_KEY" not in scrub.withheld(ENV, object_store=True)
    # Ray's token is withheld only where Ray's authentication is off (workers need it).
    assert "RAY_AUTH_TOKEN" in scrub.withheld({**ENV, "RAY_AUTH_MODE": "disabled"})
    assert scrub.worker_env_vars(ENV) == dict.fromkeys(scrub.withheld(ENV), "")


def test_the_environment_is_scrubbed_while_ray_starts_and_restored_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CPN_ADMIN_TOKEN", ENV["CPN_ADMIN_TOKEN"])
    monkeypatch.setenv("CPN_CACHE_DIR", ENV["CPN_CACHE_DIR"])
    with scrub.scrubbed_environ():
        assert "CPN_ADMIN_TOKEN" not in os.environ
        assert os.environ["CPN_CACHE_DIR"] == ENV["CPN_CACHE_DIR"]
    assert os.environ["CPN_ADMIN_TOKEN"] == ENV["CPN_ADMIN_TOKEN"]


def test_mask_hides_secret_values_and_a_urls_password() -> None:
    text = (
        f"token {ENV['CPN_ADMIN_TOKEN']} url {ENV['CPN_DATABASE_URL']} pw very-secret-pw "
        f"aws {ENV['AWS_SECRET_ACCESS_KEY']} cpus 2 cache /var/cache/cpn"
    )
    assert scrub.mask(text, ENV) == "token *** url *** pw *** aws *** cpus 2 cache /var/cache/cpn"


def test_remembered_settings_are_masked_too() -> None:
    scrub.remember("cpn_admin_given-as-a-setting-0123", None, "")
    assert scrub.mask("x cpn_admin_given-as-a-setting-0123 y", {}) == "x *** y"


def test_bound_keeps_the_head_and_the_tail() -> None:
    text = "head " + "x" * 10_000 + " tail"
    cut = scrub.bound(text, 100)
    assert len(cut) == 100 and cut.startswith("head ") and cut.endswith(" tail")
    assert scrub.bound("short", 100) == "short"


def test_internals_are_stripped_from_tracebacks() -> None:
    text = (
        "RuntimeError: \x1b[36mray::Worker.setup()\x1b[39m (pid=12, ip=10.0.0.9, actor_id=ff, "
        "repr=<training.worker.Worker object at 0x7fab>)\n"
        '  File "/srv/venv/lib/python3.11/site-packages/torch/nn/x.py", line 3, in f\n'
        "           ^^^^^^^^^^^^\n"
        '  File "/home/alice/task.py", line 7, in main\n'
        "ValueError: bad shape"
    )
    assert scrub.strip_internals(text) == (
        "RuntimeError: ray::Worker.setup()\n"
        '  File "x.py", line 3, in f\n'
        '  File "task.py", line 7, in main\n'
        "ValueError: bad shape"
    )


def test_tenant_error_masks_before_it_cuts() -> None:
    secret = "s3cret-" + "y" * 30
    scrub.remember(secret)
    # The head keeps 130 characters: the secret straddles the cut, so a cut before the mask
    # would leave its first characters behind.
    text = scrub.tenant_error(ValueError("a" * 110 + secret + "b" * 3000), limit=520)
    assert "s3cret" not in text and "aaa***" in text and len(text) <= 520
