"""Ferry's worker side (`ferry.worker`): the engine, the `ferry worker` process, the wire it shares
with the API, snapshots, webhooks and tools."""

if __name__ == "worker":  # imported by its bare name from a checkout: become an alias of ferry.worker
    from ferry.worker.common.legacy_names import alias

    alias("worker", "ferry.worker")
