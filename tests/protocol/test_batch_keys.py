"""The Batch API's keys are cluster-safe: a batch's (or a file's) keys share one hash slot, and
none of them shares a slot with the job keys by construction (the tag is the batch id)."""

from __future__ import annotations

from redis.crc import key_slot

from ferry.worker.protocol import Keys


def test_every_key_of_a_batch_is_in_one_slot():
    keys = Keys("ferry")
    batch_id = "batch_0123456789abcdef0123456789abcdef"
    names = [keys.batch(batch_id), keys.batch_lease(batch_id), keys.batch_inflight(batch_id),
             keys.batch_parts(batch_id)]
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert all(f"{{{batch_id}}}" in n for n in names)


def test_tenant_indexes_are_tagged_by_a_digest_of_the_tenant():
    keys = Keys("ferry")
    for tenant in ("acme", "a{b}c", "x:y"):
        for name in (keys.tenant_files(tenant), keys.tenant_batches(tenant)):
            tag = name[name.index("{") + 1 : name.index("}")]
            assert len(tag) == 32 and all(c in "0123456789abcdef" for c in tag)
    assert keys.tenant_files("acme") != keys.tenant_files("acme2")
