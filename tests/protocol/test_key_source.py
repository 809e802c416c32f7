"""KeySource: the key file re-read when it changes, and never swapped for a broken or empty one."""

from __future__ import annotations

import hashlib

import pytest

from ferry.worker.common.key_source import KeySource


def _entry(key: str, tenant: str) -> str:
    return f"{hashlib.sha256(key.encode()).hexdigest()}:{tenant}\n"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "keys"
    path.write_text(_entry("k1", "alpha"))
    clock = Clock()
    return KeySource(None, str(path), check_interval_s=1.0, clock=clock), path, clock


def _tenants(source: KeySource) -> set[str]:
    return set(source.current().tenants)


def test_a_changed_file_is_read_after_the_check_interval(source):
    keys, path, clock = source
    assert _tenants(keys) == {"alpha"}
    path.write_text(_entry("k1", "alpha") + _entry("k2", "beta"))
    assert _tenants(keys) == {"alpha"}  # not checked again yet
    clock.now = 1.5
    assert _tenants(keys) == {"alpha", "beta"}


def test_a_broken_or_emptied_file_keeps_the_configuration_in_force(source, caplog):
    keys, path, clock = source
    path.write_text("not an entry\n")
    clock.now = 1.5
    assert _tenants(keys) == {"alpha"}
    assert "does not parse" in caplog.text
    path.write_text("# every key removed\n")
    clock.now = 3.0
    assert _tenants(keys) == {"alpha"} and "no keys at all" in caplog.text  # not open mode
    path.unlink()
    clock.now = 4.5
    assert _tenants(keys) == {"alpha"} and "unreadable" in caplog.text
    path.write_text(_entry("k3", "gamma"))
    clock.now = 6.0
    assert _tenants(keys) == {"gamma"}


def test_a_bad_file_at_start_up_is_an_error(tmp_path):
    path = tmp_path / "keys"
    path.write_text("not an entry\n")
    with pytest.raises(ValueError, match="expected"):
        KeySource(None, str(path))


def test_keys_from_the_environment_alone_never_reload():
    keys = KeySource(_entry("k1", "alpha").strip(), None)
    assert _tenants(keys) == {"alpha"} and keys.current() is keys.current()
